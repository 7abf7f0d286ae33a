"""The tiled regions of the smp U-Net / ResNet-34, and the forward that runs them.

`levels` counts the resolution levels tiled, from full resolution down:
- levels=2 (default): region "stem" = x -> conv1, bn1, relu, max-pool -> 1/4-res features (the
  half-resolution stem output and the max-pool indices are never stored); region "top" =
  (decoder block 2's output at 1/4 res, x) -> the stem's skip feature recomputed per tile
  (conv1 and bn1 with the statistics tensors of region "stem", relu) -> decoder block 3 (1/2) ->
  decoder block 4 (full res) -> segmentation head -> output. The coarse grid is 1/4 res.
- levels=1: region "top" = decoder block 3's output (1/2 res) -> decoder block 4 -> head; the
  stem runs untiled. The coarse grid is 1/2 res.
Everything else (layer1..layer4, decoder blocks 0..2 or 0..3) runs as usual, through the
modules' own forward, so checkpoint / invertible / offload / amp act on it unchanged.

The bodies below follow smp 0.6's ResNetEncoder.forward, UnetDecoderBlock.forward (nearest
up-sampling by 2, concatenation with the skip, attention (identity), two Conv2dReLU = conv,
BatchNorm, ReLU) and SegmentationHead (conv, identity up-sampling, activation) step for step;
`check_model` refuses a model that differs in anything they rely on.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from memstudy.errors import ConfigError
from memstudy.tiling.geometry import plan_tiles, split_rows
from memstudy.tiling.levels import check_levels, halos, stem_paths, top_paths
from memstudy.tiling.sweep import Region, TileRun, run_region


# -- the model's parts as tile bodies --------------------------------------------------------
def check_model(unet: nn.Module) -> None:
    """Refuse anything the bodies below do not reproduce exactly."""
    enc, blocks, head = unet.encoder, unet.decoder_blocks, unet.head
    problems = []
    if (enc.conv1.kernel_size, enc.conv1.stride, enc.conv1.padding) != ((7, 7), (2, 2), (3, 3)):
        problems.append("stem conv1 is not 7x7 / stride 2 / padding 3")
    pool = enc.maxpool
    if (pool.kernel_size, pool.stride, pool.padding, pool.dilation) != (3, 2, 1, 1):
        problems.append("max-pool is not 3 / stride 2 / padding 1")
    if not isinstance(unet.decoder.center, nn.Identity):
        problems.append("the decoder has a center block")
    for i in (3, 4):
        block = blocks[i]
        if block.interpolation_mode != "nearest":
            problems.append(f"decoder block {i} up-samples with {block.interpolation_mode}")
        for conv in (block.conv1[0], block.conv2[0]):
            if (conv.kernel_size, conv.stride, conv.padding) != ((3, 3), (1, 1), (1, 1)):
                problems.append(f"decoder block {i} has a non-3x3 convolution")
        for att in (block.attention1, block.attention2):
            if not isinstance(att.attention, nn.Identity):
                problems.append(f"decoder block {i} has attention")
    if not isinstance(head[1], nn.Identity) or head[0].kernel_size != (3, 3):
        problems.append("the segmentation head up-samples or is not a 3x3 convolution")
    for bn in tiled_norms(unet, 2):
        if not (isinstance(bn, nn.BatchNorm2d) and bn.affine and bn.track_running_stats):
            problems.append(f"{type(bn).__name__} is not an affine BatchNorm2d with running stats")
    if problems:
        raise ConfigError("tile: the model differs from the smp U-Net / ResNet-34 the tiled "
                          f"regions reproduce ({'; '.join(problems)}); drop tile")


def tiled_norms(unet: nn.Module, levels: int) -> list[nn.Module]:
    blocks = unet.decoder_blocks
    block4 = [blocks[4].conv1[1], blocks[4].conv2[1]]
    if levels == 1:
        return block4
    return [unet.encoder.bn1, blocks[3].conv1[1], blocks[3].conv2[1], *block4]


def _conv_bn_relu(run: TileRun, j: int, layer: nn.Sequential, z: torch.Tensor) -> torch.Tensor:
    conv, _, _ = layer  # smp Conv2dReLU: conv, BatchNorm, ReLU
    return F.relu(run.norm(j, conv(z)))


def _decoder_block(run: TileRun, j: int, block: nn.Module, d: torch.Tensor,
                   skip: torch.Tensor | None) -> torch.Tensor:
    d = F.interpolate(d, scale_factor=2, mode="nearest")  # == smp's size=(2h, 2w)
    if skip is not None:
        d = block.attention1(torch.cat([d, skip], dim=1))
    d = _conv_bn_relu(run, j, block.conv1, d)
    d = _conv_bn_relu(run, j + 1, block.conv2, d)
    return block.attention2(d)


def _stem(run: TileRun, enc: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return F.relu(run.norm(0, enc.conv1(x)))


def regions(unet: nn.Module, levels: int) -> dict[str, Region]:
    enc, blocks, head = unet.encoder, unet.decoder_blocks, unet.head
    norms = tiled_norms(unet, levels)
    if levels == 1:
        def top1(run, d3):
            return head(_decoder_block(run, 0, blocks[4], d3, None))
        return {"top": Region("top", (1,), norms, 0, [blocks[4], head], top_paths(1), top1)}

    def stem(run, x):
        return enc.maxpool(_stem(run, enc, x))

    def top(run, d2, x):
        d = _decoder_block(run, 1, blocks[3], d2, _stem(run, enc, x))
        return head(_decoder_block(run, 3, blocks[4], d, None))

    return {
        "stem": Region("stem", (4,), norms[:1], 0, [enc.conv1, enc.bn1], stem_paths(), stem),
        "top": Region("top", (1, 4), norms, 1, [enc.conv1, enc.bn1, blocks[3], blocks[4], head],
                      top_paths(2), top),
    }


# -- the forward ------------------------------------------------------------------------------
class TiledForward:
    """Replaces `ContrastUNet.forward_padded` on an instance: same function, tiled top levels."""

    def __init__(self, unet: nn.Module, levels: int = 2, tiles: int = 0, rows: int = 0):
        check_levels(levels, "tile:levels")
        check_model(unet)
        self.unet, self.levels, self.tiles, self.rows = unet, levels, tiles, rows
        self.regions = regions(unet, levels)
        self.halos = halos(levels)

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
        enc, dec = self.unet.encoder, self.unet.decoder
        shared = ()
        if self.levels >= 2:
            pooled, shared = run_region(self.regions["stem"], tiles["stem"], [x])
            f1 = None
        else:
            f1 = enc.relu(enc.bn1(enc.conv1(x)))
            pooled = enc.maxpool(f1)
        l1 = enc.layer1(pooled)
        l2 = enc.layer2(l1)
        l3 = enc.layer3(l2)
        l4 = enc.layer4(l3)
        d = dec.center(l4)
        skips = [l3, l2, l1, f1]
        for i in range(5 - self.levels):  # the untiled decoder blocks, through their forward
            d = dec.blocks[i](d, *skips[i].shape[-2:], skip_connection=skips[i])
        inputs = [d] if self.levels == 1 else [d, x]
        out, _ = run_region(self.regions["top"], tiles["top"], inputs, shared[:1])
        return out
