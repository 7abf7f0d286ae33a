"""The tiled part of the smp U-Net / ResNet-34 written once, for two readers (pure Python).

A region's computation is written as a walk over named operations (`conv`, `norm` (with the
ReLU that follows it fused when `relu=True`), `relu`, `up`, `pool`, `cat`, `add`) of an `ops` object. The tile bodies (memstudy/tiling/unet.py) walk
it with tensors of one strip; the geometry (`Trace` below) walks the same code with row
bookkeeping, so the halo of every region follows from exactly the operations its body runs.

Names: "conv1" / "bn1" are the stem's convolution and BatchNorm, "layer1.<j>.conv1|bn1|conv2|bn2"
ResNet-34's first three BasicBlocks (1/4 res), "block<i>.conv1|bn1|conv2|bn2" decoder block i's
two Conv2dReLU layers (smp numbering 0..4, block 4 at full resolution), "head" the
segmentation head. Inputs a region may take: "x" (the image), "l1" (layer1's output),
"d<i>" (decoder block i's input), "z<i>" (decoder block i's first convolution output before its
BatchNorm: a boundary kept with `keep=conv1`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from memstudy.tiling.geometry import Path, Upsample, Window

STEM = Window(7, 2, 3)
POOL = Window(3, 2, 1)
CONV3 = Window(3, 1, 1)
UP = Upsample(2)
LAYER1_BLOCKS = 3  # ResNet-34's layer1
LAST_BLOCK = 4  # the decoder's full-resolution block
SKIPS = {2: "l1", 3: "f1"}  # decoder block -> its skip feature inside the tiled levels


@dataclass(frozen=True)
class RegionSpec:
    """One tiled region: a stretch of the network between kept boundaries."""
    name: str
    inputs: tuple[str, ...]
    factors: tuple[int, ...]  # each input's resolution in multiples of the coarse grid
    start: str  # "stem", "d<i>" or "z<i>"
    stop: int | None  # decoder block whose conv1 output ends the region; None: the output


# -- the walks -------------------------------------------------------------------------------
def stem_walk(ops, levels: int, x):
    """x -> stem -> max-pool (-> layer1 at levels=3): the 1/4-res feature the encoder goes on
    with."""
    p = ops.pool(ops.norm("bn1", ops.conv("conv1", x), relu=True))
    if levels < 3:
        return p
    for j in range(LAYER1_BLOCKS):  # torchvision BasicBlock without down-sampling
        h = ops.norm(f"layer1.{j}.bn1", ops.conv(f"layer1.{j}.conv1", p), relu=True)
        h = ops.norm(f"layer1.{j}.bn2", ops.conv(f"layer1.{j}.conv2", h))
        p = ops.relu(ops.add(h, p))
    return p


def decoder_walk(ops, spec: RegionSpec, strips):
    """From the region's start (a block's input, or its kept conv1 output) through decoder
    blocks until `spec.stop`'s conv1 output, or the segmentation head's output."""
    named = dict(zip(spec.inputs, strips))
    block = int(spec.start[1:])
    z = named[spec.start] if spec.start[0] == "z" else _conv1(ops, block, named[spec.start], named)
    while spec.stop != block:
        d = _block_tail(ops, block, z)
        block += 1
        if block > LAST_BLOCK:
            return ops.conv("head", d)
        z = _conv1(ops, block, d, named)
    return z


def _conv1(ops, block: int, d, named: dict):
    """Nearest up-sampling, concatenation with the skip, the first convolution (pre-BN)."""
    d = ops.up(d)
    skip = SKIPS.get(block)
    if skip == "f1":  # the stem's feature, recomputed from the image with the stem's statistics
        d = ops.cat(d, ops.norm("bn1", ops.conv("conv1", named["x"]), relu=True))
    elif skip == "l1":
        d = ops.cat(d, named["l1"])
    return ops.conv(f"block{block}.conv1", d)


def _block_tail(ops, block: int, z):
    d = ops.norm(f"block{block}.bn1", z, relu=True)
    return ops.norm(f"block{block}.bn2", ops.conv(f"block{block}.conv2", d), relu=True)


# -- the regions of a tiling -------------------------------------------------------------------
def region_specs(levels: int, keep: str) -> list[RegionSpec]:
    """The stem region (levels >= 2) and the decoder regions in the order they run."""
    coarse = 2 ** levels  # the coarse grid is 1/coarse of the input resolution
    specs = []
    if levels >= 2:
        specs.append(RegionSpec("stem", ("x",), (coarse,), "stem", None))
    first = LAST_BLOCK + 1 - levels
    cuts = [b for b in range(first, LAST_BLOCK + 1)
            if keep == "all" or (keep == "conv1" and b in SKIPS)]
    start = f"d{first}"
    for stop in cuts + [None]:
        computed = _conv1_blocks(start, stop)
        inputs = [start] + [name for block, name in ((2, "l1"), (3, "x")) if block in computed]
        factors = [_factor(name, levels) for name in inputs]
        name = "top" if stop is None else f"block{stop}.conv1"
        specs.append(RegionSpec(name, tuple(inputs), tuple(factors), start, stop))
        start = f"z{stop}"
    return specs


def _conv1_blocks(start: str, stop: int | None) -> set[int]:
    block = int(start[1:])
    first = block if start[0] == "d" else block + 1
    return set(range(first, (LAST_BLOCK if stop is None else stop) + 1))


def _factor(name: str, levels: int) -> int:
    """An input's resolution in multiples of the coarse grid (1/2**levels)."""
    log2_res = {"x": 0, "l1": -2}.get(name)  # log2 of the resolution relative to the input
    if log2_res is None:
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

    def __init__(self):
        self.norm_paths: list[Path] = []
        self.modules: list[str] = []  # convolutions and BatchNorms, in the order first called

    def conv(self, name: str, t: Trace) -> Trace:
        self._use(name)
        return t.then(STEM if name == "conv1" else CONV3)

    def norm(self, name: str, t: Trace, relu: bool = False) -> Trace:
        self.norm_paths += t.paths()
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
    ops = TraceOps()
    inputs = [Trace(f, [(f, ())]) for f in spec.factors]
    out = stem_walk(ops, levels, inputs[0]) if spec.start == "stem" \
        else decoder_walk(ops, spec, inputs)
    norms = [name for name in ops.modules if ".bn" in name or name == "bn1"]
    return Traced(ops.modules, norms, ops.norm_paths + out.paths())
