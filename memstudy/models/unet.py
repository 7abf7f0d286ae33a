"""The study's network family: segmentation-models-pytorch U-Nets with ResNet-family encoders.

The network is configuration (`[model]`, memstudy/network.py): the encoder (ResNet-18 .. 152,
ResNeXt; ResNet-34 the study's default), the decoder's channels and the output classes. One
grey input channel. Enhancement squashes its one output channel to [0, 1] with a sigmoid;
segmentation returns per-pixel class logits (its loss applies the sigmoid / softmax itself, in
chunks). ImageNet weights come only from a local file (nothing is downloaded); the first
convolution's three RGB filters are summed into one grey filter, as the source study did.

The model holds no technique code. It names its parts so techniques can act per block:
`encoder_stages` (stem, layer1..layer4), `residual_stages` (layer1..layer4, each a
Sequential of torchvision BasicBlocks or Bottlenecks) and `decoder_blocks`; `encoder_spec`
says which encoder it is (memstudy.network.Encoder) without looking at the modules.

The decoder's nearest up-sampling runs in its input's dtype (`DecoderBlock`): CUDA autocast
lists `upsample_nearest2d` among the ops it runs in float32, so under `amp` smp's block would
write its up-sampled input and the concatenation with the skip in float32 (for ResNet-34 at
4188 px decoder block 2's is 843 MB instead of 422 MB, plus a cast copy for the convolution,
and their float32 gradients). Nearest up-sampling copies values, so the output is the same.

Any image size: the U-Net's five down-samplings need sides that are multiples of 32, so
`forward` reflect-pads the bottom and right edges up to the next multiple (`padding_for`),
runs `forward_padded`, and crops the output back; losses and metrics see real pixels only.
A technique that changes how the network itself runs (spatial tiling) replaces
`forward_padded`, never the padding.
"""
from __future__ import annotations

import contextlib
import inspect
from pathlib import Path

import segmentation_models_pytorch as smp
from segmentation_models_pytorch.decoders.unet.decoder import UnetDecoderBlock
import torch
import torch.nn.functional as F
from torch import nn

from memstudy.errors import ConfigError, MemstudyError
from memstudy.network import ENCODERS, STRIDE, Encoder, ModelConfig

ENHANCE = "enhance"  # the study's task (train.task): a sigmoid image; others return logits


def padding_for(height: int, width: int) -> tuple[int, int]:
    """Rows and columns added at the bottom and right to reach multiples of STRIDE."""
    return -height % STRIDE, -width % STRIDE


def pad_to_stride(x: torch.Tensor) -> torch.Tensor:
    rows, cols = padding_for(*x.shape[-2:])
    if not rows and not cols:
        return x
    # reflect (not zeros): the padded border looks like image, not like a dark frame
    return F.pad(x, (0, cols, 0, rows), mode="reflect")


def upsampled_elements(batch: int, height: int, width: int, folded_levels: int = 0,
                       network: ModelConfig | None = None) -> int:
    """Elements of the largest nearest up-sampling output of the decoder for a (height, width)
    image, the top `folded_levels` decoder blocks left out (tile folds their up-sampling into
    a transposed convolution). Decoder block k doubles its input, whose channels are the
    block before's output (the encoder's deepest features for k = 0), to 1/2^(4-k) of the
    padded image: the last block's is decoder_channels[-2] x the whole padded image."""
    network = network or ModelConfig()
    rows, cols = (side + pad for side, pad in zip((height, width), padding_for(height, width)))
    decoder = tuple(network.decoder_channels)
    inputs = (ENCODERS[network.encoder].out_channels[-1], *decoder[:-1])
    blocks = len(decoder)
    return max((batch * inputs[k] * (rows >> (blocks - 1 - k)) * (cols >> (blocks - 1 - k))
                for k in range(blocks - folded_levels)), default=0)


class DecoderBlock(UnetDecoderBlock):
    """smp's U-Net decoder block with its nearest up-sampling outside autocast: in the input's
    dtype, which is what the convolution after it would cast back to. The same values (nearest
    copies them; the block's convolution sees the same bits), half the bytes under bf16 / fp16
    autocast. tests/test_models.py compares it with smp's block.

    `fold_upsampling` (False unless a technique sets it): the up-sampling, concatenation and
    first convolution run as one folded op (`up_conv`), which never writes the up-sampled or
    concatenated tensors (at 16384 px, decoder block 1's concatenation alone is 3 GiB in bf16).
    Exact to float rounding, not bitwise: the folded kernel adds weights before multiplying."""
    fold_upsampling = False

    def forward(self, feature_map: torch.Tensor, target_height: int, target_width: int,
                skip_connection: torch.Tensor | None = None) -> torch.Tensor:
        if self.fold_upsampling and isinstance(self.attention1.attention, nn.Identity) and (
                target_height, target_width) == tuple(2 * n for n in feature_map.shape[-2:]):
            conv, *rest = self.conv1  # smp's Conv2dReLU: convolution, BatchNorm, ReLU
            t = up_conv(conv, feature_map, skip_connection)
            for module in rest:
                t = module(t)
            return self.attention2(self.conv2(t))
        kind = feature_map.device.type  # "meta" (FLOP counting) has no autocast to leave
        outside = (torch.autocast(kind, enabled=False) if torch.amp.is_autocast_available(kind)
                   else contextlib.nullcontext())
        with outside:
            feature_map = F.interpolate(feature_map, size=(target_height, target_width),
                                        mode=self.interpolation_mode)
        if skip_connection is not None:
            feature_map = torch.cat([feature_map, skip_connection], dim=1)
            feature_map = self.attention1(feature_map)
        feature_map = self.conv1(feature_map)
        feature_map = self.conv2(feature_map)
        return self.attention2(feature_map)


def up_conv(conv: nn.Conv2d, d: torch.Tensor, skip: torch.Tensor | None) -> torch.Tensor:
    """conv(cat(up(d), skip)) without up(d): the convolution's weights over d's channels
    folded into a stride-2 transposed convolution of d (`up_conv_weight`), plus the
    convolution of the skip. Exact (each output sums the same products, with the weights of
    taps that read the same pixel of d added first); the up-sampled and concatenated
    tensors are never written, and the up-sampled part costs 4 / 9 of the multiply-adds."""
    n = d.shape[1]
    out = F.conv_transpose2d(d, up_conv_weight(conv.weight[:, :n], d), conv.bias, stride=2,
                             padding=1)
    return out if skip is None else out + F.conv2d(skip, conv.weight[:, n:], padding=1)


# Nearest up-sampling by 2, then a 3 x 3 convolution (padding 1): output row 2i + a reads
# up-sampled rows 2i + a - 1 .. 2i + a + 1, which are rows i - 1, i, i (a = 0) or i, i, i + 1
# (a = 1) of the input. A transposed convolution of stride 2, kernel 4 and padding 1 writes input
# row i into output rows 2i - 1 + k, k = 0..3, so tap k of the folded kernel holds the 3 x 3 taps
# that read row i from output row 2i - 1 + k: k = 0 -> tap 2, 1 -> taps 1 + 2, 2 -> taps 0 + 1,
# 3 -> tap 0. Zero padding agrees: up-sampled row -1 is input row -1.
def _fold(w: torch.Tensor, dim: int) -> torch.Tensor:
    """Taps (0, 1, 2) of `dim` -> (2, 1 + 2, 0 + 1, 0): the four taps of the transposed kernel."""
    t0, t1, t2 = w.unbind(dim)
    return torch.stack([t2, t1 + t2, t0 + t1, t0], dim)


def up_conv_weight(weight: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The (in, out, 4, 4) transposed-convolution kernel equal to nearest up-sampling by 2 and
    the 3 x 3 convolution `weight` (out, in, 3, 3), in `like`'s memory format, in the weight's
    precision (additions and copies only: no constant to copy to the device, which would
    synchronise with the host and break CUDA-graph capture)."""
    folded = _fold(_fold(weight, 2), 3).transpose(0, 1)
    return folded.contiguous(memory_format=memory_format_of(like))


def memory_format_of(t: torch.Tensor) -> torch.memory_format:
    """channels_last for a dense NHWC tensor, else the contiguous format."""
    nhwc = t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous()
    return torch.channels_last if nhwc else torch.contiguous_format


# smp's block as DecoderBlock was written against (segmentation-models-pytorch 0.6)
SMP_BLOCK_FORWARD = ("self", "feature_map", "target_height", "target_width", "skip_connection")


def check_smp_decoder_block(blocks: nn.ModuleList) -> None:
    """smp built the decoder blocks DecoderBlock replaces: UnetDecoderBlock, whose forward
    takes the same arguments (an older smp's took (x, skip))."""
    for block in blocks:
        kind = type(block)
        arguments = tuple(inspect.signature(kind.forward).parameters)
        if kind is not UnetDecoderBlock or arguments != SMP_BLOCK_FORWARD:
            raise MemstudyError(
                f"segmentation-models-pytorch {smp.__version__}'s U-Net decoder block is "
                f"{kind.__name__}{arguments}, not the UnetDecoderBlock{SMP_BLOCK_FORWARD} "
                "memstudy.models.unet.DecoderBlock replaces; install "
                "segmentation-models-pytorch 0.6")


class UNet(nn.Module):
    def __init__(self, network: ModelConfig | None = None, task: str = ENHANCE) -> None:
        super().__init__()
        network = network or ModelConfig()
        self.encoder_name = network.encoder
        self.net = smp.Unet(network.encoder, encoder_weights=None,
                            in_channels=network.in_channels, classes=network.classes,
                            activation="sigmoid" if task == ENHANCE else None,
                            decoder_channels=tuple(network.decoder_channels))
        check_smp_decoder_block(self.net.decoder.blocks)
        for block in self.net.decoder.blocks:
            block.__class__ = DecoderBlock  # same parameters and state; forward as above

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        height, width = x.shape[-2:]
        out = self.forward_padded(pad_to_stride(x))
        return out[..., :height, :width]

    def forward_padded(self, x: torch.Tensor) -> torch.Tensor:
        """The network on an input whose sides are multiples of STRIDE."""
        return self.net(x)

    @property
    def encoder_spec(self) -> Encoder:
        """What the encoder is built of (block kind, blocks per stage, groups)."""
        return ENCODERS[self.encoder_name]

    @property
    def encoder(self) -> nn.Module:
        return self.net.encoder

    @property
    def decoder(self) -> nn.Module:
        return self.net.decoder

    @property
    def head(self) -> nn.Module:
        return self.net.segmentation_head

    @property
    def residual_stage_names(self) -> list[str]:
        return ["layer1", "layer2", "layer3", "layer4"]

    @property
    def residual_stages(self) -> list[nn.Sequential]:
        return [getattr(self.encoder, n) for n in self.residual_stage_names]

    @property
    def encoder_stages(self) -> list[nn.Module]:
        e = self.encoder
        return [nn.ModuleList([e.conv1, e.bn1, e.relu]), e.maxpool, *self.residual_stages]

    @property
    def decoder_blocks(self) -> list[nn.Module]:
        return list(self.decoder.blocks)


def build_unet(encoder_weights: str | None = None, seed: int = 0,
               network: ModelConfig | None = None, task: str = ENHANCE) -> UNet:
    """Fresh model, initialised from `seed` (so every technique starts from the same weights)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = UNet(network, task)
    if encoder_weights:
        load_encoder_weights(model, encoder_weights)
    return model


def load_encoder_weights(model: UNet, path: str | Path) -> None:
    """Load a torchvision-style state_dict of the model's encoder, RGB first conv summed to
    grey."""
    path = Path(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the same user error
        raise ConfigError(f"encoder_weights {str(path)!r} is not a readable torch state_dict: "
                          f"{exc}") from None
    state = {k: v for k, v in state.items() if not k.startswith("fc.")}
    conv1 = state.get("conv1.weight")
    if conv1 is None or conv1.ndim != 4:
        raise ConfigError(f"encoder_weights {str(path)!r} has no ResNet conv1.weight")
    if conv1.shape[1] == 3:
        state["conv1.weight"] = conv1.sum(dim=1, keepdim=True)
    missing, unexpected = model.encoder.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ConfigError(f"encoder_weights {str(path)!r} does not match {model.encoder_name}: "
                          f"missing "
                          f"{missing[:3]}..., unexpected {unexpected[:3]}...")
