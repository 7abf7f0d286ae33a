"""The network as configuration: `[model]`, and the ResNet-family encoders memstudy builds.

Torch-free (the config checks use it before torch loads). The study's network is the default:
segmentation-models-pytorch's U-Net with a ResNet-34 encoder, smp's default decoder channels,
one grey input channel and one output channel. `encoder` picks any ResNet-family encoder smp
builds offline; `factory = "package.module:function"` (with `kwargs`) brings a user's own
`nn.Module` instead, which the techniques that need the U-Net's structure refuse
(`Technique.needs_unet`).

`ENCODERS` holds what the walks of the structural techniques need to know about each encoder
without building it: its residual block (torchvision's BasicBlock or Bottleneck), the blocks of
each stage, its 3x3 convolutions' groups and the channels of its deepest features.
tests/test_network.py checks the table against smp's own.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from memstudy.errors import ConfigError


@dataclass(frozen=True)
class Encoder:
    block: str  # "basic" (two 3x3 convolutions) or "bottleneck" (1x1, 3x3, 1x1)
    layers: tuple[int, int, int, int]  # residual blocks of layer1..layer4
    groups: int = 1  # of the 3x3 convolutions (ResNeXt's cardinality)

    @property
    def bottleneck(self) -> bool:
        return self.block == "bottleneck"

    @property
    def out_channels(self) -> tuple[int, ...]:
        """Channels of the input and of each of the five down-sampled features (smp's)."""
        widths = (64, 128, 256, 512)
        expansion = 4 if self.bottleneck else 1
        return (1, 64, *(w * expansion for w in widths))


_BASIC18, _BASIC34, _BOTTLENECK50 = (2, 2, 2, 2), (3, 4, 6, 3), (3, 4, 6, 3)
_BOTTLENECK101, _BOTTLENECK152 = (3, 4, 23, 3), (3, 8, 36, 3)
ENCODERS: dict[str, Encoder] = {
    "resnet18": Encoder("basic", _BASIC18),
    "resnet34": Encoder("basic", _BASIC34),
    "resnet50": Encoder("bottleneck", _BOTTLENECK50),
    "resnet101": Encoder("bottleneck", _BOTTLENECK101),
    "resnet152": Encoder("bottleneck", _BOTTLENECK152),
    "resnext50_32x4d": Encoder("bottleneck", _BOTTLENECK50, groups=32),
    **{f"resnext101_32x{w}d": Encoder("bottleneck", _BOTTLENECK101, groups=32)
       for w in (4, 8, 16, 32, 48)},
}
DEFAULT_ENCODER = "resnet34"  # the study's
DEFAULT_DECODER_CHANNELS = (256, 128, 64, 32, 16)  # smp's default, one per decoder block
STRIDE = 32  # total down-sampling of every ResNet-family encoder: padded sides are multiples
TASK_CLASSES_ENHANCE = 1  # enhancement predicts one grey image


@dataclass
class ModelConfig:
    encoder: str = DEFAULT_ENCODER
    decoder_channels: list[int] = field(default_factory=lambda: list(DEFAULT_DECODER_CHANNELS))
    in_channels: int = 1  # the datasets give one grey channel (radiographs)
    classes: int = 1  # output channels: 1 for enhancement; per-pixel classes for segmentation
    factory: str | None = None  # "package.module:function" returning the user's nn.Module
    kwargs: dict[str, Any] = field(default_factory=dict)  # keyword arguments of the factory

    def check(self, task: str = "enhance") -> None:
        if self.factory is not None:
            self._check_factory()
        elif self.encoder not in ENCODERS:
            raise ConfigError(f"model.encoder = {self.encoder!r} is not a ResNet-family encoder "
                              f"memstudy builds; use one of {sorted(ENCODERS)}, or bring your "
                              "own network with model.factory = 'package.module:function'")
        if len(self.decoder_channels) != len(DEFAULT_DECODER_CHANNELS) \
                or min(self.decoder_channels) < 1:
            raise ConfigError(f"model.decoder_channels = {self.decoder_channels}: the U-Net has "
                              f"{len(DEFAULT_DECODER_CHANNELS)} decoder blocks; give one positive "
                              f"channel count per block, e.g. {list(DEFAULT_DECODER_CHANNELS)}")
        if self.in_channels != 1:
            raise ConfigError(f"model.in_channels = {self.in_channels}: memstudy's datasets give "
                              "radiographs as one grey channel; set model.in_channels = 1")
        if self.classes < 1:
            raise ConfigError(f"model.classes = {self.classes} must be >= 1")
        if task == "enhance" and self.classes != TASK_CLASSES_ENHANCE:
            raise ConfigError(f"model.classes = {self.classes}: enhancement predicts one grey "
                              "image; set model.classes = 1, or train.task = 'segment'")

    def _check_factory(self) -> None:
        module, sep, function = self.factory.partition(":")
        if not sep or not module or not function:
            raise ConfigError(f"model.factory = {self.factory!r}: write it as "
                              "'package.module:function'")
        if self.encoder != DEFAULT_ENCODER or \
                list(self.decoder_channels) != list(DEFAULT_DECODER_CHANNELS):
            raise ConfigError("model.factory builds the whole network, so model.encoder and "
                              "model.decoder_channels do not apply: leave them unset, or drop "
                              "model.factory")
        if self.kwargs and not all(isinstance(k, str) for k in self.kwargs):
            raise ConfigError("model.kwargs must be a table of keyword arguments")

    @property
    def is_default(self) -> bool:
        return self == ModelConfig()

    def describe(self) -> str:
        """A short name for tables: 'resnet34 U-Net' or the factory's function."""
        if self.factory:
            return self.factory
        channels = "" if list(self.decoder_channels) == list(DEFAULT_DECODER_CHANNELS) \
            else f" decoder {'-'.join(map(str, self.decoder_channels))}"
        return f"{self.encoder} U-Net{channels}"


def encoder_of(model: ModelConfig) -> Encoder | None:
    """The encoder's description; None for a user's own network."""
    return None if model.factory else ENCODERS[model.encoder]
