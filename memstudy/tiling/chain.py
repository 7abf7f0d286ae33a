"""The tiled part of the smp U-Net written once, for two readers (pure Python).

A region's computation is written as a walk over named operations (`conv`, `norm` (with the
ReLU that follows it fused when `relu=True`), `relu`, `pool`, `add`, and `up_conv`: a decoder
block's nearest up-sampling, concatenation with its skip and first convolution) of an `ops`
object. The tile bodies (memstudy/tiling/unet.py) walk it with tensors of one strip; the
geometry (`Trace` below) walks the same code with row bookkeeping, so the halo of every region
follows from exactly the operations its body runs.

Names: "conv1" / "bn1" are the stem's convolution and BatchNorm (the same in every ResNet-family
encoder), "layer1.<j>.conv1|bn1|conv2|bn2" the encoder's first stage's residual blocks (1/4 res:
torchvision BasicBlocks, or Bottlenecks with conv3|bn3 too and, in block 0, the projection
shortcut "layer1.0.downsample.0|1"; `Layer1` says which), "block<i>.conv1|bn1|conv2|bn2" decoder block i's
two Conv2dReLU layers (smp numbering 0..4, block 4 at full resolution), "head" the
segmentation head. Tensors a region may start from, stop at or take: "x" (the image), "s"
(the stem's convolution output before bn1), "p<j>" (layer1 block j's input: p0 the max-pool's
output), "a<j>" (layer1 block j's first convolution output before its BatchNorm), "l1"
(layer1's output), "d<i>" (decoder block i's input), "z<i>" / "y<i>" (decoder block i's first /
second convolution output before its BatchNorm). A region that stops at a tensor before a
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
POINT = Window(1)  # a Bottleneck's 1x1 convolutions and its projection shortcut
UP = Upsample(2)
LAST_BLOCK = 4  # the decoder's full-resolution block
SKIPS = {2: "l1", 3: "f1"}  # decoder block -> its skip feature inside the tiled levels
STEM_STARTS = ("x", "s")  # where a region of the encoder's stem starts
LAYER1 = ("whole", "blocks", "convs")  # how levels=3 cuts layer1 into regions (region_specs)


@dataclass(frozen=True)
class Layer1:
    """The encoder's first residual stage as the walk runs it (stride 1 throughout: the stem's
    max-pool did the down-sampling): BasicBlocks (conv1, bn1, conv2, bn2) or Bottlenecks (conv1
    1x1, bn1, conv2 3x3 (grouped in ResNeXt), bn2, conv3 1x1, bn3), whose block 0 also projects
    its input (64 -> 256 channels) through downsample = (1x1 conv, BatchNorm)."""
    blocks: int
    bottleneck: bool

    @classmethod
    def of(cls, encoder: Encoder) -> "Layer1":
        return cls(encoder.layers[0], encoder.bottleneck)

    @property
    def projection(self) -> bool:
        """Block 0 has a projection shortcut (a Bottleneck widens 64 to 256 channels)."""
        return self.bottleneck

    def block_modules(self, j: int) -> list[str]:
        """The convolutions and BatchNorms of block j, by name."""
        parts = ["conv1", "bn1", "conv2", "bn2"] + (["conv3", "bn3"] if self.bottleneck else [])
        if j == 0 and self.projection:
            parts += ["downsample.0", "downsample.1"]
        return [f"layer1.{j}.{p}" for p in parts]

    def window(self, conv: str) -> Window:
        """The row window of one of the walk's convolutions."""
        if conv == "conv1":
            return STEM
        if self.bottleneck and conv.startswith("layer1.") and not conv.endswith("conv2"):
            return POINT
        return CONV3


RESNET34 = Layer1.of(ENCODERS["resnet34"])  # the study's


@dataclass(frozen=True)
class RegionSpec:
    """One tiled region: a stretch of the network between kept boundaries."""
    name: str
    inputs: tuple[str, ...]
    factors: tuple[int, ...]  # each input's resolution in multiples of the coarse grid
    start: str  # "x" or "s" (the stem), "p<j>" or "a<j>" (layer1), "d<i>", "z<i>" or "y<i>"
    # the kept tensor that ends the region (before a BatchNorm, or a layer1 block's input
    # p<j>); None: the encoder's or the network's last one
    stop: str | None
    layer1: Layer1 = RESNET34  # the encoder's first stage, as levels=3 walks it

    @property
    def encoder(self) -> bool:
        """The region runs the stem (and layer1 at levels=3), not decoder blocks."""
        return self.start in STEM_STARTS or self.start[0] in "pa"

    @property
    def output(self) -> str:
        """The name of what the region computes: its stop, the encoder's "low" feature (the
        1/4-res input of the untiled levels) or the network's "out"."""
        return self.stop or ("low" if self.encoder else "out")

    @property
    def out_norm(self) -> str | None:
        """The BatchNorm that normalises the region's output (whose statistics it produces);
        a layer1 block's input p<j> goes through a convolution first."""
        if self.stop is None or self.stop[0] == "p":
            return None
        if self.stop == "s":
            return "bn1"
        if self.stop[0] == "a":
            return f"layer1.{self.stop[1:]}.bn1"
        return _layer_of(self.stop, "bn")


# -- the walks -------------------------------------------------------------------------------
def encoder_walk(ops, levels: int, spec: RegionSpec, strips):
    """x -> stem conv (-> "s") -> bn1, ReLU, max-pool (-> "p0", then layer1 at levels=3: per
    residual block j, p<j> -> conv1 (-> "a<j>") -> the rest of the block (`_block_rest`) ->
    p<j+1>): the 1/4-res feature the untiled levels go on with, or the region's stop on the
    way."""
    named = dict(zip(spec.inputs, strips))
    if spec.start in STEM_STARTS:
        s = named["s"] if spec.start == "s" else ops.conv("conv1", named["x"])
        if spec.stop == "s":
            return s
        t, kind, j = ops.pool(ops.norm("bn1", s, relu=True)), "p", 0
        if levels < 3:
            return t
    else:
        t, kind, j = named[spec.start], spec.start[0], int(spec.start[1:])
    residual = named.get(f"p{j}")  # a region starting inside block j takes its input too
    while f"{kind}{j}" != spec.stop:
        if kind == "p":
            if j == spec.layer1.blocks:
                return t  # layer1's output
            residual, t, kind = t, ops.conv(f"layer1.{j}.conv1", t), "a"
        else:
            t, kind, j = _block_rest(ops, spec.layer1, j, t, residual), "p", j + 1
    return t


def _block_rest(ops, layer1: Layer1, j: int, a, p):
    """Residual block j of layer1 from its first convolution's output `a` (its input `p`), as
    torchvision's BasicBlock / Bottleneck forward runs it: out = norm(conv(...)), out +=
    identity (the projected input where the block has a downsample), ReLU."""
    name = f"layer1.{j}"
    h = ops.conv(f"{name}.conv2", ops.norm(f"{name}.bn1", a, relu=True))
    last = f"{name}.bn2"
    if layer1.bottleneck:
        h, last = ops.conv(f"{name}.conv3", ops.norm(last, h, relu=True)), f"{name}.bn3"
    out = ops.norm(last, h)
    if j == 0 and layer1.projection:
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
    elif skip == "l1":
        skip = named["l1"]
    return ops.up_conv(f"block{block}.conv1", d, skip)


# -- the regions of a tiling -------------------------------------------------------------------
def region_specs(levels: int, keep: str, layer1: str = "whole",
                 stage: Layer1 = RESNET34) -> list[RegionSpec]:
    """The encoder's regions (levels >= 2) and the decoder regions, in the order they run.
    `layer1` (levels=3): "whole" runs layer1 inside the stem's region, "blocks" one region per
    residual block (its input p<j> kept), "convs" also cuts each block at its first
    convolution's output a<j>. `stage`: the encoder's layer1 (blocks and their kind)."""
    specs = _encoder_specs(levels, keep, layer1, stage) if levels >= 2 else []
    start = f"d{LAST_BLOCK + 1 - levels}"
    for stop in _cuts(levels, keep) + [None]:
        computed = _conv1_blocks(start, stop)
        inputs = [start] + [name for block, name in ((2, "l1"), (3, "x")) if block in computed]
        factors = [_factor(name, levels) for name in inputs]
        name = "top" if stop is None else _layer_of(stop, "conv")
        specs.append(RegionSpec(name, tuple(inputs), tuple(factors), start, stop, stage))
        start = stop
    return specs


def _encoder_specs(levels: int, keep: str, layer1: str, stage: Layer1) -> list[RegionSpec]:
    cuts = ["s"] if keep in ("bn", "half") else []
    if levels >= 3 and layer1 != "whole":
        for j in range(stage.blocks):
            cuts += [f"p{j}", f"a{j}"] if layer1 == "convs" else [f"p{j}"]
    specs, start = [], "x"
    for stop in cuts + [None]:
        inputs = (start,) if start[0] != "a" else (start, f"p{start[1:]}")  # + the residual
        specs.append(RegionSpec(_encoder_name(start, stop), inputs,
                                tuple(_factor(n, levels) for n in inputs), start, stop, stage))
        start = stop
    return specs


def _encoder_name(start: str, stop: str | None) -> str:
    if stop == "s":
        return "stem.conv1"
    if start in STEM_STARTS:
        return "stem"
    block = f"layer1.{start[1:]}"
    return f"{block}.conv1" if stop is not None and stop[0] == "a" else block


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


def _factor(name: str, levels: int) -> int:
    """An input's resolution in multiples of the coarse grid (1/2**levels)."""
    log2_res = {"x": 0, "s": -1, "l1": -2}.get(name)  # log2 of the resolution to the input's
    if name[0] in "pa":  # layer1's tensors, at 1/4 res
        log2_res = -2
    elif log2_res is None:
        block = int(name[1:])  # block i's input is at 1/2**(5-i), its output at 1/2**(4-i)
        log2_res = block - 5 if name[0] == "d" else block - 4
    return 2 ** (levels + log2_res)


# -- geometry: the same walks over row bookkeeping ---------------------------------------------
@dataclass
class Trace:
    """A tensor of a region as the rows it reads: one (source factor, ops) branch per path from
    an input; `factor` is its own resolution in multiples of the coarse grid."""
    factor: int
    branches: list[tuple[int, tuple]] = field(default_factory=list)

    def then(self, op) -> "Trace":
        factor = self.factor * op.factor if isinstance(op, Upsample) else self.factor // op.stride
        return Trace(factor, [(f, ops + (op,)) for f, ops in self.branches])

    def paths(self) -> list[Path]:
        return [Path(f, self.factor, ops) for f, ops in self.branches]


class TraceOps:
    """`ops` for the walks: records the paths to every BatchNorm input and the norms' order."""

    def __init__(self, layer1: Layer1):
        self.layer1 = layer1
        self.norm_paths: list[Path] = []
        self.modules: list[str] = []  # convolutions and BatchNorms, in the order first called
        self.norms: list[str] = []  # the BatchNorms alone, in the same order

    def conv(self, name: str, t: Trace) -> Trace:
        self._use(name)
        return t.then(self.layer1.window(name))

    def norm(self, name: str, t: Trace, relu: bool = False) -> Trace:
        self.norm_paths += t.paths()
        if name not in self.norms:
            self.norms.append(name)
        self._use(name)
        return t

    def _use(self, name: str) -> None:
        if name not in self.modules:
            self.modules.append(name)

    def relu(self, t: Trace) -> Trace:
        return t

    def up(self, t: Trace) -> Trace:
        return t.then(UP)

    def pool(self, t: Trace) -> Trace:
        return t.then(POOL)

    def up_conv(self, name: str, d: Trace, skip: Trace | None) -> Trace:
        up = self.up(d)
        return self.conv(name, up if skip is None else self.cat(up, skip))

    def cat(self, a: Trace, b: Trace) -> Trace:
        assert a.factor == b.factor, (a.factor, b.factor)  # same grid: the walk is consistent
        return Trace(a.factor, a.branches + b.branches)

    add = cat


@dataclass(frozen=True)
class Traced:
    modules: list[str]  # convolutions and BatchNorms the region's body calls, first call first
    norms: list[str]  # its BatchNorms, in that order
    paths: list[Path]  # receptive-field paths to every BatchNorm input and to the output


def trace(spec: RegionSpec, levels: int) -> Traced:
    ops = TraceOps(spec.layer1)
    inputs = [Trace(f, [(f, ())]) for f in spec.factors]
    out = encoder_walk(ops, levels, spec, inputs) if spec.encoder \
        else decoder_walk(ops, spec, inputs)
    return Traced(ops.modules, ops.norms, ops.norm_paths + out.paths())
