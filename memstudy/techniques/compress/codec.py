"""The compressed form of a saved tensor: codes + per-group minimum and step, and back.

`Compressor.pack` quantises what autograd saves (stochastic rounding, so the restored value is
unbiased; one quantisation step of error at most) and `unpack` restores a tensor of the same
dtype, shape and strides. Memory: `bits` plus 64 bits of statistics per group instead of 16 or
32 bits per element; compute: one memory-bound pass each way. Channels-last tensors are grouped
channel-major (pixels of one channel), whose ranges are narrow, at the price of 2-D kernels.
"""
from __future__ import annotations

import contextlib
import copy
import random
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch

import memstudy.techniques.compress.quantize as qk
from memstudy.runtime import BOUNDARY, is_boundary

SIGN_MASK = "_memstudy_sign_mask"  # on a ReLU mask: the storage of the output it stands for
POOL_OFFSETS = "_memstudy_pool_offsets"  # on max-pool offsets: bytes of the indices they replace


class Quantized:
    """A saved tensor as codes + per-group statistics, and what is needed to restore it.

    channels: 0 when the groups are runs of `group` elements in memory order (qk.quantize);
    C when they are channel-major, `group` pixels of one channel of a channels-last tensor
    whose memory is a [P, C] matrix (qk.quantize_channels)."""

    def __init__(self, codes, lo, scale, shape, stride, dtype, bits, group, channels=0):
        self.codes, self.lo, self.scale = codes, lo, scale
        self.shape, self.stride, self.dtype = shape, stride, dtype
        self.bits, self.group, self.channels = bits, group, channels

    @property
    def numel(self) -> int:
        return int(torch.Size(self.shape).numel())

    @property
    def nbytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in self.tensors())

    def tensors(self) -> list[torch.Tensor]:
        return [self.codes, self.lo, self.scale]

    def map_tensors(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "Quantized":
        moved = copy.copy(self)  # keeps the boundary mark
        moved.codes, moved.lo, moved.scale = fn(self.codes), fn(self.lo), fn(self.scale)
        return moved


@dataclass
class SavedStorage:
    """One storage saved for backward: as it is, compressed, or through a ReLU mask.

    Counted like the harness's saved-tensor observer counts: a storage saved as it is counts
    while it is alive (the loss frees the graph of branches it does not use); one that was
    compressed or replaced by a mask counts for the forward (its original is meant to die)."""
    storage: weakref.ref
    nbytes: int
    plain: bool = False  # saved as it is (not compressible, or the loss)
    compressed: int = 0  # bytes of its compressed forms
    replaced: bool = False  # a ReLU output whose sign mask was saved instead
    mask: bool = False  # this storage is a sign mask (it does not exist without compress)
    stands_for: int = 0  # a mask or offsets saved instead of this many bytes (freed at once)
    kept: str = ""  # why it was saved as it is: loss, small, not a boundary, or its dtype
    bits: int = 0  # of its compressed form

    @property
    def kind(self) -> str:
        """Its line in the breakdown (`Compressor.tally_by_kind`)."""
        if self.mask:
            return "max-pool offsets" if self.stands_for else "relu masks"
        if self.compressed:
            return f"quantized {self.bits} bits"
        if self.replaced:  # an output only its ReLU mask stands for
            return "relu masks"
        return f"kept: {self.kept}"

    @property
    def before(self) -> int:
        if self.mask:
            return self.stands_for
        return self.nbytes if self.compressed or self.replaced or self._alive() else 0

    @property
    def after(self) -> int:
        return (self.nbytes if self.plain and self._alive() else 0) + self.compressed + (
            self.nbytes if self.mask else 0)

    def _alive(self) -> bool:
        return self.storage() is not None


def _dense_stride(t: torch.Tensor) -> tuple[int, ...] | None:
    """t's strides if its elements fill one run of memory (contiguous or channels-last)."""
    if t.is_contiguous() or (t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last)):
        return t.stride()
    return None


def _channel_major(t: torch.Tensor) -> int:
    """C if t is a channels-last 4-D tensor that is not also contiguous (its memory a [P, C]
    matrix, quantised in channel-major groups), else 0 (memory-order groups)."""
    if t.dim() == 4 and not t.is_contiguous() and t.is_contiguous(
            memory_format=torch.channels_last):
        return t.shape[1]
    return 0


def _flat(t: torch.Tensor) -> torch.Tensor:
    """The elements of a dense tensor in memory order, as a 1-D view."""
    return t.as_strided((t.numel(),), (1,), t.storage_offset())


# -- the pack / unpack pair ------------------------------------------------------------------
class Compressor:
    def __init__(self, bits: int = 4, group: int = 256, min_numel: int = 16384,
                 boundaries_only: bool = False, use_triton: bool = False, seed: int = 0,
                 boundary_bits: int | None = None, channel_groups: bool = True):
        self.bits, self.group, self.min_numel = bits, group, min_numel
        self.channel_groups = channel_groups  # channels-last tensors: per-channel groups
        # checkpoint region inputs: backward recomputes the region from them (None: bits)
        self.boundary_bits = bits if boundary_bits is None else boundary_bits
        self.boundaries_only, self.use_triton = boundaries_only, use_triton
        self.active = True
        self._seeds = random.Random(seed)  # one kernel seed per compressed tensor
        self._generators: dict[torch.device, torch.Generator] = {}  # impl=torch noise
        self._seed = seed
        # id(tensor) -> (weak ref to it, its version, its Quantized or None): one pack per tensor
        self._packed: dict[int, tuple[weakref.ref, int, Quantized | None]] = {}
        self.reset_tally()

    # -- accounting of one forward: the bytes saved without compression and with it ---------
    def reset_tally(self) -> None:
        # storage address -> SavedStorage; a storage freed during the forward (compressed, then
        # dropped) can hand its address to a new one, so entries are checked by weak reference
        self._tally: dict[tuple[str, int], SavedStorage] = {}
        # kind -> [before, after] of entries whose storage was freed
        self._closed: dict[str, list[int]] = {}

    def tally(self) -> tuple[int, int]:
        """(saved bytes without compression, saved bytes with it) of the current forward."""
        kinds = self.tally_by_kind().values()
        return sum(b for b, _ in kinds), sum(a for _, a in kinds)

    def tally_by_kind(self) -> dict[str, tuple[int, int]]:
        """tally() by what the bytes are: quantized (per width), relu masks, max-pool offsets, and
        `kept: <why>` (loss, small, not a boundary, or a dtype that is not quantised)."""
        kinds = {kind: list(sums) for kind, sums in self._closed.items()}
        for entry in self._tally.values():
            sums = kinds.setdefault(entry.kind, [0, 0])
            sums[0] += entry.before
            sums[1] += entry.after
        return {kind: (b, a) for kind, (b, a) in kinds.items() if b or a}

    def _entry(self, storage: torch.UntypedStorage) -> "SavedStorage":
        key = (str(storage.device), storage.data_ptr())
        entry = self._tally.get(key)
        if entry is not None and entry.storage() is not storage:  # the address was reused
            closed = self._closed.setdefault(entry.kind, [0, 0])
            closed[0] += entry.before  # (evaluated now its storage is gone)
            closed[1] += entry.after
            entry = None
        if entry is None:
            entry = self._tally[key] = SavedStorage(weakref.ref(storage), storage.nbytes())
        return entry

    def _count_plain(self, t: torch.Tensor, why: str) -> None:
        entry = self._entry(t.untyped_storage())
        entry.plain = True
        entry.kept = entry.kept or why

    @contextlib.contextmanager
    def paused(self):
        active, self.active = self.active, False
        try:
            yield
        finally:
            self.active = active

    def pack(self, t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or _is_parameter(t):
            return t
        if not self.active:  # the loss: saved as it is, and counted as such
            self._count_plain(t, "loss")
            return t
        stands_for = getattr(t, POOL_OFFSETS, None)
        if stands_for is not None:  # max-pool window offsets, saved instead of int64 indices
            entry = self._entry(t.untyped_storage())
            entry.mask, entry.stands_for = True, stands_for
            return t
        replaced = getattr(t, SIGN_MASK, None)
        if replaced is not None:  # a ReLU mask, saved instead of the output
            output = replaced()
            if output is not None:
                self._entry(output).replaced = True  # saved before compression, by ReLU
            self._entry(t.untyped_storage()).mask = True
            return t
        known = self._packed.get(id(t))
        if known is not None and known[0]() is t and known[1] == t._version:
            return t if known[2] is None else known[2]
        why_kept = self._kept_because(t)
        if why_kept:
            self._count_plain(t, why_kept)
            packed = t
        else:
            packed = self.quantize(t)
            if is_boundary(t):
                setattr(packed, BOUNDARY, True)  # offload which=boundaries moves it too
            entry = self._entry(t.untyped_storage())
            entry.compressed, entry.bits = entry.compressed + packed.nbytes, packed.bits
        key = id(t)
        # None for "kept as it is": holding t itself here would keep it alive for good
        self._packed[key] = (weakref.ref(t, lambda _r, k=key: self._packed.pop(k, None)),
                             t._version, None if packed is t else packed)
        return packed

    def _kept_because(self, t: torch.Tensor) -> str:
        """Why t is saved as it is ("" if it is quantised)."""
        if t.dtype not in qk.FLOAT_DTYPES:
            return str(t.dtype).replace("torch.", "")
        if t.numel() < self.min_numel:
            return "small"
        return "not a boundary" if self.boundaries_only and not is_boundary(t) else ""

    def unpack(self, packed: Any) -> Any:
        return self.dequantize(packed) if isinstance(packed, Quantized) else packed

    def quantize(self, t: torch.Tensor) -> Quantized:
        stride = _dense_stride(t)
        if stride is None:
            t = t.contiguous()
            stride = t.stride()
        flat = _flat(t).detach()
        bits = self.boundary_bits if is_boundary(t) else self.bits
        channels = _channel_major(t) if self.channel_groups else 0
        if self.use_triton:
            seed = self._seeds.getrandbits(31)
            parts = (qk.quantize_channels(flat, channels, bits, self.group, seed) if channels
                     else qk.quantize(flat, bits, self.group, seed))
        else:
            noise = torch.rand(flat.numel(), device=flat.device, generator=self._generator(flat.device))
            parts = (qk.quantize_channels_reference(flat, channels, bits, self.group, noise)
                     if channels else qk.quantize_reference(flat, bits, self.group, noise))
        return Quantized(*parts, tuple(t.shape), stride, t.dtype, bits, self.group, channels)

    def dequantize(self, q: Quantized) -> torch.Tensor:
        out = torch.empty_strided(q.shape, q.stride, dtype=q.dtype, device=q.codes.device)
        flat = _flat(out)
        if q.channels:  # channel-major groups, restored in place into the channels-last memory
            if self.use_triton:
                qk.dequantize_channels(q.codes, q.lo, q.scale, q.numel, q.channels, q.bits,
                                       q.group, q.dtype, out=flat)
            else:
                flat.copy_(qk.dequantize_channels_reference(q.codes, q.lo, q.scale, q.numel,
                                                            q.channels, q.bits, q.group, q.dtype))
        elif self.use_triton:
            qk.dequantize(q.codes, q.lo, q.scale, q.numel, q.bits, q.group, q.dtype, out=flat)
        else:
            flat.copy_(qk.dequantize_reference(q.codes, q.lo, q.scale, q.numel, q.bits, q.group,
                                               q.dtype))
        return out

    def _generator(self, device: torch.device) -> torch.Generator:
        # private: drawing from the global generator would shift the RNG state that checkpoint
        # stashes for its recomputation
        if device not in self._generators:
            self._generators[device] = torch.Generator(device).manual_seed(self._seed)
        return self._generators[device]

    # -- ReLU sign masks ---------------------------------------------------------------------
    def pack_signs(self, out: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        """The sign bits of `dense` (out itself, or its dense copy), marked as standing for out."""
        flat = _flat(dense).detach()
        signs = qk.pack_signs(flat) if self.use_triton else qk.pack_signs_reference(flat)
        setattr(signs, SIGN_MASK, weakref.ref(out.untyped_storage()))
        return signs

    def apply_signs(self, grad: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
        flat = _flat(grad)
        if self.use_triton:
            return qk.apply_signs(flat, signs).as_strided(grad.shape, grad.stride())
        return qk.apply_signs_reference(flat, signs).as_strided(grad.shape, grad.stride())


def _is_parameter(t: torch.Tensor) -> bool:
    """A parameter, or autocast's copy of one (ToCopy straight from AccumulateGrad)."""
    if t.is_leaf:
        return t.requires_grad
    fn = t.grad_fn
    if fn is None or type(fn).__name__ != "ToCopyBackward0":
        return False
    return any(type(nxt).__name__ == "AccumulateGrad" for nxt, _ in fn.next_functions if nxt)
