"""Byte-size parsing and formatting shared by the CLI, configs and reports."""
import re

MB = 1024 * 1024  # memstudy's "MB" is the MiB, as torch.cuda and nvidia-smi report it
_UNITS = {"": 1, "B": 1, "K": 1024, "KB": 1024, "KIB": 1024, "M": MB, "MB": MB, "MIB": MB,
          "G": 1024**3, "GB": 1024**3, "GIB": 1024**3, "T": 1024**4, "TB": 1024**4, "TIB": 1024**4}


ByteSize = str | int | float  # "8GiB", "512 MiB", "1e9", 8589934592 or 1e9 (TOML)


def parse_bytes(text: ByteSize, what: str = "size") -> int:
    """'8GiB' -> 8589934592, '1e9' -> 1000000000. Decimal and binary suffixes both mean powers
    of 1024; a bare number (exponent allowed) is bytes. Negative sizes are refused."""
    if isinstance(text, bool):
        raise ValueError(f"{what} {text!r} is not a byte size; write e.g. 8GiB, 512MiB or 1e9")
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
        if not m or m.group(2).upper() not in _UNITS:
            raise ValueError(f"{what} {text!r} is not a byte size; write e.g. 8GiB, 512MiB or 1e9")
        value = float(m.group(1)) * _UNITS[m.group(2).upper()]
    if not 0 <= value < float("inf"):
        raise ValueError(f"{what} {text!r} must be a non-negative byte size, e.g. 8GiB or 1e9")
    return int(value)


def mb(nbytes: float | None) -> float | None:
    return None if nbytes is None else nbytes / MB


_BINARY = (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", MB), ("KiB", 1024))


def size_text(nbytes: int | float) -> str:
    """A byte count in the largest binary unit it fills, as a user would write it:
    400 MiB -> '400MiB' (not '0.390625GiB'), 1024 -> '1KiB', 1e9 -> '953.7MiB', 10 -> '10B'."""
    for unit, scale in _BINARY:
        if nbytes >= scale:
            value = nbytes / scale
            if value == int(value) or value >= 1000:  # whole, or too large for decimals
                return f"{value:.0f}{unit}"
            return f"{value:.4g}{unit}"
    return f"{int(nbytes)}B"
