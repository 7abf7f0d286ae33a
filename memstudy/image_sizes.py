"""Image sizes as the user writes them: `4188`, `"4188x3500"` (height x width) or `"native"`.

One parser for every place a size is given (TOML, `--set`, `--size`, grid specs, maxres), so
the same text means the same run everywhere. The parsed, canonical form is what the resolved
config stores and hashes:
- a square is an int (`"4188"`, `"4188x4188"` and `4188` are one run, and hashes of runs
  recorded before rectangles existed stay valid);
- a rectangle is the string `"HxW"` without spaces or leading zeros;
- `"native"` means every image at its own resolution (folder data only).
Pure Python on purpose (no torch, no cv2): the CLI and the config import it cheaply.
"""
from __future__ import annotations

import numbers
import re

from memstudy.errors import ConfigError

NATIVE = "native"
_HXW = re.compile(r"(\d+)\s*[xX×]\s*(\d+)")
FORMS = "an integer (4188), 'HEIGHTxWIDTH' ('4188x3500') or 'native'"

Size = int | str  # canonical: int (square), "HxW" (rectangle) or "native"


def parse_size(value: object, setting: str = "train.image_size") -> Size:
    """The canonical form of a size, or a ConfigError naming `setting`.

    Only the syntax and positivity are checked here; the loss's minimum side is checked
    where the number of MS-SSIM scales is known (quality.check_image_size)."""
    if isinstance(value, bool):
        raise ConfigError(f"{setting} = {value!r} is not a size; write {FORMS}")
    if isinstance(value, numbers.Integral):
        return _square(int(value), int(value), setting, value)
    if isinstance(value, str):
        text = value.strip()
        if text.lower() == NATIVE:
            return NATIVE
        if text.isdigit():
            return _square(int(text), int(text), setting, value)
        match = _HXW.fullmatch(text)
        if match:
            return _square(int(match[1]), int(match[2]), setting, value)
    raise ConfigError(f"{setting} = {value!r} is not a size; write {FORMS}")


def _square(height: int, width: int, setting: str, given: object) -> Size:
    if height < 1 or width < 1:
        raise ConfigError(f"{setting} = {given!r}: every side must be >= 1 px; write {FORMS}")
    return height if height == width else f"{height}x{width}"


def size_hw(size: Size) -> tuple[int, int] | None:
    """(height, width) of a canonical size; None for native (each image its own)."""
    size = parse_size(size)
    if size == NATIVE:
        return None
    if isinstance(size, int):
        return size, size
    height, width = size.split("x")
    return int(height), int(width)


def is_native(size: object) -> bool:
    return isinstance(size, str) and size.strip().lower() == NATIVE


def size_label(size: Size) -> str:
    """'4188', '4188x3500' or 'native': how tables and progress lines show a size."""
    return str(parse_size(size))


RESIZE_MODES = ("none", "stretch", "cover")  # data.resize; docs/data.md


def check_size_source(size: Size, source: str, resize: str) -> None:
    """Cross-field rules between train.image_size, data.source and data.resize."""
    if size == NATIVE and source != "folder":
        raise ConfigError("train.image_size = 'native' needs folder data (each image at its own "
                          f"resolution); data.source is {source!r}: give a size such as 1024 or "
                          "'1024x768', or set data.source = 'folder' with data.path")
    if resize != "none" and source != "folder":
        raise ConfigError(f"data.resize = {resize!r} applies to folder data only (phantoms are "
                          "generated at train.image_size); set data.resize = 'none'")
    if resize != "none" and size == NATIVE:
        raise ConfigError(f"data.resize = {resize!r} with train.image_size = 'native' asks for "
                          "two things: keep native sizes (data.resize = 'none') or give "
                          "train.image_size a size to resize to")


def size_sort_key(size: Size) -> tuple[int, int, int]:
    """Orders stored sizes of every form together (int squares, 'HxW', 'native'): by pixels,
    then height; native last. Tables and plots of a database that mixes forms sort with it."""
    hw = size_hw(size)
    if hw is None:
        return (1, 0, 0)
    return (0, hw[0] * hw[1], hw[0])


INPUT_BYTES_PER_PIXEL = 4  # float32, one channel: the least an input image takes in memory


def host_memory_bytes() -> int | None:
    """This host's physical memory (None where the OS does not say)."""
    import os

    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_input_fits(size: Size, batch_size: int, setting: str = "train.image_size") -> None:
    """Refuse, before anything is built or recorded, a size whose input batch alone (float32,
    one channel: a lower bound, targets and activations come on top) exceeds this host's
    memory: every image is made or read there first, whatever the device trains on."""
    hw = size_hw(size)
    have = host_memory_bytes()
    if hw is None or not have:
        return
    need = hw[0] * hw[1] * batch_size * INPUT_BYTES_PER_PIXEL
    if need > have:
        from memstudy.byte_sizes import size_text

        raise ConfigError(f"{setting} {size_label(size)}: one batch's input alone takes "
                          f"{size_text(need)} (float32, batch {batch_size}), more than this "
                          f"host's {size_text(have)} of memory; choose a smaller size")
