"""Train / validation datasets of (input, target) radiograph pairs, at one size or each native.

`build_datasets(cfg, size, batch_size=1, min_side=MIN_SIZE, task="enhance", classes=1)` is
the one entry point the harness uses. Items are float32 tensors (1, height, width) in [0, 1]:
the input radiograph and its contrast-enhanced reference; for task "segment" the second is the
mask, uint8 class indices (1, height, width) (docs/segmentation.md). `size` is a side (square), (height, width), a canonical size of
memstudy.image_sizes ("HxW", "native") or None / "native": every image at its own resolution.

- synthetic: phantom `index` of `seed`; train takes indices 0..train-1, validation the next
  `val_images`, so the two never share an image. Any height x width (phantom.make_phantom).
- folder: a seeded random choice of `train_images + val_images` files, split train / val.
  Every chosen file is decoded when the datasets are built, so a bad file fails before
  training, and every bad file is listed in one error. How an image whose shape is not the
  size is treated is `data.resize`: "none" refuses it (nothing is resampled unless asked),
  "stretch" resizes each axis (aspect ratio NOT kept, as in the study; INTER_AREA to shrink,
  INTER_CUBIC to enlarge), "cover" scales both axes by one factor until the image covers the
  size and centre-crops the overflow (aspect ratio kept, nothing padded). Generated targets are
  enhanced at full resolution, then resized like the input. With a native size, batches of
  more than one image need every image to have the same shape (they are stacked).

Items are computed lazily and memoised per dataset (each DataLoader worker holds its own copy).
Memoised and cached items are stored as 16-bit (2, height, width) arrays (a mask's class
indices as they are), half of float32: the
quantisation step 1/65535 is far below what the loss can see, and it keeps 60 pairs at 4188 px
at 4.2 GB of host memory. With `cache_dir` set they are also cached on disk as .npy, keyed by
source, seed, index or file (path, size, mtime), image size, resize mode, generator version and
enhancement parameters, so repeated runs at large sizes skip generation.
"""
from __future__ import annotations

import hashlib
import numbers
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Sequence

import cv2
import numpy as np
import torch
from torch.utils.data import Dataset

from memstudy.datasets.enhance import EnhanceParams, enhance_contrast
from memstudy.datasets.folder import (ImageError, ImagePair, list_mask_pairs, list_pairs,
                                      load_image, load_mask)
from memstudy.datasets.phantom import GENERATOR_VERSION, MIN_SIZE, make_mask, make_phantom
from memstudy.config import SOURCES, DataConfig  # noqa: F401 (re-exported)
from memstudy.config import check_segment_classes
from memstudy.errors import ConfigError
from memstudy.image_sizes import RESIZE_MODES, is_native, size_hw

_CACHE_FORMAT = 1  # bump when the on-disk layout changes


class ItemSource(Protocol):
    """Where one (input, target) pair comes from; the target is a mask of class indices
    (uint8) when the source's `classes` is set (segmentation), else an image in [0, 1]."""
    name: str

    def cache_key(self) -> str: ...
    def check(self, notes: list[str]) -> tuple[int, int] | None: ...
    def make(self, hw: tuple[int, int] | None, params: EnhanceParams,
             resize: str) -> tuple[np.ndarray, np.ndarray]: ...


@dataclass(frozen=True)
class PhantomSource:
    seed: int
    index: int
    classes: int | None = None  # segmentation: the mask's classes (phantom.make_mask)

    @property
    def name(self) -> str:
        return f"phantom-s{self.seed}-i{self.index}"

    def cache_key(self) -> str:
        return f"synthetic|seed={self.seed}|index={self.index}"

    def check(self, notes: list[str]) -> None:
        """Phantoms cannot fail once size, seed and index are valid; they have no own shape."""
        return None

    def make(self, hw: tuple[int, int] | None, params: EnhanceParams,
             resize: str) -> tuple[np.ndarray, np.ndarray]:
        if hw is None:
            raise ValueError("phantoms have no native size; give train.image_size a size")
        size = hw if hw[0] != hw[1] else hw[0]
        raw = make_phantom(size, self.seed, self.index)
        image = raw.astype(np.float32) / np.float32(65535)
        if self.classes is not None:
            return image, make_mask(size, self.seed, self.index, self.classes)
        return image, enhance_contrast(raw, params)


@dataclass(frozen=True)
class FileSource:
    pair: ImagePair
    classes: int | None = None  # segmentation: pair.target is a mask of this many classes

    @property
    def name(self) -> str:
        return self.pair.input.stem

    def cache_key(self) -> str:
        files = [p for p in (self.pair.input, self.pair.target) if p is not None]
        return "folder|" + "|".join(f"{p.resolve()}:{p.stat().st_size}:{p.stat().st_mtime_ns}"
                                    for p in files)

    def check(self, notes: list[str]) -> tuple[int, int]:
        """Decode the file (and its target); its (height, width). Conversions go to `notes`."""
        image = load_image(self.pair.input, notes)
        if self.pair.target is not None:
            target = self._target()
            if target.shape != image.shape:
                (th, tw), (ih, iw) = target.shape, image.shape
                what = "target" if self.classes is None else "mask"
                raise ImageError(f"{self.pair.target}: {what} is {th}x{tw} px (height x width) "
                                 f"but its input {self.pair.input.name} is {ih}x{iw} px; pairs "
                                 "must match")
        return image.shape

    def _target(self) -> np.ndarray:
        if self.classes is None:
            return load_image(self.pair.target)
        return load_mask(self.pair.target, self.classes)

    def make(self, hw: tuple[int, int] | None, params: EnhanceParams,
             resize: str) -> tuple[np.ndarray, np.ndarray]:
        image = load_image(self.pair.input)
        if self.pair.target is None:
            target = enhance_contrast(image, params)  # at full resolution, then resized
        else:
            target = self._target()
        if hw is None or image.shape == hw:
            return image, target
        if resize == "none":  # build_datasets refuses this before training; never resample
            raise ValueError(f"{self.pair.input}: {image.shape} is not {hw} and data.resize = "
                             "'none'")
        # a mask's class indices are taken from the nearest pixel, never blended
        return resize_to(image, hw, resize), resize_to(target, hw, resize,
                                                       nearest=self.classes is not None)


def resize_to(image: np.ndarray, hw: tuple[int, int], mode: str,
              nearest: bool = False) -> np.ndarray:
    """`image` as hw = (height, width): 'stretch' per axis, or 'cover' (one scale, centre crop).
    `nearest`: each pixel takes its nearest source pixel (masks of class indices)."""
    height, width = hw
    resample = _nearest if nearest else _resample
    if mode == "stretch":
        return resample(image, height, width)
    if mode != "cover":
        raise ValueError(f"data.resize {mode!r} does not resample; use 'stretch' or 'cover'")
    scale = max(height / image.shape[0], width / image.shape[1])
    # at least the target on each side, despite rounding
    h, w = max(height, round(image.shape[0] * scale)), max(width, round(image.shape[1] * scale))
    scaled = resample(image, h, w)
    top, left = (h - height) // 2, (w - width) // 2
    return np.ascontiguousarray(scaled[top:top + height, left:left + width])


def _resample(image: np.ndarray, height: int, width: int) -> np.ndarray:
    """Area to shrink, cubic to enlarge, per axis; clipped (cubic overshoots at edges)."""
    h, w = image.shape
    if w != width:
        interp = cv2.INTER_AREA if w > width else cv2.INTER_CUBIC
        image = cv2.resize(image, (width, h), interpolation=interp)
    if h != height:
        interp = cv2.INTER_AREA if h > height else cv2.INTER_CUBIC
        image = cv2.resize(image, (width, height), interpolation=interp)
    return np.clip(image, 0, 1)


def _nearest(mask: np.ndarray, height: int, width: int) -> np.ndarray:
    return cv2.resize(mask, (width, height), interpolation=cv2.INTER_NEAREST)


def resize_square(image: np.ndarray, size: int) -> np.ndarray:
    """Resize to size x size (aspect ratio not kept): data.resize = 'stretch' to a square."""
    return _resample(image, size, size)


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def as_hw(size) -> tuple[int, int] | None:
    """(height, width) of any size form (int, pair, 'HxW', 'native' / None -> None)."""
    if size is None or is_native(size):
        return None
    if isinstance(size, tuple) and len(size) == 2 and all(_is_int(v) for v in size):
        hw = (int(size[0]), int(size[1]))
    elif _is_int(size) or isinstance(size, str):
        try:
            hw = size_hw(size)
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
    else:
        raise ValueError(f"image size must be a side, (height, width), 'HxW' or 'native', "
                         f"got {size!r}")
    if min(hw) < MIN_SIZE:
        raise ValueError(f"image size must be >= {MIN_SIZE} px per side, got {size!r}")
    return hw


class RadiographDataset(Dataset):
    """(input, target) float32 tensors of shape (1, height, width) in [0, 1]; with `classes`
    set (segmentation, the sources' masks) the target is a uint8 mask of class indices.

    `size` as in `as_hw` (None / 'native': each file at its own shape). Every source is checked
    (files decoded) here; all bad files are reported in one ImageError."""

    def __init__(self, sources: Sequence[ItemSource], size,
                 cache_dir: str | os.PathLike | None = None, params: EnhanceParams | None = None,
                 resize: str = "none", checked: tuple[list, dict] | None = None,
                 classes: int | None = None):
        self.hw = as_hw(size)
        self.classes = classes
        self.resize = resize
        self.sources = tuple(sources)
        if not self.sources:
            raise ValueError("a RadiographDataset needs at least one image")
        self.params = params or EnhanceParams()
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        if self.cache_dir is not None:
            self.cache_dir.mkdir(parents=True, exist_ok=True)  # unwritable: fail now
        # `checked`: check_sources' result when the caller already decoded these sources
        self.source_shapes, self.notes = checked or check_sources(self.sources)
        if self.hw is None and None in self.source_shapes:
            raise ValueError("phantoms have no native size; give train.image_size a size")
        self._memo: dict[int, np.ndarray] = {}

    @property
    def size_label(self) -> str:
        return "native" if self.hw is None else (
            str(self.hw[0]) if self.hw[0] == self.hw[1] else f"{self.hw[0]}x{self.hw[1]}")

    @property
    def shapes(self) -> list[tuple[int, int]]:
        """(height, width) of every item as the network gets it."""
        return [self.hw or shape for shape in self.source_shapes]

    @property
    def names(self) -> list[str]:
        return [source.name for source in self.sources]

    def __len__(self) -> int:
        return len(self.sources)

    def load(self) -> None:
        """Read, decode or draw every item now (each is kept, as `__getitem__` keeps it), so that
        a metered phase that reads them later times its own work: a 16384 px phantom takes
        tens of seconds of CPU to draw, more than the validation forward that reads it."""
        for i in range(len(self)):
            if i not in self._memo:
                self._memo[i] = self._load(i)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        i = range(len(self))[i]  # IndexError out of range, negative indices allowed
        if i not in self._memo:
            self._memo[i] = self._load(i)
        stored = self._memo[i]
        if self.classes is not None:  # the mask's class indices, stored as they are
            image = torch.from_numpy(stored[0:1].astype(np.float32)).div_(65535)
            return image, torch.from_numpy(stored[1:2].astype(np.uint8))
        both = torch.from_numpy(stored.astype(np.float32)).div_(65535)
        return both[0:1], both[1:2]

    def _cache_path(self, source: ItemSource) -> Path:
        key = (f"{source.cache_key()}|size={self.size_label}|resize={self.resize}"
               f"|generator={GENERATOR_VERSION}|enhance={self.params!r}|format={_CACHE_FORMAT}")
        if self.classes is not None:  # a mask instead of a target (enhancement keys unchanged)
            key += f"|mask_classes={self.classes}"
        digest = hashlib.sha256(key.encode()).hexdigest()[:16]
        return self.cache_dir / f"{source.name}-{self.size_label}px-{digest}.npy"

    def _load(self, i: int) -> np.ndarray:
        source, shape = self.sources[i], self.shapes[i]
        path = self._cache_path(source) if self.cache_dir is not None else None
        if path is not None and path.is_file():
            try:
                cached = np.load(path, allow_pickle=False)
                if cached.shape == (2, *shape) and cached.dtype == np.uint16:
                    return cached
            except (OSError, ValueError, EOFError):
                pass  # a damaged cache entry: regenerate it below
        image, target = source.make(self.hw, self.params, self.resize)
        if self.classes is None:
            target = np.rint(target * 65535)
        both = np.stack([np.rint(image * 65535), target]).astype(np.uint16)
        if path is not None:
            temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            with open(temporary, "wb") as f:
                np.save(f, both)
            os.replace(temporary, path)  # atomic: concurrent runs never read half a file
        return both


def check_sources(sources: Sequence[ItemSource],
                  problems: Sequence[str] = ()) -> tuple[list, dict[str, list[str]]]:
    """Decode every source; their shapes and conversion notes (note -> names), or one
    ImageError listing every file that cannot be used, not only the first, after the
    `problems` found before (images and masks that do not pair)."""
    shapes, notes, errors = [], {}, list(problems)
    for source in sources:
        found: list[str] = []
        try:
            shapes.append(source.check(found))
        except ImageError as exc:
            errors.append(str(exc))
            shapes.append(None)
        for note in found:
            notes.setdefault(note, []).append(source.name)
    if len(errors) == 1:
        raise ImageError(errors[0])
    if problems:
        raise ImageError(f"{len(errors)} problems with the images and masks of data.path:\n  "
                         + "\n  ".join(errors))
    if errors:
        raise ImageError(f"{len(errors)} of {len(sources)} images cannot be used:\n  "
                         + "\n  ".join(errors))
    return shapes, notes


def _folder_pairs(cfg: DataConfig, classes: int | None) -> list[ImagePair]:
    """The folder's pairs; for masks, every pairing problem is listed in one ImageError with
    the problems of every paired file (decoded for that), so that one error says it all."""
    if classes is None:
        return list_pairs(cfg.path)
    pairs, problems = list_mask_pairs(cfg.path)
    if problems:
        check_sources([FileSource(pair, classes) for pair in pairs], problems)
    return pairs


def _split_folder(cfg: DataConfig,
                  classes: int | None) -> tuple[list[FileSource], list[FileSource]]:
    pairs = _folder_pairs(cfg, classes)
    need = cfg.train_images + cfg.val_images
    if len(pairs) < need:
        raise ValueError(f"data.path {str(cfg.path)!r} holds {len(pairs)} images but "
                         f"data.train_images + data.val_images = {cfg.train_images} + "
                         f"{cfg.val_images} = {need}; lower data.train_images / data.val_images "
                         "or add images")
    order = np.random.default_rng(cfg.seed).permutation(len(pairs))
    train = sorted(order[: cfg.train_images])
    val = sorted(order[cfg.train_images: need])
    return ([FileSource(pairs[i], classes) for i in train],
            [FileSource(pairs[i], classes) for i in val])


def build_datasets(cfg: DataConfig, size, batch_size: int = 1, min_side: int = MIN_SIZE,
                   task: str = "enhance",
                   classes: int = 1) -> tuple[RadiographDataset, RadiographDataset]:
    """Train and validation datasets, validated (files decoded, shapes checked) up front.
    task "segment": targets are masks of `classes` classes (model.classes; 1 = binary).

    Refused with a ConfigError naming the setting: folder images whose shape is not `size`
    with data.resize = 'none'; native images with a side below `min_side`; native images of
    different shapes with batch_size > 1 (a batch is stacked)."""
    cfg.validate()
    hw = as_hw(size)
    masks = classes if task == "segment" else None
    cache = cfg.cache_dir or os.environ.get("MEMSTUDY_CACHE") or None  # env: a machine-wide cache
    if cfg.source == "synthetic":
        if hw is None:
            raise ConfigError("train.image_size = 'native' needs folder data; set data.source = "
                              "'folder' and data.path, or give a size such as 1024")
        if masks is not None:  # what RunConfig.check refuses; here for callers without one
            check_segment_classes(masks, cfg.source)
        train = [PhantomSource(cfg.seed, i, masks) for i in range(cfg.train_images)]
        val = [PhantomSource(cfg.seed, cfg.train_images + i, masks)
               for i in range(cfg.val_images)]
        return (RadiographDataset(train, hw, cache, classes=masks),
                RadiographDataset(val, hw, cache, classes=masks))
    train, val = _split_folder(cfg, masks)
    shapes, notes = check_sources([*train, *val])  # every bad file of both, in one error
    check_shapes([s.name for s in (*train, *val)], shapes, hw, cfg.resize, batch_size, min_side)
    n = len(train)
    split = {"train": (train, shapes[:n]), "val": (val, shapes[n:])}
    return tuple(RadiographDataset(sources, hw, cache, resize=cfg.resize,
                                   checked=(part, _notes_of(notes, sources)), classes=masks)
                 for sources, part in split.values())


def _notes_of(notes: dict[str, list[str]], sources) -> dict[str, list[str]]:
    names = {s.name for s in sources}
    return {k: [n for n in v if n in names] for k, v in notes.items() if set(v) & names}


def check_shapes(names: list[str], shapes: list[tuple[int, int]], hw: tuple[int, int] | None,
                 resize: str, batch_size: int, min_side: int) -> None:
    """The size rules of folder data (see build_datasets), each naming what to change."""
    def listing(pairs) -> str:
        return ", ".join(f"{n} ({h}x{w})" for n, (h, w) in pairs)

    if hw is not None:
        wrong = [(n, s) for n, s in zip(names, shapes) if s != hw]
        if wrong and resize == "none":
            raise ConfigError(
                f"{len(wrong)} folder image(s) are not train.image_size = {hw[0]}x{hw[1]} "
                f"(height x width): {listing(wrong[:8])}{' ...' if len(wrong) > 8 else ''}; "
                "data.resize = 'none' resamples nothing: set data.resize = 'stretch' or "
                "'cover', or train.image_size = 'native'")
        return
    small = [(n, s) for n, s in zip(names, shapes) if min(s) < min_side]
    if small:
        raise ConfigError(f"train.image_size = 'native': {len(small)} image(s) have a side below "
                          f"the {min_side} px minimum of the loss: {listing(small[:8])}; give "
                          "train.image_size a size with data.resize = 'stretch' or 'cover', or "
                          "lower train.msssim_scales")
    if batch_size > 1 and len(set(shapes)) > 1:
        counts = ", ".join(f"{h}x{w}: {shapes.count((h, w))}" for h, w in sorted(set(shapes)))
        raise ConfigError(f"train.image_size = 'native' with train.batch_size = {batch_size}: the "
                          f"images differ in shape ({counts}) and a batch is stacked; use "
                          "train.batch_size = 1, or a fixed train.image_size with data.resize = "
                          "'stretch' or 'cover'")


def describe_datasets(train: RadiographDataset, val: RadiographDataset) -> dict:
    """What was done to the data, for the run's record: the size, how many images were
    resampled (and how), their native shapes and any conversions made while reading them."""
    facts: dict = {"size": train.size_label, "resize": train.resize}
    if train.classes is not None:  # segmentation: the masks' classes
        facts["mask_classes"] = train.classes
    for part, ds in (("train", train), ("val", val)):
        native = [s for s in ds.source_shapes if s is not None]
        if native:  # folder data: the files' own shapes, and how many the size changed
            facts[f"{part}_native_shapes"] = {f"{h}x{w}": native.count((h, w))
                                              for h, w in sorted(set(native))}
            facts[f"{part}_resampled"] = sum(ds.hw is not None and s != ds.hw for s in native)
        if ds.notes:
            facts[f"{part}_conversions"] = ds.notes
    return facts
