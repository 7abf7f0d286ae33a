"""Byte-size parsing and formatting shared by the CLI, configs and reports."""
import re

MB = 1024 * 1024  # memstudy's "MB" is the MiB, as torch.cuda and nvidia-smi report it
_UNITS = {"": 1, "B": 1, "K": 1024, "KB": 1024, "KIB": 1024, "M": MB, "MB": MB, "MIB": MB,
          "G": 1024**3, "GB": 1024**3, "GIB": 1024**3, "T": 1024**4, "TB": 1024**4, "TIB": 1024**4}


def parse_bytes(text: str | int | float, what: str = "size") -> int:
    """'8GiB' -> 8589934592. Decimal and binary suffixes both mean powers of 1024."""
    if isinstance(text, (int, float)):
        return int(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"{what} {text!r} is not a byte size; write e.g. 8GiB, 512MiB or 1e9")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def mb(nbytes: float | None) -> float | None:
    return None if nbytes is None else nbytes / MB
