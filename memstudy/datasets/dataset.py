"""Train / validation datasets of (input, target) radiograph pairs at one square size.

`build_datasets(cfg, size)` is the one entry point the harness uses. Items are float32 tensors
(1, size, size) in [0, 1]: the input radiograph and its contrast-enhanced reference.

- synthetic: phantom `index` of `seed`; train takes indices 0..train-1, validation the next
  `val_images`, so the two never share an image.
- folder: a seeded random choice of `train_images + val_images` files, split train / val.
  Every chosen file is decoded when the dataset is built, so a bad file fails before training.
  Images are squared by resizing (aspect ratio NOT preserved, as in the study): INTER_AREA to
  shrink, INTER_CUBIC to enlarge, per axis. Generated targets are enhanced at full resolution,
  then resized like the input.

Items are computed lazily and memoised per dataset (each DataLoader worker holds its own copy).
Memoised and cached items are stored as 16-bit (2, size, size) arrays, half of float32: the
quantisation step 1/65535 is far below what the loss can see, and it keeps 60 pairs at 4188 px
at 4.2 GB of host memory. With `cache_dir` set they are also cached on disk as .npy, keyed by
source, seed, index or file (path, size, mtime), image size, generator version and enhancement
parameters, so repeated runs at large sizes skip generation.
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
from memstudy.datasets.folder import ImageError, ImagePair, list_pairs, load_image
from memstudy.config import SOURCES, DataConfig  # noqa: F401 (re-exported: the data section)
from memstudy.datasets.phantom import GENERATOR_VERSION, MIN_SIZE, make_phantom

_CACHE_FORMAT = 1  # bump when the on-disk layout changes


class ItemSource(Protocol):
    """Where one (input, target) pair comes from."""
    name: str

    def cache_key(self) -> str: ...
    def check(self) -> None: ...
    def make(self, size: int, params: EnhanceParams) -> tuple[np.ndarray, np.ndarray]: ...


@dataclass(frozen=True)
class PhantomSource:
    seed: int
    index: int

    @property
    def name(self) -> str:
        return f"phantom-s{self.seed}-i{self.index}"

    def cache_key(self) -> str:
        return f"synthetic|seed={self.seed}|index={self.index}"

    def check(self) -> None:
        """Phantoms cannot fail once size, seed and index are valid."""

    def make(self, size: int, params: EnhanceParams) -> tuple[np.ndarray, np.ndarray]:
        raw = make_phantom(size, self.seed, self.index)
        return raw.astype(np.float32) / np.float32(65535), enhance_contrast(raw, params)


@dataclass(frozen=True)
class FileSource:
    pair: ImagePair

    @property
    def name(self) -> str:
        return self.pair.input.stem

    def cache_key(self) -> str:
        files = [p for p in (self.pair.input, self.pair.target) if p is not None]
        return "folder|" + "|".join(f"{p.resolve()}:{p.stat().st_size}:{p.stat().st_mtime_ns}"
                                    for p in files)

    def check(self) -> None:
        image = load_image(self.pair.input)
        if self.pair.target is not None:
            target = load_image(self.pair.target)
            if target.shape != image.shape:
                (th, tw), (ih, iw) = target.shape, image.shape
                raise ImageError(f"{self.pair.target}: target is {tw}x{th} px but its input "
                                 f"{self.pair.input.name} is {iw}x{ih} px; pairs must match")

    def make(self, size: int, params: EnhanceParams) -> tuple[np.ndarray, np.ndarray]:
        image = load_image(self.pair.input)
        if self.pair.target is None:
            target = enhance_contrast(image, params)  # at full resolution, then resized
        else:
            target = load_image(self.pair.target)
        return resize_square(image, size), resize_square(target, size)


def resize_square(image: np.ndarray, size: int) -> np.ndarray:
    """Resize to size x size (aspect ratio not kept); area to shrink, cubic to enlarge, per axis."""
    h, w = image.shape
    if w != size:
        interp = cv2.INTER_AREA if w > size else cv2.INTER_CUBIC
        image = cv2.resize(image, (size, h), interpolation=interp)
    if h != size:
        interp = cv2.INTER_AREA if h > size else cv2.INTER_CUBIC
        image = cv2.resize(image, (size, size), interpolation=interp)
    return np.clip(image, 0, 1)  # cubic interpolation overshoots at edges


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_size(size) -> int:
    if not _is_int(size) or size < MIN_SIZE:
        raise ValueError(f"image size must be an integer >= {MIN_SIZE} px, got {size!r}")
    return int(size)


class RadiographDataset(Dataset):
    """(input, target) float32 tensors of shape (1, size, size) in [0, 1]."""

    def __init__(self, sources: Sequence[ItemSource], size: int,
                 cache_dir: str | os.PathLike | None = None, params: EnhanceParams | None = None):
        self.size = _check_size(size)
        self.sources = tuple(sources)
        if not self.sources:
            raise ValueError("a RadiographDataset needs at least one image")
        self.params = params or EnhanceParams()
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        if self.cache_dir is not None:
            self.cache_dir.mkdir(parents=True, exist_ok=True)  # unwritable: fail now
        for source in self.sources:
            source.check()
        self._memo: dict[int, np.ndarray] = {}

    @property
    def names(self) -> list[str]:
        return [source.name for source in self.sources]

    def __len__(self) -> int:
        return len(self.sources)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        i = range(len(self))[i]  # IndexError out of range, negative indices allowed
        if i not in self._memo:
            self._memo[i] = self._load(self.sources[i])
        both = torch.from_numpy(self._memo[i].astype(np.float32)).div_(65535)
        return both[0:1], both[1:2]

    def _cache_path(self, source: ItemSource) -> Path:
        key = (f"{source.cache_key()}|size={self.size}|generator={GENERATOR_VERSION}"
               f"|enhance={self.params!r}|format={_CACHE_FORMAT}")
        digest = hashlib.sha256(key.encode()).hexdigest()[:16]
        return self.cache_dir / f"{source.name}-{self.size}px-{digest}.npy"

    def _load(self, source: ItemSource) -> np.ndarray:
        path = self._cache_path(source) if self.cache_dir is not None else None
        if path is not None and path.is_file():
            try:
                cached = np.load(path, allow_pickle=False)
                if cached.shape == (2, self.size, self.size) and cached.dtype == np.uint16:
                    return cached
            except (OSError, ValueError, EOFError):
                pass  # a damaged cache entry: regenerate it below
        image, target = source.make(self.size, self.params)
        both = np.rint(np.stack([image, target]) * 65535).astype(np.uint16)
        if path is not None:
            temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            with open(temporary, "wb") as f:
                np.save(f, both)
            os.replace(temporary, path)  # atomic: concurrent runs never read half a file
        return both


def _split_folder(cfg: DataConfig) -> tuple[list[FileSource], list[FileSource]]:
    pairs = list_pairs(cfg.path)
    need = cfg.train_images + cfg.val_images
    if len(pairs) < need:
        raise ValueError(f"data.path {str(cfg.path)!r} holds {len(pairs)} images but "
                         f"data.train_images + data.val_images = {cfg.train_images} + "
                         f"{cfg.val_images} = {need}; lower data.train_images / data.val_images "
                         "or add images")
    order = np.random.default_rng(cfg.seed).permutation(len(pairs))
    train = sorted(order[: cfg.train_images])
    val = sorted(order[cfg.train_images: need])
    return [FileSource(pairs[i]) for i in train], [FileSource(pairs[i]) for i in val]


def build_datasets(cfg: DataConfig, size: int) -> tuple[RadiographDataset, RadiographDataset]:
    """Train and validation datasets at size x size px, validated (files decoded) up front."""
    cfg.validate()
    size = _check_size(size)
    if cfg.source == "synthetic":
        train = [PhantomSource(cfg.seed, i) for i in range(cfg.train_images)]
        val = [PhantomSource(cfg.seed, cfg.train_images + i) for i in range(cfg.val_images)]
    else:
        train, val = _split_folder(cfg)
    cache = cfg.cache_dir or os.environ.get("MEMSTUDY_CACHE") or None  # env: a machine-wide cache
    return (RadiographDataset(train, size, cache), RadiographDataset(val, size, cache))
