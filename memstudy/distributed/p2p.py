"""Point-to-point transfers between the two halves of a split U-Net, with autograd.

Rank 0 (encoder) sends the skip features forward and receives their gradients in
backward; rank 1 (decoder) receives the features as outputs of an autograd function whose
backward sends the gradients back. A small header (count, dtype, shape) precedes the
tensors, so autocast's dtypes and any image size need no agreement in advance.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
MAX_TENSORS, MAX_DIMS = 8, 4
HEADER = 1 + MAX_TENSORS * (2 + MAX_DIMS)


def send_tensors(tensors: list[torch.Tensor], peer: int) -> None:
    if len(tensors) > MAX_TENSORS:
        raise ValueError(f"send_tensors: at most {MAX_TENSORS} tensors (got {len(tensors)})")
    header = torch.zeros(HEADER, dtype=torch.int64)
    header[0] = len(tensors)
    for i, t in enumerate(tensors):
        row = [DTYPES.index(t.dtype), t.dim(), *t.shape]
        header[1 + i * (2 + MAX_DIMS):1 + i * (2 + MAX_DIMS) + len(row)] = torch.tensor(row)
    device = tensors[0].device
    dist.send(header.to(device), peer)
    for t in tensors:
        dist.send(t.detach().contiguous(), peer)


def recv_tensors(peer: int, device: torch.device) -> list[torch.Tensor]:
    header = torch.empty(HEADER, dtype=torch.int64, device=device)
    dist.recv(header, peer)
    h = header.tolist()
    out = []
    for i in range(h[0]):
        base = 1 + i * (2 + MAX_DIMS)
        dtype, ndim = DTYPES[h[base]], h[base + 1]
        t = torch.empty(h[base + 2:base + 2 + ndim], dtype=dtype, device=device)
        dist.recv(t, peer)
        out.append(t)
    return out


def send_value(value: torch.Tensor, peer: int) -> None:
    dist.send(value.detach().float().reshape(1).contiguous(), peer)


def recv_value(peer: int, device: torch.device) -> torch.Tensor:
    t = torch.empty(1, dtype=torch.float32, device=device)
    dist.recv(t, peer)
    return t[0]


class SendActivations(torch.autograd.Function):
    """Encoder side: forward sends the features, backward receives their gradients.

    Returns a zero scalar (the "token") that the local loss hangs on, so that calling
    backward on this rank runs the encoder's backward once the gradients arrive."""

    @staticmethod
    def forward(ctx, peer: int, *features: torch.Tensor) -> torch.Tensor:
        send_tensors(list(features), peer)
        ctx.peer, ctx.device = peer, features[0].device
        return features[0].new_zeros((), dtype=torch.float32)

    @staticmethod
    def backward(ctx, _token_grad: torch.Tensor):
        return (None, *recv_tensors(ctx.peer, ctx.device))


class RecvActivations(torch.autograd.Function):
    """Decoder side: forward receives the features, backward sends their gradients.

    `anchor` is a scalar that requires grad: it makes autograd call this backward."""

    @staticmethod
    def forward(ctx, peer: int, device: torch.device, anchor: torch.Tensor):
        ctx.peer = peer
        return tuple(recv_tensors(peer, device))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        send_tensors([g.contiguous() for g in grads], ctx.peer)
        return None, None, None


def synchronise_overflow(scaler) -> None:
    """Make a GradScaler skip a step on every rank when any rank's gradients overflowed.

    Each rank's scaler checks only its own half of the gradients; without this, one half
    would step and the other not, and the two loss scales would drift apart. The wrapped
    `unscale_` all-reduces the found-inf flags (GradScaler.step calls unscale_ first)."""
    if getattr(scaler, "_memstudy_synced", False) or not scaler.is_enabled():
        return
    original = scaler.unscale_

    def unscale_(optimizer) -> None:
        original(optimizer)
        state = scaler._per_optimizer_states[id(optimizer)]
        for found in state["found_inf_per_device"].values():
            dist.all_reduce(found, op=dist.ReduceOp.MAX)

    scaler.unscale_ = unscale_
    scaler._memstudy_synced = True
