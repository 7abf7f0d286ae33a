"""Run configuration: small dataclasses, loaded from TOML or CLI flags, validated up front.

A resolved config (techniques in canonical form, defaults filled in) is what gets hashed
and stored with every result, so a result always says exactly what was measured.

Every setting is checked against its field's declared type (memstudy.typecheck) however it
arrives (TOML, `--set`, grid specs), then against its range by its section's `check`; errors
name the setting. This module imports neither torch nor cv2.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import numbers
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memstudy.errors import ConfigError
from memstudy.network import ModelConfig
from memstudy.image_sizes import RESIZE_MODES, check_size_source, parse_size
from memstudy.byte_sizes import ByteSize, parse_bytes
from memstudy.typecheck import check_fields, field_types, typed_value

OPTIMIZERS = ("adam", "adamw", "sgd")
DEVICES = ("auto", "cpu", "cuda")
VAL_PRECISIONS = ("run", "float32")  # train.val_precision
TASKS = ("enhance", "segment")  # train.task (docs/segmentation.md)
# A process setting, not a run setting: a grid cell that runs beside others gets its share of
# the host's CPU threads through this variable (grid.scheduler.cell_threads, runner.execute)
CELL_THREADS_ENV = "MEMSTUDY_CELL_THREADS"
# Settings added after results were recorded, left out of the config hash at their default
# (what every earlier run did), so recorded grids, maxres probes and tune trials still resume.
HASH_NEUTRAL_DEFAULTS = (("train", "val_precision", "run"), ("meter", "profile", False),
                         ("train", "task", "enhance"))
# The form of the config hash. Raise it when a change to the configs alters the hashes of runs
# that measure the same thing, or when it must make old records of a config stop counting: the
# pinned hashes in tests/test_records.py fail until this is raised and they are renewed, and
# `memstudy grid` names each cell that an older record no longer covers and why.
HASH_SCHEMA = 2  # 2: train.loss_chunk_rows defaults to "auto" (block height from the memory left)


@dataclass
class TrainConfig:
    image_size: int | str = 256  # 4188, "4188x3500" (height x width) or "native" (memstudy/image_sizes.py)
    batch_size: int = 1
    epochs: int = 1
    max_steps: int | None = None  # stop after this many optimizer steps (all epochs together)
    lr: float = 1e-3
    optimizer: str = "adam"
    weight_decay: float = 0.0
    seed: int = 0
    device: str = "auto"  # auto: cuda if available, else cpu; "cuda:1" picks a GPU
    warmup_steps: int = 3  # never measured: allocator and kernel warm-up (first CPU steps were seen
    # taking many times longer than later ones), cuDNN algorithm choice, lazy optimizer state
    measure_steps: int = 3  # steps after warm-up measured phase by phase
    msssim_scales: int = 5  # MS-SSIM scales; decides the smallest trainable image
    # MS-SSIM loss computed in blocks of this many map rows (memstudy/msssim_chunked.py: same
    # value and gradient, no full-resolution maps kept); 0 = pytorch-msssim's own autograd;
    # "auto" = the largest block that fits the memory left under the allocator's cap when the
    # loss runs (quality.auto_chunk_rows; 256 rows on the CPU, which has no cap)
    loss_chunk_rows: int | str = "auto"
    validate: bool = True
    # The tuned baseline a hand-written CUDA loop uses (docs/metrics.md, "Run settings"); unset
    # (None) means on for CUDA, off on the CPU, and the resolved config stores what was used.
    channels_last: bool | None = None  # weights and batches in channels_last (NHWC) layout
    cudnn_benchmark: bool | None = None  # torch.backends.cudnn.benchmark: cuDNN times its
    # convolution algorithms for each new shape (in warm-up) and keeps the fastest
    # Training policy ([Compute-Opt] (docs/references.md) III.C, memstudy/policy.py, docs/techniques/accumulate.md):
    lr_schedule: str = "constant"  # constant, or warmup_cosine (eq. 10) over the run's steps
    lr_warmup_steps: int = 0  # warmup_cosine: linear warm-up steps (the paper: ~5% of steps)
    lr_min_ratio: float = 0.1  # warmup_cosine: eta_min / eta_base (the paper: 0.1)
    lr_scaling: str = "none"  # none, or linear: lr x B_eff / lr_base_batch (eq. 11)
    lr_base_batch: int | None = None  # B_base of eq. 11; unset: train.batch_size
    clip_norm: float | None = None  # tau of eq. 12: clip the total gradient norm; unset: off
    target_val_loss: float | None = None  # time_to_target_s: first validation at or below it
    # Exact tiled validation (memstudy/tiling/validation.py): the eval forward runs the full- and
    # half-resolution levels in row strips of this many rows (padded full-res rows, a multiple
    # of 4); 0 = untiled, for comparison. 512 keeps a 4188-px validation off the memory floor.
    val_tile_rows: int = 512
    # Validation's forward precision: "run" (the run's own autocast / per-unit precision) or
    # "float32" (autocast off, every precision technique's float32 path): the quality of the
    # weights, apart from a float16 eval forward that overflows while BatchNorm's running
    # statistics still lag (docs/metrics.md, "Validation precision").
    val_precision: str = "run"
    # What the network learns: "enhance" (the study's contrast enhancement, 1 - MS-SSIM) or
    # "segment" (per-pixel classes, model.classes channels of logits: Dice + BCE for one class,
    # Dice + cross-entropy for several; masks from the phantoms or a folder: docs/segmentation.md)
    task: str = "enhance"

    def resolve_tuning(self) -> None:
        """Fill unset channels_last / cudnn_benchmark: on for CUDA, off on the CPU."""
        on_cuda = cuda_selected(self.device)
        if self.channels_last is None:
            self.channels_last = on_cuda
        if self.cudnn_benchmark is None:
            self.cudnn_benchmark = on_cuda

    def check_tuning(self) -> None:
        for name in ("channels_last", "cudnn_benchmark"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ConfigError(f"train.{name} must be true or false (got {value!r})")
        if self.cudnn_benchmark and not cuda_selected(self.device):
            raise ConfigError(f"train.cudnn_benchmark = true needs a CUDA GPU but train.device "
                              f"{self.device!r} runs on the CPU, where cuDNN is not used; set "
                              "train.cudnn_benchmark = false (or leave it unset)")
        # unset values are filled by make_plan after the techniques' defaults
        # (techniques.resolve_run_settings, then resolve_tuning)

    def check(self) -> None:
        self.image_size = parse_size(self.image_size)  # canonical form: what is stored and hashed
        positive = ("batch_size", "epochs", "measure_steps", "msssim_scales")
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"train.{name} must be >= 1 (got {getattr(self, name)})")
        if self.warmup_steps < 0:
            raise ConfigError(f"train.warmup_steps must be >= 0 (got {self.warmup_steps})")
        if self.max_steps is not None and self.max_steps < 1:
            raise ConfigError(f"train.max_steps must be >= 1 or unset (got {self.max_steps})")
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"train.optimizer {self.optimizer!r} unknown; choose one of {OPTIMIZERS}")
        if self.device.split(":")[0] not in DEVICES:
            raise ConfigError(f"train.device {self.device!r} unknown; use auto, cpu, cuda or cuda:N")
        if not self.lr > 0:
            raise ConfigError(f"train.lr must be > 0 (got {self.lr})")
        if not 1 <= self.msssim_scales <= 5:
            raise ConfigError(f"train.msssim_scales must be 1..5 (got {self.msssim_scales})")
        rows = self.loss_chunk_rows
        if rows != "auto" and (isinstance(rows, (bool, str)) or rows < 0):
            raise ConfigError(f"train.loss_chunk_rows must be \"auto\" or an integer >= 0 "
                              f"(0 = unchunked), got {rows!r}")
        self.check_tuning()  # train.val_tile_rows: compose.check_val_tiles (the tiling's rule)
        if self.val_precision not in VAL_PRECISIONS:
            raise ConfigError(f"train.val_precision {self.val_precision!r} unknown; choose one of "
                              f"{VAL_PRECISIONS}")
        if self.task not in TASKS:
            raise ConfigError(f"train.task {self.task!r} unknown; choose one of {TASKS}")
        # train.lr_schedule / lr_scaling / clip_norm: policy.check_settings, run by make_plan
        # (the config layer imports nothing above it: tests/test_architecture.py)


def cuda_selected(device: str) -> bool:
    """Whether train.device runs on CUDA ("auto": if a GPU is visible); never initialises CUDA."""
    if device == "auto":
        import torch

        return torch.cuda.is_available()
    return device.startswith("cuda")


@dataclass
class MeterConfig:
    tensor: str = "auto"  # tensor-level meter: auto = on for the CPU, off on a GPU (it costs time)
    nvml: bool = True  # sample NVML device memory during phases (GPU only)
    nvml_interval_ms: float = 2.0
    # profile the last warm-up step (GPU only, needs warmup_steps >= 2): kernel launches and
    # GPU-busy time per step (memstudy/meters/profile.py)
    profile: bool = False

    def check(self) -> None:
        if self.tensor not in ("auto", "on", "off"):
            raise ConfigError(f"meter.tensor must be auto, on or off (got {self.tensor!r})")
        if self.nvml_interval_ms <= 0:
            raise ConfigError("meter.nvml_interval_ms must be > 0")


SOURCES = ("synthetic", "folder")
# The phantoms' mask classes, by index (train.task = "segment", datasets/phantom.make_mask)
PHANTOM_CLASSES = ("background", "lung", "heart", "bone")
MASK_CLASSES_MAX = 255  # masks are held as 8-bit class indices (memstudy/datasets)


def check_segment_classes(classes: int, source: str) -> None:
    """model.classes for train.task = "segment": what the masks can hold, and on phantoms
    what their masks have (1: the lung fields, or every class of PHANTOM_CLASSES)."""
    if classes > MASK_CLASSES_MAX:
        raise ConfigError(f"model.classes = {classes}: masks hold 8-bit class indices, so "
                          f"train.task = 'segment' takes at most {MASK_CLASSES_MAX} classes")
    if source == "synthetic" and classes not in (1, len(PHANTOM_CLASSES)):
        raise ConfigError(f"model.classes = {classes}, but phantom masks have 1 class (lung "
                          f"fields) or {len(PHANTOM_CLASSES)} ({', '.join(PHANTOM_CLASSES)}); "
                          "set model.classes to one of them, or segment a folder "
                          "(data.source = 'folder')")


@dataclass
class DataConfig:
    source: str = "synthetic"  # "synthetic" phantoms or a "folder" of radiographs
    path: str | None = None  # the data folder; required for source = "folder"
    train_images: int = 48  # the study: 48 training and 12 validation radiographs
    val_images: int = 12
    seed: int = 0  # phantom seed, or the seed of the folder's train / val split
    cache_dir: str | None = None  # keep generated items on disk here (.npy); else $MEMSTUDY_CACHE
    # folder images whose shape differs from train.image_size: "none" refuses them (nothing is
    # resampled unless asked), "stretch" resizes each axis (aspect ratio lost, as in the study),
    # "cover" scales keeping the aspect ratio until the image covers the size, then centre-crops
    resize: str = "none"

    def validate(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"data.source must be 'synthetic' or 'folder', got {self.source!r}")
        if self.source == "folder" and not self.path:
            raise ValueError("data.path is required when data.source = 'folder'")
        if self.source == "folder" and not Path(self.path).is_dir():
            raise ValueError(f"data.path {str(self.path)!r}: data folder not found; expected "
                             "images in it, or inputs/ and targets/ subfolders")
        if self.source == "synthetic" and self.path:
            raise ValueError(f"data.path is set ({str(self.path)!r}) but data.source = "
                             "'synthetic'; set data.source = 'folder' to train on it, or remove "
                             "data.path")
        for name, minimum in (("train_images", 1), ("val_images", 1), ("seed", 0)):
            value = getattr(self, name)
            if not _is_int(value) or value < minimum:
                raise ValueError(f"data.{name} must be an integer >= {minimum}, got {value!r}")
        if self.resize not in RESIZE_MODES:
            raise ValueError(f"data.resize must be one of {RESIZE_MODES}, got {self.resize!r}")
        if self.cache_dir is not None and not str(self.cache_dir):
            raise ValueError("data.cache_dir must be a directory path or unset")


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


@dataclass
class RunConfig:
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    meter: MeterConfig = field(default_factory=MeterConfig)
    model: ModelConfig = field(default_factory=ModelConfig)  # the network (memstudy/network.py)
    techniques: list[str] = field(default_factory=list)  # e.g. ["amp:bf16", "checkpoint:block"]
    encoder_weights: str | None = None  # local ImageNet state_dict of model.encoder; nothing downloaded
    budget: ByteSize | None = None  # cap on device memory, e.g. "8GiB" or 1e9 (CUDA context included)
    world_size: int = 1  # processes launched by `memstudy run` for distributed techniques
    label: str | None = None  # free text for reports; not part of the config hash

    def check(self) -> None:
        check_fields(self)  # declared types first: the range checks compare typed values
        self.train.check()
        self.meter.check()
        try:
            self.data.validate()
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        check_size_source(self.train.image_size, self.data.source, self.data.resize)
        self.model.check(self.train.task)
        if self.train.task == "segment":
            check_segment_classes(self.model.classes, self.data.source)
        # budget: parsed into bytes once, by techniques.check_early (Checked.budget_bytes)
        if self.world_size < 1:
            raise ConfigError(f"world_size must be >= 1 (got {self.world_size})")
        if self.encoder_weights and self.model.factory:
            raise ConfigError("encoder_weights loads weights into the U-Net's encoder, which a "
                              "model.factory network does not have; drop encoder_weights")
        if self.encoder_weights and not Path(self.encoder_weights).is_file():
            raise ConfigError(f"encoder_weights file {self.encoder_weights!r} not found")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def hash(self) -> str:
        """Identity of what is measured: everything but the free-text label. tests/
        test_records.py pins the hashes of a few configs: a change that alters them is made on
        purpose, by raising HASH_SCHEMA (see there)."""
        d = self.to_dict()
        d.pop("label")
        for section, name, default in HASH_NEUTRAL_DEFAULTS:
            if d[section].get(name) == default:
                del d[section][name]
        if self.model.is_default:  # the study's network: runs recorded before [model] existed
            del d["model"]
        if HASH_SCHEMA > 1:  # schema 1 is left out, so databases recorded before it resume
            d["hash_schema"] = HASH_SCHEMA
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def budget_size(budget: ByteSize) -> int:
    """A budget in bytes; a malformed one, or one of 0 (a cap of nothing, which would only run
    into an 'oom'), is refused naming the flag."""
    return positive_bytes(budget, "budget", f"budget {budget!r} holds nothing; give a positive "
                          "size, e.g. --budget 8GiB, or leave the budget out")


def positive_bytes(text: ByteSize, what: str, if_zero: str) -> int:
    """A byte size that must hold something: malformed is refused naming `what`, zero with
    the message `if_zero`."""
    try:
        size = parse_bytes(text, what)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if size <= 0:
        raise ConfigError(if_zero)
    return size


_SECTIONS = {"train": TrainConfig, "data": DataConfig, "meter": MeterConfig, "model": ModelConfig}


def from_dict(raw: dict[str, Any]) -> RunConfig:
    """Build a RunConfig from nested dicts, refusing unknown keys by name."""
    top = {f.name for f in dataclasses.fields(RunConfig)}
    unknown = set(raw) - top
    if unknown:
        raise ConfigError(f"unknown config key(s) {sorted(unknown)}; valid: {sorted(top)}")
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        if key in _SECTIONS:
            kwargs[key] = _section(key, _SECTIONS[key], value)
        else:
            kwargs[key] = value
    cfg = RunConfig(**kwargs)
    if isinstance(cfg.techniques, str):
        cfg.techniques = split_techniques(cfg.techniques)
    check_fields(cfg)
    return cfg


def _section(name: str, cls: type, value: Any) -> Any:
    if not isinstance(value, dict):
        raise ConfigError(f"[{name}] must be a table of settings")
    valid = {f.name for f in dataclasses.fields(cls)}
    unknown = set(value) - valid
    if unknown:
        raise ConfigError(f"unknown key(s) {sorted(unknown)} in [{name}]; valid: {sorted(valid)}")
    return cls(**value)


def read_toml(path: str | Path, what: str = "config file") -> dict[str, Any]:
    """A TOML file as a dict; a missing or malformed file is a ConfigError naming it."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{what} {str(path)!r} not found")
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None


def load_toml(path: str | Path) -> RunConfig:
    return from_dict(read_toml(path))


def set_value(cfg: RunConfig, assignment: str) -> None:
    """Apply one `section.key=value` override: the value is parsed as TOML, else kept as a
    string ('none' / 'null' unset a setting that may be unset), then checked against the
    setting's declared type."""
    key, sep, text = assignment.partition("=")
    if not sep:
        raise ConfigError(f"--set {assignment!r}: write section.key=value, e.g. train.lr=1e-4")
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text
    *path, leaf = key.strip().split(".")
    target: Any = cfg
    for part in path:
        if not hasattr(target, part):
            raise ConfigError(f"--set {key}: no config section {part!r}")
        target = getattr(target, part)
    if not dataclasses.is_dataclass(target) or leaf not in {f.name for f in dataclasses.fields(target)}:
        raise ConfigError(f"--set {key}: no such setting")
    hint = field_types(type(target))[leaf]
    if dataclasses.is_dataclass(getattr(target, leaf)):
        raise ConfigError(f"--set {key}: {key} is a section; set one of its keys, e.g. "
                          f"{key}.{dataclasses.fields(getattr(target, leaf))[0].name}=...")
    if leaf == "techniques" and isinstance(value, str):
        value = split_techniques(value)
    if value in ("none", "null") and type(None) in typing.get_args(hint):
        value = None
    setattr(target, leaf, typed_value(key.strip(), hint, value))



def split_techniques(text: str) -> list[str]:
    """'amp:bf16,checkpoint:block' -> ['amp:bf16', 'checkpoint:block'] ('' or 'none' -> [])."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    return [] if parts in ([], ["none"], ["original"]) else parts
