"""The study's model-parallel split of the U-Net: encoder on one device, decoder + head on another.

`LocalSplitUNet` keeps both halves in one process on two GPUs and moves the skip features
with `.to()` (autograd moves their gradients back). `EncoderHalf` / `DecoderHalf` are the
halves as modules of their own (pipeline stages take them as they are), and `P2PHalf` runs
one half per process, exchanging features and gradients with torch.distributed send/recv.

Every module here exposes the block protocol of UNet (`residual_stages`,
`encoder_stages`, `decoder_blocks`, ...) for the blocks it holds, so activation techniques
(checkpointing) still find the blocks after the split.

Sizes that are not multiples of 32: `LocalSplitUNet` pads and crops exactly as
`UNet.forward` does (reflect, bottom / right). The process split cannot: the decoder's
process never sees the input, so it cannot know how much of its output is padding;
`check_split_size` refuses such sizes by name before anything is built.
"""
from __future__ import annotations

import torch
from torch import nn

from memstudy.distributed import p2p
from memstudy.errors import ConfigError
from memstudy.models.unet import STRIDE, pad_to_stride
from memstudy.image_sizes import size_hw


def check_split_size(plan, owner: str, alternative: str = "") -> None:
    """Refuse a size the process split cannot crop back (see the module docstring);
    `alternative` is the owner's own way around it, told in the message."""
    size = plan.config.train.image_size
    hw = size_hw(size)
    if hw is None or hw[0] % STRIDE or hw[1] % STRIDE:
        raise ConfigError(f"{owner} splits the network across two processes, and the decoder's "
                          f"process cannot crop the padding that a train.image_size of {size!r} "
                          f"needs: use a train.image_size whose sides are multiples of {STRIDE}"
                          + (f", or {alternative}" if alternative else ""))


class _Protocol:
    """Block protocol over whichever parts (`encoder`, `decoder`, `head`) the module holds."""

    @property
    def residual_stage_names(self) -> list[str]:
        return ["layer1", "layer2", "layer3", "layer4"] if self._has("encoder") else []

    @property
    def residual_stages(self) -> list[nn.Module]:
        return [getattr(self.encoder, n) for n in self.residual_stage_names]

    @property
    def encoder_stages(self) -> list[nn.Module]:
        if not self._has("encoder"):
            return []
        e = self.encoder
        return [nn.ModuleList([e.conv1, e.bn1, e.relu]), e.maxpool, *self.residual_stages]

    @property
    def decoder_blocks(self) -> list[nn.Module]:
        return list(self.decoder.blocks) if self._has("decoder") else []

    def _has(self, part: str) -> bool:
        return part in self._modules


class EncoderHalf(_Protocol, nn.Module):
    """x -> the skip features (stem, layer1..layer4); the input itself is not sent."""

    def __init__(self, unet: nn.Module):
        super().__init__()
        self.encoder = unet.encoder

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(self.encoder(x)[1:])


class DecoderHalf(_Protocol, nn.Module):
    """skip features -> enhanced image. The decoder reads the input only for its shape, so a
    zero-stride placeholder of that shape stands in for it (no memory, nothing sent)."""

    def __init__(self, unet: nn.Module):
        super().__init__()
        self.decoder, self.head = unet.decoder, unet.head

    def forward(self, *features: torch.Tensor) -> torch.Tensor:
        stem = features[0]  # stride 2: the input is twice its size
        b, _, h, w = stem.shape
        placeholder = stem.new_zeros(()).expand(b, 1, 2 * h, 2 * w)
        return self.head(self.decoder([placeholder, *features]))


class LocalSplitUNet(_Protocol, nn.Module):
    """One process, two GPUs: encoder on `first`, decoder and head on `second`."""

    def __init__(self, unet: nn.Module, first: torch.device, second: torch.device):
        super().__init__()
        self.encoder, self.decoder, self.head = unet.encoder, unet.decoder, unet.head
        self.first, self.second = first, second
        self.encoder.to(first)
        self.decoder.to(second)
        self.head.to(second)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        height, width = x.shape[-2:]
        features = self.encoder(pad_to_stride(x.to(self.first)))  # as UNet.forward
        # the skip connections cross devices; .to() is differentiable, so their gradients
        # travel back to the encoder's GPU in backward
        features = [f.to(self.second, non_blocking=True) for f in features]
        return self.head(self.decoder(features))[..., :height, :width]


class P2PHalf(_Protocol, nn.Module):
    """One half per process. Training: rank 0 returns a token scalar for its loss, rank 1 the
    image; evaluation: rank 1 also sends the image back, so both ranks validate it."""

    def __init__(self, half: nn.Module, rank: int, peer: int):
        super().__init__()
        self.part, self.rank, self.peer = half, rank, peer
        for part in ("encoder", "decoder", "head"):
            if hasattr(half, part):
                self.add_module(part, getattr(half, part))  # same objects: protocol access

    def _device(self) -> torch.device:
        return next(self.part.parameters()).device

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rank == 0:
            features = self.part(x)
            if torch.is_grad_enabled():
                return p2p.SendActivations.apply(self.peer, *features)
            p2p.send_tensors(list(features), self.peer)
            return p2p.recv_tensors(self.peer, self._device())[0]
        device = self._device()
        if torch.is_grad_enabled():
            anchor = torch.zeros((), device=device, requires_grad=True)
            features = p2p.RecvActivations.apply(self.peer, device, anchor)
        else:
            features = p2p.recv_tensors(self.peer, device)
        out = self.part(*features)
        if not torch.is_grad_enabled():
            p2p.send_tensors([out], self.peer)
        return out
