"""The tiled part of the smp U-Net written once, for two readers (pure Python).

A region's computation is written as a walk over named operations (`conv`, `norm` (with the
ReLU that follows it fused when `relu=True`), `relu`, `pool`, `add`, and `up_conv`: a decoder
block's nearest up-sampling, concatenation with its skip and first convolution) of an `ops`
object. The tile bodies (memstudy/tiling/tiled_forward.py) walk it with tensors of one strip; the
geometry (`Trace` below) walks the same code with row bookkeeping, so the halo of every region
follows from exactly the operations its body runs.

Names: "conv1" / "bn1" are the stem's convolution and BatchNorm (the same in every ResNet-family
encoder), "layer<k>.<j>.conv1|bn1|conv2|bn2" the residual blocks of the encoder's first two
stages (torchvision BasicBlocks, or Bottlenecks with conv3|bn3 too; a block that projects its
input has "layer<k>.<j>.downsample.0|1"; `Stage` says which), "block<i>.conv1|bn1|conv2|bn2"
decoder block i's two Conv2dReLU layers (smp numbering 0..4, block 4 at full resolution),
"head" the segmentation head. Tensors a region may start from, stop at or take: "x" (the
image), "s" (the stem's convolution output before bn1), "p<j>" (layer1 block j's input: p0 the
max-pool's output), "a<j>" (layer1 block j's first convolution output before its BatchNorm),
"l1" (layer1's output, layer2's input), "q<j>" / "b<j>" (layer2 block j's input, j >= 1, and
first convolution output), "l2" (layer2's output), "d<i>" (decoder block i's input), "z<i>" /
"y<i>" (decoder block i's first / second convolution output before its BatchNorm). A region that stops at a tensor before a
BatchNorm also produces that BatchNorm's statistics (memstudy/tiling/sweep.py), so the next
region only normalises it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from memstudy.network import ENCODERS, Encoder
from memstudy.tiling.geometry import Path, Upsample, Window

STEM = Window(7, 2, 3)
POOL = Window(3, 2, 1)
CONV3 = Window(3, 1, 1)
UP = Upsample(2)
LAST_BLOCK = 4  # the decoder's full-resolution block
SKIPS = {1: "l2", 2: "l1", 3: "f1"}  # decoder block -> its skip feature inside the tiled levels
STEM_STARTS = ("x", "s")  # where a region of the encoder's stem starts
# how levels >= 3 cuts the tiled residual stages (layer1, and layer2 at levels=4) into regions
LAYER1 = ("whole", "blocks", "convs")
KINDS = {1: ("p", "a"), 2: ("q", "b")}  # stage -> letters of its block inputs, first conv outputs
STAGE_OUTPUTS = {1: "l1", 2: "l2"}  # a stage's output: the next stage's block-0 input


@dataclass(frozen=True)
class Stage:
    """One of the encoder's first two residual stages as the walk runs it: torchvision
    BasicBlocks (conv1, bn1, conv2, bn2) or Bottlenecks (conv1 1x1, bn1, conv2 3x3 (grouped in
    ResNeXt), bn2, conv3 1x1, bn3). layer1 runs at 1/4 res with stride 1 throughout (the stem's
    max-pool did the down-sampling); its block 0 projects its input through downsample = (1x1
    conv, BatchNorm) where Bottlenecks widen 64 to 256 channels. layer2's block 0 down-samples
    to 1/8 res with a stride-2 3x3 convolution (conv1 of a BasicBlock, conv2 of a Bottleneck, as
    torchvision places it) and always projects, with a stride-2 1x1 convolution."""
    index: int  # 1 (layer1) or 2 (layer2)
    blocks: int
    bottleneck: bool

    @classmethod
    def of(cls, encoder: Encoder, index: int = 1) -> "Stage":
        return cls(index, encoder.layers[index - 1], encoder.bottleneck)

    @property
    def name(self) -> str:
        return f"layer{self.index}"

    def projects(self, j: int) -> bool:
        """Block j has a projection shortcut."""
        return j == 0 and (self.index > 1 or self.bottleneck)

    def block_modules(self, j: int) -> list[str]:
        """The convolutions and BatchNorms of block j, by name."""
        parts = ["conv1", "bn1", "conv2", "bn2"] + (["conv3", "bn3"] if self.bottleneck else [])
        if self.projects(j):
            parts += ["downsample.0", "downsample.1"]
        return [f"{self.name}.{j}.{p}" for p in parts]

    def window(self, j: int, part: str) -> Window:
        """The row window of block j's convolution `part` (conv1, conv2, conv3, downsample.0)."""
        strided = self.index > 1 and j == 0 and part in (
            "conv2" if self.bottleneck else "conv1", "downsample.0")
        stride = 2 if strided else 1
        if part == "downsample.0" or (self.bottleneck and part != "conv2"):
            return Window(1, stride, 0)
        return Window(3, stride, 1)

    def input_name(self, j: int) -> str:
        """Block j's input: p<j> / q<j>, the previous stage's output for layer2's block 0, and
        this stage's output for j = blocks."""
        if j == self.blocks:
            return STAGE_OUTPUTS[self.index]
        if j == 0 and self.index > 1:
            return STAGE_OUTPUTS[self.index - 1]
        return f"{KINDS[self.index][0]}{j}"

    def conv_name(self, j: int) -> str:
        """Block j's first convolution output (before its BatchNorm): a<j> / b<j>."""
        return f"{KINDS[self.index][1]}{j}"

    def log2_res(self, name: str) -> int:
        """log2 of the resolution (to the input's) of this stage's tensor `name`."""
        down = -1 - self.index  # layer1 at 1/4, layer2 at 1/8
        if self.index > 1 and name in (STAGE_OUTPUTS[self.index - 1], f"{KINDS[self.index][1]}0"):
            # layer2's input, and block 0's first convolution output where a Bottleneck strides
            # later (its conv1 is 1x1, stride 1)
            return down + 1 if name[0] != "b" or self.bottleneck else down
        return down


@dataclass(frozen=True)
class Stages:
    """The encoder's stages the walks may tile (layer1 at levels=3, layer1 and layer2 at 4)."""
    stages: tuple[Stage, ...]

    @classmethod
    def of(cls, encoder: Encoder) -> "Stages":
        return cls((Stage.of(encoder, 1), Stage.of(encoder, 2)))

    def tiled(self, levels: int) -> tuple[Stage, ...]:
        return self.stages[:max(0, levels - 2)]

    def window(self, conv: str) -> Window:
        """The row window of one of the walk's convolutions."""
        if conv == "conv1":
            return STEM
        if conv.startswith("layer"):
            stage, j, part = conv.split(".", 2)
            return self.stages[int(stage[5:]) - 1].window(int(j), part)
        return CONV3

    def at(self, name: str) -> tuple[Stage, str, int]:
        """(stage, "in" or "conv", block) of a stage's tensor name (l1 is layer2's block-0
        input, l2 past layer2's last block)."""
        for stage in self.stages:
            for j in range(stage.blocks + 1):
                if name == stage.input_name(j) and not (j == stage.blocks and stage.index == 1):
                    return stage, "in", j
                if j < stage.blocks and name == stage.conv_name(j):
                    return stage, "conv", j
        raise KeyError(name)


RESNET34 = Stages.of(ENCODERS["resnet34"])  # the study's


@dataclass(frozen=True)
class RegionSpec:
    """One tiled region: a stretch of the network between kept boundaries."""
    name: str
    inputs: tuple[str, ...]
    factors: tuple[int, ...]  # each input's resolution in multiples of the coarse grid
    # "x" or "s" (the stem), "p<j>" or "a<j>" (layer1), "l1", "q<j>" or "b<j>" (layer2),
    # "d<i>", "z<i>" or "y<i>"
    start: str
    # the kept tensor that ends the region (before a BatchNorm, or a residual block's input);
    # None: the encoder's or the network's last one
    stop: str | None
    stages: Stages = RESNET34  # the encoder's first stages, as levels 3 and 4 walk them

    @property
    def encoder(self) -> bool:
        """The region runs the stem or the tiled residual stages, not decoder blocks."""
        return self.start in STEM_STARTS or self.start == "l1" or self.start[0] in "paqb"

    @property
    def output(self) -> str:
        """The name of what the region computes: its stop, the encoder's "low" feature (the
        1/4-res input of the untiled levels) or the network's "out"."""
        return self.stop or ("low" if self.encoder else "out")

    @property
    def out_norm(self) -> str | None:
        """The BatchNorm that normalises the region's output (whose statistics it produces);
        a layer1 block's input p<j> goes through a convolution first."""
        if self.stop is None:
            return None
        if self.stop == "s":
            return "bn1"
        if self.encoder_tensor(self.stop):
            stage, kind, j = self.stages.at(self.stop)
            return f"{stage.name}.{j}.bn1" if kind == "conv" else None
        return _layer_of(self.stop, "bn")

    @staticmethod
    def encoder_tensor(name: str) -> bool:
        """A tiled residual stage's tensor (a block's input or first convolution output)."""
        return name == "l1" or name[0] in "paqb"


# -- the walks -------------------------------------------------------------------------------
def encoder_walk(ops, levels: int, spec: RegionSpec, strips):
    """x -> stem conv (-> "s") -> bn1, ReLU, max-pool (-> "p0"), then the tiled residual stages
    (layer1 at levels=3, layer2 too at 4: per block j, its input -> conv1 (-> a<j> / b<j>) ->
    the rest of the block (`_block_rest`) -> the next block's input): the untiled levels' input
    ("low"), or the region's stop on the way."""
    named = dict(zip(spec.inputs, strips))
    tiled = spec.stages.tiled(levels)
    if spec.start in STEM_STARTS:
        s = named["s"] if spec.start == "s" else ops.conv("conv1", named["x"])
        if spec.stop == "s":
            return s
        t = ops.pool(ops.norm("bn1", s, relu=True))
        if not tiled:
            return t
        stage, kind, j = tiled[0], "in", 0
    else:
        t = named[spec.start]
        stage, kind, j = spec.stages.at(spec.start)
    residual = named.get(stage.input_name(j))  # a region starting inside block j takes its input
    while _name(stage, kind, j) != spec.stop:
        if kind == "in" and j == stage.blocks:  # the stage's output
            if stage.index == len(tiled):
                return t
            stage, j = tiled[stage.index], 0
        elif kind == "in":
            residual, t, kind = t, ops.conv(f"{stage.name}.{j}.conv1", t), "conv"
        else:
            t, kind, j = _block_rest(ops, stage, j, t, residual), "in", j + 1
    return t


def _name(stage: Stage, kind: str, j: int) -> str:
    return stage.input_name(j) if kind == "in" else stage.conv_name(j)


def _block_rest(ops, stage: Stage, j: int, a, p):
    """Residual block j of `stage` from its first convolution's output `a` (its input `p`), as
    torchvision's BasicBlock / Bottleneck forward runs it: out = norm(conv(...)), out +=
    identity (the projected input where the block has a downsample), ReLU."""
    name = f"{stage.name}.{j}"
    h = ops.conv(f"{name}.conv2", ops.norm(f"{name}.bn1", a, relu=True))
    last = f"{name}.bn2"
    if stage.bottleneck:
        h, last = ops.conv(f"{name}.conv3", ops.norm(last, h, relu=True)), f"{name}.bn3"
    out = ops.norm(last, h)
    if stage.projects(j):
        p = ops.norm(f"{name}.downsample.1", ops.conv(f"{name}.downsample.0", p))
    return ops.relu(ops.add(out, p))


def decoder_walk(ops, spec: RegionSpec, strips):
    """From the region's start (a block's input, or a kept convolution output) through decoder
    blocks until `spec.stop`, or the segmentation head's output."""
    named = dict(zip(spec.inputs, strips))
    kind, block = spec.start[0], int(spec.start[1:])
    t = named[spec.start]
    if kind == "d":
        t, kind = _conv1(ops, block, t, named), "z"
    while f"{kind}{block}" != spec.stop:
        if kind == "z":
            t = ops.conv(f"block{block}.conv2", ops.norm(f"block{block}.bn1", t, relu=True))
            kind = "y"
            continue
        d = ops.norm(f"block{block}.bn2", t, relu=True)
        block += 1
        if block > LAST_BLOCK:
            return ops.conv("head", d)
        t, kind = _conv1(ops, block, d, named), "z"
    return t


def _conv1(ops, block: int, d, named: dict):
    """Nearest up-sampling, concatenation with the skip, the first convolution (pre-BN): one
    op, `up_conv`, which the tile bodies compute without the up-sampled tensor."""
    skip = SKIPS.get(block)
    if skip == "f1":  # the stem's feature, recomputed from the image with the stem's statistics
        # (keeping the stem's output instead would hold it on the device through the untiled
        # levels: 562 MB at 4188 px, which is what a 4 GiB budget does not have)
        skip = ops.norm("bn1", ops.conv("conv1", named["x"]), relu=True)
    elif skip is not None:
        skip = named[skip]
    return ops.up_conv(f"block{block}.conv1", d, skip)


# -- the regions of a tiling -------------------------------------------------------------------
def region_specs(levels: int, keep: str, layer1: str = "whole",
                 stages: Stages = RESNET34) -> list[RegionSpec]:
    """The encoder's regions (levels >= 2) and the decoder regions, in the order they run.
    `layer1` (levels >= 3) cuts each tiled residual stage: "whole" runs it inside one region
    (layer1 inside the stem's), "blocks" one region per residual block (its input kept),
    "convs" also cuts each block at its first convolution's output. At levels=4 layer1's output
    `l1` is always kept: layer2 and decoder block 2 (its skip) read it. `stages`: the
    encoder's first stages (blocks and their kind)."""
    specs = _encoder_specs(levels, keep, layer1, stages) if levels >= 2 else []
    start = f"d{LAST_BLOCK + 1 - levels}"
    skips = [(block, name) for block, name in SKIPS.items() if name != "f1"] + [(3, "x")]
    for stop in _cuts(levels, keep) + [None]:
        computed = _conv1_blocks(start, stop)
        inputs = [start] + [name for block, name in skips if block in computed]
        factors = [_factor(name, levels, stages) for name in inputs]
        name = "top" if stop is None else _layer_of(stop, "conv")
        specs.append(RegionSpec(name, tuple(inputs), tuple(factors), start, stop, stages))
        start = stop
    return specs


def _encoder_specs(levels: int, keep: str, layer1: str, stages: Stages) -> list[RegionSpec]:
    cuts = ["s"] if keep in ("bn", "half") else []
    for stage in stages.tiled(levels):
        if stage.index > 1 and layer1 == "whole":
            cuts.append(stage.input_name(0))  # the previous stage's output, a skip too
        for j in range(stage.blocks if layer1 != "whole" else 0):
            cuts += [stage.input_name(j)] + ([stage.conv_name(j)] if layer1 == "convs" else [])
    specs, start = [], "x"
    for stop in cuts + [None]:
        inputs = (start,)
        if start not in STEM_STARTS:
            stage, kind, j = stages.at(start)
            if kind == "conv":
                inputs += (stage.input_name(j),)  # + the residual
        specs.append(RegionSpec(_encoder_name(start, stop, stages), inputs,
                                tuple(_factor(n, levels, stages) for n in inputs), start, stop,
                                stages))
        start = stop
    return specs


def _encoder_name(start: str, stop: str | None, stages: Stages) -> str:
    if stop == "s":
        return "stem.conv1"
    if start in STEM_STARTS:
        return "stem"
    stage, kind, j = stages.at(start)
    if stop is None or stop == STAGE_OUTPUTS[stage.index]:
        if kind == "in" and j == 0:
            return stage.name  # the whole stage
    block = f"{stage.name}.{j}"
    return f"{block}.conv1" if stop is not None and stop == stage.conv_name(j) else block


def _cuts(levels: int, keep: str) -> list[str]:
    """The kept decoder tensors: z<i> of no block (none), of the skip blocks (conv1), of every
    tiled block (all); every BatchNorm input, y<i> too (bn), or all but the full-resolution
    block's y (half: that one would add a full-resolution tensor to the backward's peak, where
    the others replace one of their own size)."""
    cuts = []
    for block in range(LAST_BLOCK + 1 - levels, LAST_BLOCK + 1):
        if keep in ("all", "bn", "half") or (keep == "conv1" and block in SKIPS):
            cuts.append(f"z{block}")
        if keep == "bn" or (keep == "half" and block < LAST_BLOCK):
            cuts.append(f"y{block}")
    return cuts


def _layer_of(kept: str, kind: str) -> str:
    """The convolution ("conv") that writes a kept z<i> / y<i>, or the BatchNorm ("bn") that
    reads it: block<i>.conv1 / bn1 for z<i>, block<i>.conv2 / bn2 for y<i>."""
    return f"block{kept[1:]}.{kind}{1 if kept[0] == 'z' else 2}"


def _position(name: str | None) -> int:
    """Order of the decoder's tensors: d<i> < z<i> < y<i> < d<i+1>; None (the output) last."""
    return 10 ** 6 if name is None else 3 * int(name[1:]) + "dzy".index(name[0])


def _conv1_blocks(start: str, stop: str | None) -> set[int]:
    """Decoder blocks whose first convolution (producing z<i>) runs in the region."""
    return {b for b in range(LAST_BLOCK + 1)
            if _position(start) < _position(f"z{b}") <= _position(stop)}


def _factor(name: str, levels: int, stages: Stages = RESNET34) -> int:
    """An input's resolution in multiples of the coarse grid (1/2**levels)."""
    log2_res = {"x": 0, "s": -1}.get(name)  # log2 of the resolution to the input's
    if log2_res is None and (RegionSpec.encoder_tensor(name) or name == "l2"):
        stage, _kind, _j = stages.at(name)
        log2_res = stage.log2_res(name)
    elif log2_res is None:
        block = int(name[1:])  # block i's input is at 1/2**(5-i), its output at 1/2**(4-i)
        log2_res = block - 5 if name[0] == "d" else block - 4
    return 2 ** (levels + log2_res)


# -- geometry: the same walks over row bookkeeping ---------------------------------------------
@dataclass
class Trace:
    """A tensor of a region as the rows it reads: one (source factor, ops) branch per path from
    an input; `factor` is its own resolution in multiples of the coarse grid; `sources` the
    indices of the region inputs it is computed from."""
    factor: int
    branches: list[tuple[int, tuple]] = field(default_factory=list)
    sources: frozenset[int] = frozenset()

    def then(self, op) -> "Trace":
        factor = self.factor * op.factor if isinstance(op, Upsample) else self.factor // op.stride
        return Trace(factor, [(f, ops + (op,)) for f, ops in self.branches], self.sources)

    def paths(self) -> list[Path]:
        return [Path(f, self.factor, ops) for f, ops in self.branches]


class TraceOps:
    """`ops` for the walks: records the paths to every BatchNorm input, the norms' order, and
    which region inputs the walk has used by the time it reaches each BatchNorm."""

    def __init__(self, stages: Stages):
        self.stages = stages
        self.norm_paths: list[Path] = []
        self.modules: list[str] = []  # convolutions and BatchNorms, in the order first called
        self.norms: list[str] = []  # the BatchNorms alone, in the same order
        self.used: set[int] = set()  # the inputs any operation so far took
        self.reads: dict[str, frozenset[int]] = {}  # BatchNorm -> inputs used up to its input

    def conv(self, name: str, t: Trace) -> Trace:
        self._use(name)
        self.used |= t.sources
        return t.then(self.stages.window(name))

    def norm(self, name: str, t: Trace, relu: bool = False) -> Trace:
        self.norm_paths += t.paths()
        self.used |= t.sources
        if name not in self.norms:
            self.norms.append(name)
            self.reads[name] = frozenset(self.used)
        self._use(name)
        return t

    def _use(self, name: str) -> None:
        if name not in self.modules:
            self.modules.append(name)

    def relu(self, t: Trace) -> Trace:
        self.used |= t.sources
        return t

    def up(self, t: Trace) -> Trace:
        self.used |= t.sources
        return t.then(UP)

    def pool(self, t: Trace) -> Trace:
        self.used |= t.sources
        return t.then(POOL)

    def up_conv(self, name: str, d: Trace, skip: Trace | None) -> Trace:
        up = self.up(d)
        return self.conv(name, up if skip is None else self.cat(up, skip))

    def cat(self, a: Trace, b: Trace) -> Trace:
        assert a.factor == b.factor, (a.factor, b.factor)  # same grid: the walk is consistent
        self.used |= a.sources | b.sources
        return Trace(a.factor, a.branches + b.branches, a.sources | b.sources)

    add = cat


@dataclass(frozen=True)
class Traced:
    modules: list[str]  # convolutions and BatchNorms the region's body calls, first call first
    norms: list[str]  # its BatchNorms, in that order
    paths: list[Path]  # receptive-field paths to every BatchNorm input and to the output
    # BatchNorm -> the inputs (indices) the walk has used when it reaches that BatchNorm's
    # input: all that a statistics sweep of it reads (the rest come into play after it)
    reads: dict[str, frozenset[int]] = field(default_factory=dict)


def trace(spec: RegionSpec, levels: int) -> Traced:
    ops = TraceOps(spec.stages)
    inputs = [Trace(f, [(f, ())], frozenset({i})) for i, f in enumerate(spec.factors)]
    out = encoder_walk(ops, levels, spec, inputs) if spec.encoder \
        else decoder_walk(ops, spec, inputs)
    return Traced(ops.modules, ops.norms, ops.norm_paths + out.paths(), ops.reads)
