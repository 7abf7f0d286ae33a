"""Validation and composition of techniques: the one place where a pipeline is put together.

Order, and why it is this one:
0. PROCESS (allocator settings) configures the process itself; `prepare_process` applies it
   before CUDA initialises (the runner calls it right after `make_plan`).
1. STRUCTURE (invertible residuals, low-rank, quantization, model-parallel split) decides
   which modules exist; everything after wraps modules, so it must see the final ones.
   Then the model moves to its device, unless a structural technique placed it itself.
2. ACTIVATION (checkpointing, offload, compression) wraps the forward of those modules.
3. COMPILE traces the forward as the activation techniques left it.
4. PARALLEL (DDP, ZeRO, FSDP, optimizer-state offload) wraps the (compiled) model and the
   optimizer; DDP and FSDP must see the parameters exactly as they will be trained. The
   optimizer-state offload (offload_optim, order 5) wraps the optimizer factory first, so
   that every later wrapper of it (daso's and ab's step hooks, the LR policy installed after
   all techniques) acts on its one step per training step, not on each bucket's inner step.
5. RUNTIME (autocast, loss scaling, adaptive precision, elastic batch, accumulation) acts
   on the training step, not on modules, and may depend on the final parameter layout.
Within a stage, techniques are applied in their declared `order`, then by name: the applied
order never depends on how the user listed them, and it is what every run records and hashes
(`canonical`). A combination is validated whole, before anything is built (`make_plan`):
each technique's `check` (which may refuse but never reorders the plan), then the rules that
follow from declared facts alone (`check_declared`).
"""
from __future__ import annotations

import torch

from memstudy import policy
from memstudy.budget import check_warmup
from memstudy.config import RunConfig
from memstudy.errors import ConfigError
from memstudy.models import build_model, check_factory
from memstudy.models.unet import upsampled_elements
from memstudy.quality import ObservedLoss, check_image_size, make_loss
from memstudy.runtime import Runtime
from memstudy.image_sizes import size_hw
from memstudy.techniques import (Checked, check_early, get_technique, list_techniques,
                                 resolve_run_settings)
from memstudy.techniques.base import Build, Plan, Stage
from memstudy.tiling.levels import VALIDATION_LEVELS, min_tile_rows


def resolve_device(spec: str) -> torch.device:
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if spec.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(f"train.device = {spec!r} but no CUDA GPU is visible; use "
                              "train.device = 'cpu' (or 'auto')")
        device = torch.device(spec)
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(f"train.device = {spec!r} but only {torch.cuda.device_count()} "
                              "GPU(s) are visible")
        return device
    return torch.device(spec)


def make_plan(config: RunConfig, *, checked: Checked | None = None,
              device: torch.device | None = None, n_gpus: int | None = None) -> Plan:
    """Everything that can be refused is refused here, before a model or dataset is built.

    `checked`: what techniques.check_early made of this config where the caller ran it (the
    CLI, before torch loaded), so nothing is checked or parsed twice. `device` and `n_gpus`
    plan for another host (validation only: tests plan 2-GPU runs on the CPU); by default they
    are this process's train.device and its visible GPUs."""
    checked = check_config(config, checked)
    policy.check_settings(config.train)  # the training-policy settings (memstudy/policy.py)
    if config.train.task == "enhance":  # MS-SSIM's smallest side; segmentation has no window
        check_image_size(config.train.image_size, config.train.msssim_scales)
    device = resolve_device(config.train.device) if device is None else device
    if n_gpus is None:
        n_gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    check_warmup(checked.budget_bytes, device, config.train.warmup_steps)
    chosen = checked.chosen  # canonical order, whatever the user's order
    plan = Plan(config=config, device=device, n_gpus=n_gpus, chosen=chosen,
                techniques={name: get_technique(name) for name in chosen},
                budget_bytes=checked.budget_bytes)
    check_network(plan)  # the network first: a technique that cannot act on it at all
    for name, options in chosen.items():  # the specific refusals, naming the fix
        get_technique(name).check(options, plan)
    check_declared(plan)
    policy.check_plan(plan)  # train.lr_schedule / lr_scaling / clip_norm against the techniques
    check_upsampling(plan)
    return plan


NHWC_UPSAMPLE_MAX = 2**31 - 1  # elements PyTorch's channels_last nearest up-sampling backs through


def upsampling_ceiling(plan: Plan) -> int | None:
    """The largest square side (px) `check_upsampling` lets this plan's technique set train at
    its batch size; None where it sets no limit (not CUDA, or not channels_last)."""
    train = plan.config.train
    if plan.device.type != "cuda" or not train.channels_last or plan.config.model.factory:
        return None
    folded = _folded_levels(plan)
    lo, hi = 0, 1 << 17  # lo fits (no image), hi does not: far past any card's memory
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if upsampled_elements(_images_per_forward(plan), mid, mid, folded,
                                                 plan.config.model) \
            <= NHWC_UPSAMPLE_MAX else (lo, mid)
    return lo


def _images_per_forward(plan: Plan) -> int:
    """Images one process's forward holds: a rank's share where the batch is sharded."""
    train = plan.config.train
    if plan.declaring("shards_batch"):
        return max(1, train.batch_size // max(1, plan.config.world_size))
    return train.batch_size


def _folded_levels(plan: Plan) -> int:
    techniques = plan.techniques
    return max((techniques[name].value("folded_upsampling_levels",
                                       techniques[name].actual(options, plan))
                for name, options in plan.chosen.items()), default=0)


def check_upsampling(plan: Plan) -> None:
    """PyTorch's CUDA kernel for the backward of nearest up-sampling in channels_last refuses
    gradients of INT_MAX elements or more (at 8192 x 8192 the decoder's last up-sampling, 32
    channels, is 2^31: the tuned amp:bf16 step failed in its first backward, H100, 2026-11-26,
    benchmarks/results/h100/tile-fast/native-8192-8gib-tuned.md). Refused here, before a
    model is built, instead of after a whole forward."""
    train = plan.config.train
    hw = size_hw(train.image_size)
    if plan.device.type != "cuda" or not train.channels_last or hw is None \
            or plan.config.model.factory:  # a user's network: its up-sampling is its own
        return
    elements = upsampled_elements(_images_per_forward(plan), *hw, _folded_levels(plan),
                                  plan.config.model)
    if elements > NHWC_UPSAMPLE_MAX:
        raise ConfigError(
            f"train.image_size {train.image_size} at train.batch_size {train.batch_size}: the "
            f"decoder's largest nearest up-sampling makes {elements:,} elements, and PyTorch's "
            f"channels_last up-sampling backward takes at most {NHWC_UPSAMPLE_MAX:,} (it would "
            "fail in the first backward); add tile (its folded up-convolution does not "
            "up-sample the tiled levels) or use a smaller train.image_size or train.batch_size")


def check_config(config: RunConfig, checked: Checked | None = None) -> Checked:
    """The config's own checks and its parsed techniques and budget (techniques.check_early,
    unless `checked` holds them already), then what its unset run settings become: the
    techniques' defaults first (the registry's), then the device's."""
    checked = check_early(config) if checked is None else checked
    resolve_run_settings(config, checked.chosen)
    config.train.resolve_tuning()
    check_val_tiles(config.train)
    return checked


def check_val_tiles(train) -> None:
    """train.val_tile_rows against the tiled validation's geometry (memstudy/tiling/levels.py):
    0, or whole tiles of the deepest tiled level that cover its halo."""
    unit, halo = 2 ** VALIDATION_LEVELS, min_tile_rows(VALIDATION_LEVELS)
    rows = train.val_tile_rows
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 0 or rows % unit \
            or 0 < rows < halo:
        raise ConfigError(f"train.val_tile_rows = {rows!r} must be 0 (untiled validation) or "
                          f"a multiple of {unit} that is >= {halo} (the tiles' halo), e.g. 512")


def prepare_process(plan: Plan) -> None:
    """Process-level settings of the PROCESS stage (the CUDA caching allocator's), applied
    after the plan is validated and before anything initialises CUDA in this process."""
    for name, options in plan.chosen.items():
        prepare = plan.techniques[name].prepare
        if prepare is not None:
            prepare(options, plan)


def check_declared(plan: Plan) -> None:
    """The composition rules that follow from declared facts alone (no technique named)."""
    owners = plan.group_owners()
    if len(owners) > 1:
        raise ConfigError(f"{owners[0]} and {owners[1]} each need the whole process group; "
                          "combining them (2-D parallelism) is not supported: drop one of them")
    if plan.config.world_size > 1 and not owners:
        raise ConfigError(f"world_size {plan.config.world_size} starts several processes but no "
                          "distributed technique uses them; add one that owns the process group "
                          f"({', '.join(group_owner_names())}) to techniques, or set "
                          "world_size = 1")
    splitters = plan.declaring("splits_model")
    if len(splitters) > 1:
        raise ConfigError(f"{splitters[0]} and {splitters[1]} both split the model over devices; "
                          "drop one of them")


def check_network(plan: Plan) -> None:
    """A user's own network (model.factory): refused by every technique that acts on the
    U-Net's structure, then imported and run once on the meta device at the run's shape."""
    network = plan.config.model
    if not network.factory:
        return
    for name in plan.declaring("needs_unet"):
        reason = plan.techniques[name].value("needs_unet", plan.chosen[name])
        raise ConfigError(f"{name} {reason}, which a model.factory network does not have; "
                          f"drop {name}, or train a model.encoder U-Net")
    hw = size_hw(plan.config.train.image_size)
    if hw is not None:  # "native" folder sizes: checked on the first batch instead
        check_factory(network, _images_per_forward(plan), *hw)


def group_owner_names() -> list[str]:
    """Techniques that can own the process group (for messages)."""
    return [t.name for t in list_techniques() if t.owns_process_group is not False]


def default_optimizer(config: RunConfig):
    t = config.train

    def factory(model: torch.nn.Module) -> torch.optim.Optimizer:
        params = [p for p in model.parameters() if p.requires_grad]
        if t.optimizer == "sgd":
            return torch.optim.SGD(params, lr=t.lr, momentum=0.9, weight_decay=t.weight_decay)
        cls = torch.optim.AdamW if t.optimizer == "adamw" else torch.optim.Adam
        return cls(params, lr=t.lr, weight_decay=t.weight_decay)

    return factory


def reset_global_numerics() -> None:
    """Plain float32 unless a technique says otherwise (`amp:tf32` turns TF32 on).

    PyTorch lets cuDNN convolutions use TF32 by default on Ampere and later GPUs; the study's
    "Original" is true float32, and a run must not inherit the settings of a previous run in
    the same process.
    """
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")


def apply_tuning(config: RunConfig) -> None:
    """The run settings of the tuned baseline that are process-global: cuDNN autotuning.

    Set on every run (either way), so a run never inherits an earlier run's setting."""
    torch.backends.cudnn.benchmark = bool(config.train.cudnn_benchmark)


def build_pipeline(plan: Plan) -> Build:
    config = plan.config
    reset_global_numerics()
    apply_tuning(config)
    observers: list = []  # the loss tells them when it runs (the recorder's loss meter)
    loss = make_loss(config, observers)  # train.task's loss (quality.make_loss)
    runtime = Runtime(device=plan.device, batch_size=config.train.batch_size, loss_fn=loss,
                      optimizer_factory=default_optimizer(config), loss_observers=observers)
    runtime.series_sources.append(lambda: _loss_rows(loss, runtime.rank))
    runtime.transform_order = {name: i for i, name in enumerate(plan.chosen)}
    model = build_model(config)
    build = Build(config=config, plan=plan, model=model, runtime=runtime, device=plan.device)
    moved = False
    for name, options in plan.chosen.items():
        tech = get_technique(name)
        if tech.stage > Stage.STRUCTURE and not moved:
            _place(build)
            moved = True
        tech.apply(options, build)
    if not moved:
        _place(build)
    # after every technique: the LR policy wraps the final optimizer factory, and its step
    # hook runs after the techniques' (adaptive k decides the next step's batch first)
    policy.install(build)
    return build


def _loss_rows(loss: ObservedLoss, rank: int) -> list[tuple[int, int, str, float]]:
    """The chunked loss's block heights over the run (series step 0; 0 = unchunked): with
    train.loss_chunk_rows = auto they follow the memory left, so the run says what they were."""
    if not loss.rows_used:
        return []
    return [(rank, 0, "loss_chunk_rows_min", float(min(loss.rows_used))),
            (rank, 0, "loss_chunk_rows_max", float(max(loss.rows_used)))]


def _place(build: Build) -> None:
    if not build.placed:
        build.model.to(build.device)
        build.placed = True
    if build.config.train.channels_last:  # 4-D weights in NHWC, where the model placed them
        build.model.to(memory_format=torch.channels_last)
