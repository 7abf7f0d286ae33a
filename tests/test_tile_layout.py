"""Layouts inside the tiled step (memstudy/tiling): on a channels_last model every tensor a
convolution or its backward reads keeps channels_last strides, so cuDNN converts nothing.

cuDNN decides the layout of a convolution's backward from its input's strides (a grad_output
that differs is converted, in every tile). Two ways the tiled step lost them, both found in H100
profiles: the backward's views of its leaf strips recomputed the batch stride of a batch-1
strip (view_as), and the one-channel image's strips kept NCHW strides, which for one channel
are the same bytes. The tests record the strides each convolution's backward sees on the CPU
(the strides, not the kernels, are what matter) and fail on either."""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from memstudy.models import build_unet
from memstudy.tiling.tiled_forward import TiledForward, layout_of_weight


def reads_channels_last(t: torch.Tensor) -> bool:
    """The stride order PyTorch needs to suggest channels_last (c10's
    is_channels_last_strides_2d): C fastest, then W, then H, then the batch."""
    n, c, h, w = t.shape
    s = t.stride()
    return s[1] == 1 and s[3] >= c * s[1] and s[2] >= w * s[3] and s[0] >= h * s[2]


class ConvInputs(TorchDispatchMode):
    """The 4-D tensors every convolution_backward reads: (grad_output, input)."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ == "convolution_backward":
            self.seen.append((args[0], args[1]))
        return func(*args, **(kwargs or {}))


def _conv_backward_inputs(tiling: dict) -> list[tuple[torch.Tensor, torch.Tensor]]:
    model = build_unet(seed=0).train().to(memory_format=torch.channels_last)
    model.forward_padded = TiledForward(model, **tiling)
    x = torch.rand(1, 1, 128, 128, generator=torch.Generator().manual_seed(0))
    model(x).square().mean().backward(inputs=list(model.parameters()))  # warm, then record
    record = ConvInputs()
    with record:
        model(x).square().mean().backward()
    return record.seen


def test_every_convolution_backward_reads_channels_last_strides():
    seen = _conv_backward_inputs(dict(levels=2, tiles=4, keep="all"))
    assert len(seen) > 20
    for grad, inp in seen:
        for t in (grad, inp):
            if t.shape[1] > 1:
                assert reads_channels_last(t), (tuple(t.shape), t.stride())
    stem = [inp for _grad, inp in seen if inp.shape[1] == 1]
    assert stem and all(inp.stride(1) == 1 for inp in stem)  # the image, viewed channels_last


def test_layout_of_weight_changes_only_the_strides_of_one_channel():
    weight = build_unet(seed=0).to(memory_format=torch.channels_last).encoder.conv1.weight
    x = torch.rand(1, 1, 40, 24)[..., 4:20, :]
    viewed = layout_of_weight(x, weight)
    assert torch.equal(viewed, x) and viewed.data_ptr() == x.data_ptr()
    assert reads_channels_last(viewed) and not reads_channels_last(x)
    nchw = build_unet(seed=0).encoder.conv1.weight
    assert layout_of_weight(x, nchw) is x  # an NCHW model: untouched
    three = torch.rand(1, 3, 16, 24)
    assert layout_of_weight(three, weight) is three
