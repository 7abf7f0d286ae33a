"""Every technique's options, declared without torch: what `memstudy run` checks first.

A technique's options are a small dataclass: the first field is the positional option
(`amp:bf16` sets `dtype`), field metadata gives "choices", "help" and "hash_neutral" (see
base.Technique.canonical). A value that is wrong whatever the run is refused when the options
are made (`__post_init__`); what depends on the run (device, size, other techniques) is
refused by the technique's `check` once planned. `DECLARED` gives each technique's stage and
order, so `techniques.parse_techniques` parses, checks and orders a technique list without
importing any technique module (they import torch): a mistyped option is answered in well
under a second. Each technique module registers this class as its `Options`
(`_registry.register` refuses a technique whose options, stage or order differ from the
ones declared here).

Choices that mirror a plugin's own table (kernel implementations, process-group backends,
LR schedulers, pipeline schedules, daso's wire precisions) are repeated here, since the
plugins import torch; tests/test_fast_errors.py checks that they agree.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

from memstudy.errors import ConfigError
from memstudy.techniques.base import Declared, Stage
from memstudy.tiling.chain import LAYER1
from memstudy.tiling.levels import AUTO_PLAN_SETS, check_keep, check_layer1, check_levels

KERNEL_IMPLS = ("auto", "triton", "torch")  # memstudy.kernels.IMPLS
GROUP_BACKENDS = ("auto", "nccl", "gloo")  # memstudy.distributed.context.BACKENDS
LR_SCHEDULERS = ("none", "cosine", "step")  # memstudy.lr_schedule.SCHEDULERS
PIPELINE_SCHEDULES = ("gpipe", "1f1b")  # techniques.pipeline.SCHEDULES
DASO_WIRE = ("bf16", "fp32")  # techniques.daso.WIRE

MIN_SPLIT_MB = 20  # PyTorch refuses max_split_size_mb below its 20 MiB large-block size
QUANTIZATION_BACKENDS = ("x86", "fbgemm", "qnnpack")
DEFAULT_TILES = 4
AUTO = "auto"  # tile:auto (memstudy/tiling/auto.py)
AUTO_PICKS = ("levels", "keep", "layer1", "rows", "stream")
PLACEMENTS = ("block", "sqrt", "selective", "modules")
COMPRESS_WHICH = ("all", "boundaries")
COMPRESS_GROUPINGS = ("channel", "memory")
OFFLOAD_WHICH = ("all", "boundaries")
OFFLOAD_RELEASE = ("record", "stream")
OFFLOAD_BACK_POOLS = ("compute", "side")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
COMPILE_BACKENDS = ("inductor", "aot_eager", "aot_eager_decomp_partition")
DEFAULT_INIT_SCALE = 2.0 ** 16  # torch.amp.GradScaler's own default
ACCUMULATE_MODES = ("fixed", "adaptive")
DEFAULT_K_MAX = 8


@dataclass
class AllocatorOptions:
    expandable_segments: bool = field(default=False, metadata={
        "help": "segments grow by mapping pages instead of new segments being allocated"})
    garbage_collection_threshold: float = field(default=0.0, metadata={
        "help": "0 < t < 1: release unused cached blocks once reserved passes t of the "
                "allowed memory; 0 = off"})
    max_split_size_mb: int = field(default=0, metadata={
        "help": f"blocks larger than this (MiB, >= {MIN_SPLIT_MB}) are never split; 0 = unlimited"})


@dataclass
class InvertibleOptions:
    gamma: float = field(default=0.9, metadata={
        "help": "momentum term in (0, 1); larger = closer to a plain ResNet step, more stable "
                "reconstruction"})
    memory_saving: bool = field(default=True, metadata={
        "help": "rebuild activations in backward (momentumnet use_backprop=False); false keeps "
                "the momentum network but backpropagates normally (control for the function "
                "change)"})


@dataclass
class LowrankOptions:
    d: int | None = field(default=None, metadata={
        "help": "full-rank steps before the conversion (0: convert before the first step); "
                "none: a third of the run's planned steps ([Coquelin] section 4.3)"})
    nu: int = field(default=10, metadata={"help": "steps between base updates (eq. 4.13)"})
    alpha: float = field(default=0.1, metadata={
        "help": "fraction of the weights added to the update set per update, output side first"})
    beta: float = field(default=0.1, metadata={
        "help": "singular values below beta * the largest are dropped at each update"})
    skip_first: bool = field(default=True, metadata={
        "help": "keep the first conv (1-channel stem, 64 x 49) full rank"})
    skip_last: bool = field(default=True, metadata={
        "help": "keep the last conv (1-output head, 1 x 144) full rank"})


@dataclass
class QuantizationOptions:
    backend: str = field(default="x86", metadata={
        "choices": QUANTIZATION_BACKENDS,
        "help": "whose default QAT qconfig: x86/fbgemm (per-channel weights, 7-bit activation "
                "range), qnnpack (per-tensor weights, full 8-bit activations)"})
    freeze_after: int = field(default=0, metadata={
        "help": "stop updating the observers after this many optimizer steps (0: never)"})


@dataclass
class MpOptions:
    mode: str = field(default="process", metadata={
        "choices": ("process", "local"),
        "help": "process: one half per process (world_size 2); local: two GPUs, one process"})
    scheduler: str = field(default="none", metadata={
        "choices": LR_SCHEDULERS, "help": "learning-rate schedule stepped after every step"})
    backend: str = field(default="auto", metadata={
        "choices": GROUP_BACKENDS, "help": "mode=process: auto = nccl on GPUs, gloo on CPU"})


@dataclass
class PipelineOptions:
    micro_batches: int = field(default=2, metadata={"help": "pieces each batch is cut into"})
    schedule: str = field(default="1f1b", metadata={"choices": PIPELINE_SCHEDULES})
    scheduler: str = field(default="none", metadata={
        "choices": LR_SCHEDULERS, "help": "learning-rate schedule stepped after every step"})
    backend: str = field(default="auto", metadata={
        "choices": GROUP_BACKENDS, "help": "auto: nccl on GPUs, gloo on the CPU"})


@dataclass
class TileOptions:
    tiles: int | str = field(default=0, metadata={
        "words": (AUTO,),
        "help": f"number of full-width row strips (0 with rows=0: {DEFAULT_TILES}), or auto: "
                "levels, strips and stream picked from the budget and the image "
                "(memstudy/tiling/auto.py)"})
    rows: int = field(default=0, metadata={
        "help": "rows per strip at full resolution instead of a count (multiple of 2**levels)"})
    levels: int = field(default=2, metadata={
        "help": "resolution levels tiled from full resolution down: 1 = full, 2 = full + half, "
                "3 = full + half + quarter (layer1 tiled), 4 = down to 1/8 (layer2 too)"})
    keep: str = field(default="conv1", metadata={
        "help": "kept boundaries between regions: none, conv1 (each tiled skip block's first "
                "convolution output), all (every tiled decoder block's), half (every "
                "BatchNorm's input but the full-resolution block's second) or bn (every "
                "BatchNorm's input: one sweep per region): fewer recompute sweeps, more memory"})
    graphs: bool = field(default=False, metadata={
        "help": "replay each tile body as a CUDA graph, captured once per region, sweep and "
                "strip shape (GPU only): the per-tile host cost paid once"})
    graph_limit: int = field(default=256, metadata={
        "help": "graphs: most graphs captured; a run whose strips keep changing shape stops "
                "there (or see graph_fallback)"})
    graph_fallback: bool = field(default=False, metadata={
        "help": "graphs: past graph_limit run further shapes eagerly (the run records how many "
                "tiles did: series tile_eager_tiles) instead of stopping"})
    norm: str = field(default="auto", metadata={
        "choices": KERNEL_IMPLS, "hash_neutral": True,
        "help": "the tiled BatchNorms' kernels: triton (memstudy's fused kernels, one pass "
                "each for the moments, normalise + ReLU, and backward), torch (PyTorch's "
                "SyncBatchNorm primitives), auto (triton on CUDA, torch elsewhere)"})
    stream: bool = field(default=False, metadata={
        "hash_neutral": True,
        "help": "keep in host memory (pinned) the boundaries that only tiled regions read "
                "(the stem's and the tiled stages' outputs between their regions, the "
                "decoder's kept "
                "convolution outputs), their strips copied in as tiles need them and their "
                "gradients added up on the host: device memory for them stays one strip's"})
    ahead: bool | None = field(default=None, metadata={
        "hash_neutral": True, "recorded_as": False,  # runs before it copied on the compute stream
        "help": "with stream: copy the next tile's host strips in while a tile computes, and "
                "written rows out while the next computes, on side streams (one more tile's "
                "strips on the device; on an H200 8192 px 6-9% faster at equal strips, tile:auto's "
                "16384 px 7.2-7.8 s against 10.1 s); "
                "false: the copies on the compute stream, no overlap; default: true where "
                "streamed (with auto: where the pick streams)"})
    layer1: str = field(default="whole", metadata={
        "choices": LAYER1, "hash_neutral": True,
        "help": "levels 3 and 4, how each tiled residual stage (layer1; layer2 at 4) is cut: "
                "whole (one region: layer1 inside the stem's), blocks (a region per residual "
                "block, its input kept) or convs (also its first convolution's output kept: "
                "fewest sweeps)"})
    plans: int | None = field(default=None, metadata={
        "hash_neutral": True, "recorded_as": AUTO_PLAN_SETS[0],  # what auto picked among before
        "help": "auto only: the plans it picks among (memstudy/tiling/auto.py, PLAN_SETS): "
                f"{AUTO_PLAN_SETS[-1]} (the default) streams with layer1 and layer2 cut at their "
                "blocks, 1 at their convolutions, as runs recorded before 2026-11-29 did "
                "(on an H200, 16384 px under 8 GiB: 5.7 s a step against 6.7 s)"})

    def __post_init__(self) -> None:  # whatever the run: refused before torch loads
        if self.ahead is None:  # the default: a tile ahead wherever boundaries may stream
            self.ahead = self.stream or self.tiles == AUTO
        if self.ahead and not (self.stream or self.tiles == AUTO):
            raise ConfigError("tile:ahead=true without tile:stream=true: ahead says how streamed "
                              "boundaries are copied, and nothing is streamed; drop ahead=true "
                              "or add stream=true")
        self._resolve_plans()
        if self.tiles == AUTO:
            self._check_auto()
            return
        check_levels(self.levels, "tile:levels")
        check_keep(self.keep, "tile:keep")
        check_layer1(self.layer1, self.levels, "tile:layer1")
        if self.tiles < 0 or self.rows < 0:
            raise ConfigError(f"tile: tiles={self.tiles} and rows={self.rows} must be >= 0")
        if self.tiles and self.rows:
            raise ConfigError(f"tile: give tiles ({self.tiles}) or rows ({self.rows}), not both")
        unit = 2 ** self.levels
        if self.rows % unit:
            raise ConfigError(f"tile:rows={self.rows} must be a multiple of {unit} (the "
                              f"{unit}x-down-sampled grid at levels={self.levels})")
        if self.graph_limit < 1:
            raise ConfigError(f"tile:graph_limit={self.graph_limit} must be >= 1")

    def _resolve_plans(self) -> None:
        """tile:plans: by default the latest set with auto, else the first (the value that
        leaves it out of the canonical form); another only with auto."""
        if self.plans is None:
            self.plans = AUTO_PLAN_SETS[-1] if self.tiles == AUTO else AUTO_PLAN_SETS[0]
        if self.plans not in AUTO_PLAN_SETS:
            raise ConfigError(f"tile:plans={self.plans} is not a plan set; give one of "
                              f"{', '.join(map(str, AUTO_PLAN_SETS))}")
        if self.plans != AUTO_PLAN_SETS[0] and self.tiles != AUTO:
            raise ConfigError(f"tile:plans={self.plans} without tile:auto: plans says which "
                              "plans auto picks among; drop plans or use tile:auto")

    def _check_auto(self) -> None:
        """tile:auto picks levels, keep, layer1, rows and stream itself: none may be given."""
        given = [f"{f.name}={getattr(self, f.name)}" for f in fields(self)
                 if f.name in AUTO_PICKS and getattr(self, f.name) != f.default]
        if given:
            raise ConfigError(f"tile:auto picks levels, keep, layer1, rows and stream itself; "
                              f"drop {', '.join(given)}, or give tile's strips instead of auto")
        if self.graphs:
            raise ConfigError("tile:auto with graphs=true: auto may stream, which graphs cannot "
                              "replay; drop graphs=true or give tile's options by hand")


@dataclass
class CheckpointOptions:
    placement: str = field(default="block", metadata={
        "choices": PLACEMENTS,
        "help": "block: each residual / decoder block; sqrt: ~sqrt(L) segments; selective: per "
                "block, convolution outputs kept, the rest recomputed; modules: each named "
                "module of any network (e.g. a model.factory one)"})
    segments: int = field(default=0, metadata={
        "help": "sqrt only: number of even segments over the L units (0 = round(sqrt(L)))"})
    modules: str = field(default="", metadata={
        "hash_neutral": True,  # added after runs were recorded: their canonical form stays
        "help": "modules only: '+'-separated module names (e.g. 'encoder+decoder'); empty = "
                "every top-level module that holds parameters"})


@dataclass
class CompressOptions:
    bits: int = field(default=4, metadata={"help": "bits per element: 8, 4 or 2"})
    group_size: int = field(default=256, metadata={
        "help": "elements per quantisation group (own min and step): a power of two, 32..4096"})
    which: str = field(default="all", metadata={
        "choices": COMPRESS_WHICH,
        "help": "all: every saved float tensor; boundaries: only what checkpoint / tile keep "
                "between regions"})
    min_numel: int = field(default=16384, metadata={
        "help": "saved tensors with fewer elements stay as they are"})
    impl: str = field(default="auto", metadata={
        "choices": KERNEL_IMPLS,
        "help": "triton kernels, torch references, or auto (triton on CUDA, torch on the CPU)"})
    boundary_bits: int = field(default=0, metadata={
        "help": "bits for checkpoint region inputs, from which backward recomputes each region "
                "(0: 8 with which=all, bits with which=boundaries)"})
    relu_mask: bool = field(default=True, metadata={
        "help": "ReLU saves a 1-bit sign mask instead of its output (which=all only)"})
    pool_offsets: bool = field(default=True, metadata={
        "help": "max-pool saves each maximum's place in its window (4 bits, exact) instead of "
                "its int64 index (which=all only)"})
    groups: str = field(default="channel", metadata={
        "choices": COMPRESS_GROUPINGS,
        "help": "channels-last tensors: channel = group_size pixels of one channel per group; "
                "memory = runs in memory order, across channels (the grouping until 2026-11-23)"})
    grad_probe: bool = field(default=True, metadata={
        "help": "re-run the last warm-up step uncompressed and record the gradient deviation"})


@dataclass
class OffloadOptions:
    min_bytes: int = field(default=64 * 1024, metadata={
        "help": "saved tensors smaller than this stay on the device (copies of small tensors "
                "cost more in latency than they save)"})
    pin_memory: bool = field(default=True, metadata={
        "help": "page-locked host buffers: asynchronous copies that overlap with compute; "
                "false uses pageable memory and synchronous copies"})
    prefetch: int = field(default=0, metadata={
        "help": "backward brings copies back ahead of use on a side stream, at most this many "
                "in flight (0: each copy is made when autograd asks for it)"})
    row_chunks: int = field(default=16, metadata={
        "help": "a tile region's inputs come back in this many row chunks, on a side stream, "
                "and each tile waits only for the chunks of its strip (0: the whole tensor "
                "on the compute stream, when autograd asks for it)"})
    hold: int = field(default=0, metadata={
        "help": "the last N tensors a forward would offload stay on the device instead: "
                "backward needs them first, so their round trip over PCIe only adds traffic "
                "(from the second step on, once a step's count of saved tensors is known)"})
    release: str = field(default="record", metadata={
        "choices": OFFLOAD_RELEASE,
        "help": "record: a tensor copied to the host keeps its device memory until the caching "
                "allocator sees the copy done (record_stream); stream: when the tensor is freed, "
                "the compute stream waits for the copy (an event, no host sync) and the memory "
                "is reusable at once"})
    early: bool = field(default=False, metadata={
        "help": "a tile region's inputs start their copy to the host as the region starts, so "
                "it overlaps the region's sweeps (false: when the region's first sweep saves "
                "them, after it)"})
    back_pool: str = field(default="compute", metadata={
        "choices": OFFLOAD_BACK_POOLS,
        "help": "where copies back on the side stream (prefetch, row chunks) get their device "
                "memory: compute, the compute stream's pool (the copy first waits for the work "
                "queued there); side, the side stream's own pool (the copy waits only for its "
                "copy out; freed memory stays cached for the side stream)"})
    which: str = field(default="all", metadata={
        "choices": OFFLOAD_WHICH,
        "help": "all: every saved tensor above min_bytes; boundaries: only the tensors "
                "checkpoint / tile keep between regions"})


@dataclass
class CompileOptions:
    mode: str = field(default="default", metadata={
        "choices": COMPILE_MODES,
        "help": "torch.compile mode: default; reduce-overhead (CUDA graphs); max-autotune "
                "(autotuned templates + CUDA graphs); max-autotune-no-cudagraphs"})
    memory_budget: float = field(default=1.0, metadata={
        "help": "activation_memory_budget, 0..1: saved activations as a fraction of the "
                "default partition's; below 1 the partitioner recomputes in backward"})
    dynamic: bool = field(default=False, metadata={
        "help": "symbolic shapes (one graph for many sizes) instead of one graph per shape"})
    fullgraph: bool = field(default=False, metadata={
        "help": "refuse graph breaks: the run fails where the model cannot be one graph"})
    backend: str = field(default="inductor", metadata={
        "choices": COMPILE_BACKENDS,
        "help": "inductor generates kernels; aot_eager(_decomp_partition) run the captured "
                "graphs eagerly (for debugging: no kernel generation)"})


@dataclass
class OffloadOptimOptions:
    bucket: str = field(default="64MB", metadata={
        "help": "parameter bytes per bucket (e.g. 64MB): the state of at most two buckets is on "
                "the device during the step (Adam: 2 x this each); a larger parameter is a "
                "bucket of its own"})


@dataclass
class DpOptions:
    backend: str = field(default="auto", metadata={
        "choices": GROUP_BACKENDS, "help": "auto: nccl on GPUs, gloo on the CPU"})


@dataclass
class DasoOptions:
    node_size: int = field(default=0, metadata={
        "help": "ranks per (emulated) node; 0: the processes of one host (LOCAL_WORLD_SIZE)"})
    B: int = field(default=4, metadata={"help": "cycling steps between global synchronisations"})
    S: int = field(default=1, metadata={"help": "steps a global synchronisation may take (1..B)"})
    warmup: int = field(default=2, metadata={"help": "first steps synchronised blockingly"})
    cooldown: int = field(default=2, metadata={"help": "last steps synchronised blockingly"})
    wire: str = field(default="bf16", metadata={"choices": DASO_WIRE,
                                                "help": "precision of the global parameter send"})
    backend: str = field(default="auto", metadata={
        "choices": GROUP_BACKENDS, "help": "auto: nccl on GPUs, gloo on the CPU"})


@dataclass
class FsdpOptions:
    mode: str = field(default="full", metadata={
        "choices": ("full", "grad_op"),
        "help": "full: ZeRO-3-like (reshard after forward); grad_op: ZeRO-2-like"})
    backend: str = field(default="auto", metadata={
        "choices": GROUP_BACKENDS, "help": "auto: nccl on GPUs, gloo on the CPU"})


@dataclass
class ZeroOptions:
    pass


@dataclass
class AmpOptions:
    dtype: str = field(default="fp16", metadata={
        "choices": ("fp16", "bf16", "tf32"),
        "help": "fp16: autocast float16 + dynamic loss scaling; bf16: autocast bfloat16; "
                "tf32: float32 storage, TF32 tensor-core matmuls/convolutions"})
    init_scale: float = field(default=DEFAULT_INIT_SCALE, metadata={
        "help": "fp16 only: initial loss scale of the GradScaler (halved on overflow, doubled "
                "after 2000 clean steps)"})

    def __post_init__(self) -> None:  # whatever the run: refused before torch loads
        if self.init_scale != DEFAULT_INIT_SCALE and self.dtype != "fp16":
            raise ConfigError(f"amp: init_scale applies only to dtype=fp16 (got "
                              f"dtype={self.dtype}); drop amp:init_scale or use amp:fp16")
        if not self.init_scale > 0:
            raise ConfigError(f"amp: init_scale must be > 0 (got {self.init_scale})")


@dataclass
class AccumulateOptions:
    k: int = field(default=2, metadata={
        "help": "micro-batches of train.batch_size images per optimizer step (adaptive: the "
                "first step's k)"})
    mode: str = field(default="fixed", metadata={
        "choices": ACCUMULATE_MODES,
        "help": "fixed: k every step; adaptive: k from the gradient variance (eq. 6-7)"})
    k_max: int = field(default=DEFAULT_K_MAX, metadata={"help": "adaptive only: largest k"})
    sigma_target: float | None = field(default=None, metadata={
        "help": "adaptive only (required): target gradient standard deviation, in the units "
                "of sqrt(sum_j ||g_j - g_acc||^2 / (k-1)); the recorded accum_sigma2 series "
                "shows a run's sigma^2"})


@dataclass
class TriAccelOptions:
    precision: bool = field(default=True, metadata={"help": "per-unit adaptive precision"})
    curvature: bool = field(default=True, metadata={"help": "curvature-scaled per-unit LR"})
    elastic: bool = field(default=True, metadata={"help": "memory-elastic batch size"})
    t_ctrl: int = field(default=10, metadata={"help": "control interval in optimizer steps"})
    beta: float = field(default=0.9, metadata={"help": "EMA factor of the gradient variance"})
    # tau_low / tau_high / tau_curv: the best of 10 trials of `memstudy tune
    # benchmarks/specs/tune-triaccel.toml` on an H100, to 3 significant digits (run 8 of
    # benchmarks/results/h100/triaccel/tune.sqlite; docs/triaccel.md)
    tau_low: float = field(default=9.12e-8, metadata={
        "help": "variance below: lowest precision (tuned by memstudy tune, docs/triaccel.md)"})
    tau_high: float = field(default=4.29e-2, metadata={
        "help": "variance from here: FP32 (tuned by memstudy tune, docs/triaccel.md)"})
    low: str = field(default="fp16", metadata={"choices": ("fp16", "bf16"),
                                               "help": "lowest tier (bf16 on the CPU)"})
    stats: str = field(default="auto", metadata={"choices": ("auto", "triton", "torch"),
                                                 "help": "variance kernel: auto = triton on GPU"})
    grad_layout: str = field(default="flat", metadata={
        "choices": ("flat", "separate"),
        "help": "flat: every .grad a view into one buffer the statistics read in place; "
                "separate: PyTorch's own gradients, concatenated for the statistics"})
    t_curv: int = field(default=50, metadata={"help": "curvature interval (multiple of t_ctrl)"})
    curv_budget: float = field(default=0.1, metadata={
        "help": "largest share of the training time the curvature estimates may take; a due "
                "estimate is skipped when the last one's cost would exceed it (1: never skip)"})
    b_curv: int = field(default=1, metadata={"help": "curvature mini-batch size"})
    curv_crop: int = field(default=0, metadata={"help": "centre crop (px) for curvature; 0: full"})
    top_k: int = field(default=1, metadata={"help": "Hessian eigenvalues per unit"})
    power_iters: int = field(default=5, metadata={"help": "power iterations per eigenvalue"})
    alpha: float = field(default=1.0, metadata={"help": "LR scale: eta0 / (1 + alpha lambda)"})
    tau_curv: float = field(default=4.41, metadata={
        "help": "lambda_max above: promote to FP32 (tuned by memstudy tune, docs/triaccel.md)"})
    rho_low: float = field(default=0.6, metadata={"help": "grow the batch below this fraction"})
    rho_high: float = field(default=0.85, metadata={"help": "shrink the batch above it"})
    delta_up: int = field(default=1, metadata={"help": "batch growth per control step"})
    delta_down: int = field(default=1, metadata={"help": "batch shrink per control step / OOM"})
    max_batch: int = field(default=32, metadata={"help": "largest batch the controller may set"})
    lr_scaling: str = field(default="linear", metadata={"choices": ("linear", "sqrt", "none"),
                                                        "help": "LR rule for batch changes"})


@dataclass
class AbOptions:
    warmup: int | None = field(default=None, metadata={
        "help": "full-rank DP steps first; none: 20% of the planned steps (section 5.3.3)"})
    ab_steps: int | None = field(default=None, metadata={
        "help": "steps of independent A / B group training per cycle; none: 3.33% of the run"})
    rebound: int | None = field(default=None, metadata={
        "help": "full-rank DP steps after each synchronisation; none: ab_steps / 4"})
    sigma_cutoff: float = field(default=0.1, metadata={
        "help": "singular values below sigma_cutoff * the largest are dropped (eq. 5.4)"})
    skip_first: bool = field(default=True, metadata={"help": "keep the stem conv full rank"})
    skip_last: bool = field(default=True, metadata={"help": "keep the head conv full rank"})


# name -> stage and order within it: the one composition order (techniques.compose says why)
DECLARED: dict[str, Declared] = {d.name: d for d in (
    Declared("allocator", Stage.PROCESS, AllocatorOptions),
    Declared("invertible", Stage.STRUCTURE, InvertibleOptions, order=10),
    Declared("lowrank", Stage.STRUCTURE, LowrankOptions),
    Declared("quantization", Stage.STRUCTURE, QuantizationOptions, order=30),
    Declared("mp", Stage.STRUCTURE, MpOptions, order=90),
    Declared("pipeline", Stage.STRUCTURE, PipelineOptions, order=90),
    Declared("checkpoint", Stage.ACTIVATION, CheckpointOptions, order=20),
    Declared("compress", Stage.ACTIVATION, CompressOptions, order=40),
    Declared("tile", Stage.ACTIVATION, TileOptions),
    Declared("offload", Stage.ACTIVATION, OffloadOptions, order=60),
    Declared("compile", Stage.COMPILE, CompileOptions),
    Declared("offload_optim", Stage.PARALLEL, OffloadOptimOptions, order=5),
    Declared("dp", Stage.PARALLEL, DpOptions, order=10),
    Declared("daso", Stage.PARALLEL, DasoOptions, order=10),
    Declared("fsdp", Stage.PARALLEL, FsdpOptions, order=10),
    Declared("zero", Stage.PARALLEL, ZeroOptions, order=20),
    Declared("amp", Stage.RUNTIME, AmpOptions, order=10),
    Declared("tri_accel", Stage.RUNTIME, TriAccelOptions, order=20),
    Declared("accumulate", Stage.RUNTIME, AccumulateOptions),
    Declared("ab", Stage.RUNTIME, AbOptions),
)}
