"""The tiled regions of the smp U-Net (any ResNet-family encoder), and the forward that runs them.

`levels` counts the resolution levels tiled, from full resolution down (the coarse grid of the
regions is 1/2**levels of the input):
- levels=1: decoder block 4 (full res) and the head; the stem runs untiled.
- levels=2 (default): also the stem (conv1, bn1, relu, max-pool: region "stem", whose half-res
  output and max-pool indices are never stored) and decoder block 3, whose skip feature (the
  stem's) is recomputed per tile from the image with the stem's statistics.
- levels=3: also layer1 (inside region "stem") and decoder block 2 (skip: layer1's output, a
  kept boundary that layer2 needs anyway).
- levels=4: also layer2 (its strided block 0 and projection included) and decoder block 1
  (skip: layer2's output, the untiled levels' input); layer1's output is then a kept boundary
  between tiled regions, read by layer2's first region and by decoder block 2.
`keep` chooses the boundaries between decoder regions: "none" runs all tiled decoder blocks as
one region "top" (fewest full-size tensors; a region with K BatchNorms costs K + 1 sweeps),
"conv1" also keeps each skip block's first convolution output before its BatchNorm (one more
tensor of that level, far fewer recomputed convolutions: the concatenating convolutions are the
tiled levels' most expensive ones); "all", "half" and "bn" keep more (docs/techniques/tile.md).
memstudy/tiling/chain.py writes the regions once, for the tile bodies here and for their halos.

Everything else (layer1, layer2 or layer3 down, the untiled decoder blocks) runs as usual, through the
modules' own forward, so checkpoint / invertible / offload / amp act on it unchanged. The walks
follow smp 0.6's ResNetEncoder.forward, UnetDecoderBlock.forward (nearest up-sampling by 2,
concatenation with the skip, attention (identity), two Conv2dReLU = conv, BatchNorm, ReLU),
torchvision's BasicBlock / Bottleneck (grouped or not) and SegmentationHead (conv, identity
up-sampling, activation) step for step, except that a decoder block's up-sampling, concatenation and first convolution run as one
exact folded op (`TensorOps.up_conv`); `check_model` refuses a model that differs in anything
they rely on.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from memstudy.errors import ConfigError
from memstudy.models.unet import up_conv
from memstudy.tiling.chain import (CONV3, LAST_BLOCK, RegionSpec, Stages, decoder_walk, encoder_walk,
                                   region_specs, trace)
from memstudy.tiling.geometry import Window, halo, plan_tiles, split_rows
from memstudy.tiling.graphs import TileGraphs
from memstudy.tiling.levels import check_keep, check_layer1, check_levels
from memstudy.tiling.sweep import Region, TileRun, run_region


# -- the model's parts by the names the walks use ----------------------------------------------
def stages_of(unet: nn.Module) -> Stages:
    """The model's first residual stages as the walks run them (from its encoder's description)."""
    return Stages.of(unet.encoder_spec)


def named_modules(unet: nn.Module, levels: int) -> dict[str, nn.Module]:
    enc, blocks = unet.encoder, unet.decoder_blocks
    found = {"conv1": enc.conv1, "bn1": enc.bn1, "head": unet.head, "maxpool": enc.maxpool}
    for stage in stages_of(unet).tiled(levels):  # invertible may replace them otherwise
        for j in range(stage.blocks):
            found.update({name: enc.get_submodule(name) for name in stage.block_modules(j)})
    for i in range(1, LAST_BLOCK + 1):
        block = blocks[i]
        found.update({f"block{i}.conv1": block.conv1[0], f"block{i}.bn1": block.conv1[1],
                      f"block{i}.conv2": block.conv2[0], f"block{i}.bn2": block.conv2[1]})
    return found


def plain_stages(unet: nn.Module, levels: int = 3) -> bool:
    """The residual stages `levels` tiles are the encoder's own blocks, as the walks run them
    (invertible replaces them with momentum blocks): each with the modules the walk names, and
    a projection shortcut exactly where the walk expects one."""
    if levels < 3:
        return True
    if not hasattr(unet, "encoder_spec"):
        return False
    for stage in stages_of(unet).tiled(levels):
        units = list(unet.encoder.get_submodule(stage.name))
        if len(units) != stage.blocks:
            return False
        for j, unit in enumerate(units):
            parts = [name.split(".", 2)[2] for name in stage.block_modules(j)]
            if not all(_has(unit, part) for part in parts):
                return False
            if (unit.downsample is not None) != stage.projects(j):
                return False
    return True


def _has(module: nn.Module, name: str) -> bool:
    try:
        module.get_submodule(name)
    except AttributeError:
        return False
    return True


def check_model(unet: nn.Module, levels: int) -> None:
    """Refuse anything the walks do not reproduce exactly."""
    enc, blocks, head = unet.encoder, unet.decoder_blocks, unet.head
    problems = []
    if (enc.conv1.kernel_size, enc.conv1.stride, enc.conv1.padding) != ((7, 7), (2, 2), (3, 3)):
        problems.append("stem conv1 is not 7x7 / stride 2 / padding 3")
    pool = enc.maxpool
    if (pool.kernel_size, pool.stride, pool.padding, pool.dilation) != (3, 2, 1, 1):
        problems.append("max-pool is not 3 / stride 2 / padding 1")
    if not isinstance(unet.decoder.center, nn.Identity):
        problems.append("the decoder has a center block")
    convs = [f"block{i}.conv{k}" for i in range(LAST_BLOCK + 1 - levels, LAST_BLOCK + 1)
             for k in (1, 2)]
    if not plain_stages(unet, levels):
        raise ConfigError(f"tile:levels={levels} tiles layer1{' and layer2' * (levels > 3)}, "
                          f"which are not {unet.encoder_name}'s residual blocks here "
                          "(invertible replaces them with momentum blocks); use tile:levels=2 "
                          "or drop invertible")
    modules = named_modules(unet, levels)
    for name in convs:  # the decoder's: up_conv splits their weights by input channel
        problems += _conv_problems(name, modules[name], CONV3, groups=False)
    stages = stages_of(unet)
    for stage in stages.tiled(levels):
        for j in range(stage.blocks):
            for name in stage.block_modules(j):
                if ".bn" not in name and not name.endswith("downsample.1"):
                    problems += _conv_problems(name, modules[name], stages.window(name),
                                               groups=True)
    for i in range(LAST_BLOCK + 1 - levels, LAST_BLOCK + 1):
        block = blocks[i]
        if block.interpolation_mode != "nearest":
            problems.append(f"decoder block {i} up-samples with {block.interpolation_mode}")
        for att in (block.attention1, block.attention2):
            if not isinstance(att.attention, nn.Identity):
                problems.append(f"decoder block {i} has attention")
    if not isinstance(head[1], nn.Identity) or head[0].kernel_size != (3, 3):
        problems.append("the segmentation head up-samples or is not a 3x3 convolution")
    for spec in region_specs(levels, "none", stages=stages):
        for name in trace(spec, levels).norms:
            bn = modules[name]
            if not (isinstance(bn, nn.BatchNorm2d) and bn.affine and bn.track_running_stats):
                problems.append(f"{name} is not an affine BatchNorm2d with running stats")
    if problems:
        raise ConfigError("tile: the model differs from the smp U-Net the tiled regions "
                          f"reproduce ({'; '.join(problems)}); drop tile")


def _conv_problems(name: str, conv: nn.Module, window: Window, groups: bool) -> list[str]:
    """What keeps `conv` from being the zero-padded convolution of `window` (kernel, stride,
    padding along rows, the same along columns) the walk's geometry assumes (grouped allowed
    where the walk calls the module itself)."""
    k, stride, pad = window.kernel, window.stride, window.pad
    expected = ((k, k), (stride, stride), (pad, pad), (1, 1), "zeros")
    if not isinstance(conv, nn.Conv2d) or (conv.kernel_size, conv.stride, conv.padding,
                                           conv.dilation, conv.padding_mode) != expected:
        return [f"{name} is not a {k}x{k} / stride {stride} / zero padding {pad} convolution"]
    if conv.groups != 1 and not groups:
        return [f"{name} is a grouped convolution"]
    return []


class TensorOps:
    """`ops` for the walks over one tile's strips (BatchNorm through the tile run's statistics)."""

    def __init__(self, run: TileRun, modules: dict[str, nn.Module], norm_index: dict[str, int]):
        self.run, self.modules, self.norm_index = run, modules, norm_index

    def conv(self, name: str, t: torch.Tensor) -> torch.Tensor:
        module = self.modules[name]
        if isinstance(module, nn.Conv2d):  # the head is a Sequential of a convolution and more
            t = layout_of_weight(t, module.weight)
        return module(t)

    def norm(self, name: str, t: torch.Tensor, relu: bool = False) -> torch.Tensor:
        return self.run.norm(self.norm_index[name], t, relu)

    def relu(self, t: torch.Tensor) -> torch.Tensor:
        return F.relu(t)

    def pool(self, t: torch.Tensor) -> torch.Tensor:
        return self.modules["maxpool"](t)

    def up_conv(self, name: str, d: torch.Tensor, skip: torch.Tensor | None) -> torch.Tensor:
        return up_conv(self.modules[name], d, skip)

    def add(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a + b


def layout_of_weight(t: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A one-channel input (the image) viewed with channels_last strides when the weight is
    channels_last. One channel makes both layouts the same bytes, and the strides alone decide
    which cuDNN reads: with NCHW strides, the stem convolution's backward converted its 64-channel
    output gradient to NCHW in every tile (an H100 profile at 8192 px: 71 ms of one step)."""
    if t.dim() != 4 or t.shape[1] != 1 or weight.shape[1] != 1 or weight.stride(1) != 1:
        return t
    return t.as_strided(t.shape, (t.stride(0), 1, t.stride(2), t.stride(3)), t.storage_offset())


def build_region(unet: nn.Module, spec: RegionSpec, levels: int, produced: set[str],
                 kernels: str) -> Region:
    """The region of `spec`; `produced`: norms whose statistics earlier regions compute (its
    own and its output's are added); `kernels`: its BatchNorms' (norm.py)."""
    traced = trace(spec, levels)
    shared = [n for n in traced.norms if n in produced]
    names = shared + [n for n in traced.norms if n not in shared]
    produced.update(names + [spec.out_norm] if spec.out_norm else names)
    modules = named_modules(unet, levels)
    index = {name: j for j, name in enumerate(names)}

    def body(run: TileRun, *strips: torch.Tensor) -> torch.Tensor:
        ops = TensorOps(run, modules, index)
        return encoder_walk(ops, levels, spec, strips) if spec.encoder \
            else decoder_walk(ops, spec, strips)

    reads = [tuple(i in traced.reads[n] for i in range(len(spec.inputs))) for n in names]
    return Region(spec.name, spec.factors, [modules[n] for n in names], len(shared),
                  [modules[n] for n in traced.modules], traced.paths, body, names,
                  modules[spec.out_norm] if spec.out_norm else None, kernels, reads)


# -- the forward ------------------------------------------------------------------------------
class TiledForward:
    """Replaces `UNet.forward_padded` on an instance: same function, tiled top levels."""

    def __init__(self, unet: nn.Module, levels: int = 2, tiles: int = 0, rows: int = 0,
                 keep: str = "conv1", graphs: TileGraphs | None = None, layer1: str = "whole",
                 kernels: str = "triton", stream: bool = False, ahead: bool = False):
        """`graphs`: replay the tile bodies as CUDA graphs (memstudy/tiling/graphs.py); None
        runs them eagerly. `layer1`: how levels=3 cuts layer1 into regions (chain.region_specs).
        `kernels`: the tiled BatchNorms' on CUDA, triton or torch (memstudy/tiling/norm.py).
        `stream`: the boundaries only tiled regions read lie in host memory (`host_outputs`);
        `ahead`: their copies run on side streams, a tile ahead (memstudy/streaming.py)."""
        check_levels(levels, "tile:levels")
        check_keep(keep, "tile:keep")
        check_layer1(layer1, levels, "tile:layer1")
        check_model(unet, levels)
        self.unet, self.levels, self.tiles, self.rows, self.keep = unet, levels, tiles, rows, keep
        self.graphs = graphs
        self.stages = stages_of(unet)
        self.specs = region_specs(levels, keep, layer1, self.stages)
        self.stream, self.ahead = stream, ahead
        self.kept_on_host = self.host_outputs()  # fixed by the regions: derived once
        if stream:  # the untiled decoder blocks' concatenations are their largest tensors
            for block in unet.decoder.blocks[:LAST_BLOCK + 1 - levels]:
                block.fold_upsampling = True
        produced: set[str] = set()
        self.regions = {spec.name: build_region(unet, spec, levels, produced, kernels)
                        for spec in self.specs}
        self.halos = {name: halo(region.paths) for name, region in self.regions.items()}
        # per region: the boundaries no later region reads (the image is the caller's)
        self.last_read = {spec.name: set(spec.inputs) - {"x"} - {
            n for later in self.specs[i + 1:] for n in later.inputs}
            for i, spec in enumerate(self.specs)}

    def host_outputs(self) -> set[str]:
        """With `stream`: the region outputs that only later tiled regions read, kept in host
        memory. Not `low` (the untiled levels' input, whole on the device) nor `out` (the
        loss's)."""
        if not self.stream:
            return set()
        return {spec.output for spec in self.specs} - {"low", "out"}

    def host_bytes(self, height: int, width: int, batch: int, element_bytes: int) -> int:
        """Bytes of the boundaries `stream` keeps in host memory for a padded height x width
        input of `batch` images, `element_bytes` per element (2 under amp): each is its
        region's output, channels from the modules that write it, at its resolution."""
        return sum(batch * channels * (height // down) * (width // down) * element_bytes
                   for channels, down in map(self.boundary_shape, self.host_outputs()))

    def fetched_ahead_bytes(self, width: int, batch: int, element_bytes: int) -> float:
        """Bytes per full-resolution strip row that a streamed sweep holds beside the tile
        computing when its copies run a tile ahead (memstudy/streaming.py), the most of any
        region: in backward the next tile's host input strips (the image's in float32, the
        batches being float32) and its rows of a host output gradient, and the tile before's
        input gradient rows still being written back. Zero without `stream` or `ahead`."""
        if not (self.stream and self.ahead):
            return 0.0

        def row_bytes(name: str) -> float:
            channels, down = ((self.unet.encoder.conv1.in_channels, 1) if name == "x"
                              else self.boundary_shape(name))
            element = 4 if name == "x" else element_bytes
            return batch * channels * (width / down) / down * element

        host = self.kept_on_host | {"x"}
        return max(sum(row_bytes(n) * (1 if n == "x" else 2)  # the image needs no gradient
                       for n in spec.inputs if n in host)
                   + (row_bytes(spec.output) if spec.output in host else 0.0)
                   for spec in self.specs)

    def boundary_shape(self, name: str) -> tuple[int, int]:
        """(channels, down-sampling) of a boundary the stream keeps on the host: the stem's
        output `p0`, the tiled stages' between their regions (a block's first convolution's
        output, or the previous block's output: layer1's at 1/4 resolution, layer2's at 1/8;
        `l1`, layer1's output, is layer2's input and decoder block 2's skip at levels=4); the
        decoder's kept first convolution outputs `z<i>` (1/2**(4-i))."""
        enc, blocks = self.unet.encoder, self.unet.decoder_blocks
        if name[0] == "z":
            return blocks[int(name[1])].conv1[0].out_channels, 2 ** (4 - int(name[1]))
        if name == "p0":
            return enc.conv1.out_channels, 4
        stage, kind, j = self.stages.at(name)
        down = 2 ** -stage.log2_res(name)
        layer = enc.get_submodule(stage.name)
        if kind == "conv":
            return layer[j].conv1.out_channels, down
        before = layer[j - 1] if j else enc.layer1[-1]  # l1: layer1's last block's output
        last = [m for m in before.modules() if isinstance(m, nn.BatchNorm2d)][-1]
        return last.num_features, down

    def plan(self, height: int) -> dict[str, list]:
        unit = 2 ** self.levels
        total = height // unit
        if self.tiles > total:
            raise ConfigError(f"tile:tiles={self.tiles} exceeds the {total} rows of the "
                              f"{unit}x-down-sampled grid of a {height}-row input; use fewer tiles")
        owned = split_rows(total, self.tiles, self.rows // unit)
        return {name: plan_tiles(owned, total, *h) for name, h in self.halos.items()}

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        tiles = self.plan(x.shape[-2])
        device = next(self.unet.parameters()).device
        if x.device != device and device.type == "cuda" and not x.is_pinned():
            x = x.pin_memory()  # a host image padded to the stride: strips copy in asynchronously
        values: dict[str, torch.Tensor] = {"x": x}  # the region boundaries alive now
        stats: dict = {}  # norm name -> the statistics it normalises with
        stem = [spec for spec in self.specs if spec.encoder]
        for spec in stem:
            self._run(spec, tiles[spec.name], values, stats, device)
        values.update(self._untiled(values))
        for spec in self.specs[len(stem):]:
            self._run(spec, tiles[spec.name], values, stats, device)
        return values["out"]

    def _run(self, spec: RegionSpec, tiles: list, values: dict, stats: dict,
             device: torch.device) -> None:
        """Run one region; its output joins `values`, inputs no later region reads leave it
        (so that a boundary an offload moved to the host leaves the device)."""
        region = self.regions[spec.name]
        shared = [stats[name] for name in region.norm_names[:region.shared]]
        out, own, out_stats = run_region(region, tiles, [values[n] for n in spec.inputs],
                                         shared, self.graphs, device,
                                         host=spec.output in self.kept_on_host, ahead=self.ahead)
        stats.update(zip(region.norm_names, own))
        if out_stats is not None:
            stats[spec.out_norm] = out_stats
        values[spec.output] = out
        for name in self.last_read[spec.name]:
            del values[name]

    def untiled_modules(self) -> list[nn.Module]:
        """The modules that run below the tiled levels through their own forward (the residual
        stages and decoder blocks `_untiled` calls): what `compile` compiles with tile, whose
        regions run through autograd Functions that TorchDynamo does not trace."""
        enc, first = self.unet.encoder, LAST_BLOCK + 1 - self.levels
        stages = [enc.layer1, enc.layer2][max(0, self.levels - 2):]
        return stages + [enc.layer3, enc.layer4] + list(self.unet.decoder.blocks[:first])

    def _untiled(self, values: dict) -> dict[str, torch.Tensor]:
        """The levels below the tiled ones, through the modules' own forward: the first tiled
        decoder block's input, and the skip the tiled decoder reads that the untiled levels
        start from (layer1's output at levels=3, layer2's at 4)."""
        enc, dec = self.unet.encoder, self.unet.decoder
        f1 = None  # the stem's feature, decoder block 3's skip
        if self.levels >= 2:
            low = values.pop("low")
        else:
            f1 = enc.relu(enc.bn1(enc.conv1(values["x"])))
            low = enc.maxpool(f1)
        # layer1's output: the untiled levels' input at levels=3, a tiled boundary at 4
        l1 = enc.layer1(low) if self.levels < 3 else low if self.levels == 3 else None
        l2 = low if self.levels >= 4 else enc.layer2(l1)
        l3 = enc.layer3(l2)
        d = dec.center(enc.layer4(l3))
        skips = [l3, l2, l1, f1]
        first = LAST_BLOCK + 1 - self.levels
        for i in range(first):  # the untiled decoder blocks, through their forward
            d = dec.blocks[i](d, *skips[i].shape[-2:], skip_connection=skips[i])
        read = {3: {"l1": l1}, 4: {"l2": l2}}.get(self.levels, {})
        return {**read, f"d{first}": d}
