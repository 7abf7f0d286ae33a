"""compress: tensors saved for backward are kept quantised to 8, 4 or 2 bits (ActNN / GACT).

Memory / compute trade-off: the activations autograd keeps between forward and backward shrink
from 32 (or 16) bits per element to `bits` plus 64 bits of per-group statistics per
`group_size` elements (4 bits, groups of 256: 4.25 bits, 7.5x less than float32, 3.8x less
than bfloat16: with amp that is the ceiling); ReLU outputs cost one more bit for their sign
mask, max-pool indices 4 bits instead of 64. The price is two memory-bound passes per saved
tensor (quantise in forward, restore in backward) and gradients that are no longer exact:
backward sees x' = x + e with E[e] = 0 (stochastic rounding) and |e| < one quantisation step,
so the weight gradients of linear ops (convolutions) are unbiased but noisier. BatchNorm's
backward is linear in its saved input given the saved mean / inverse std, which stay exact.

How (a pack / unpack pair in the runtime's chain of saved-tensor transforms, before offload):
- pack: a saved float tensor (float32 / float16 / bfloat16) of at least `min_numel`
  elements is cut into groups of `group_size` and quantised by memstudy/kernels/quantize.py
  (per group min and step in float32, stochastic rounding, codes bit-packed). Groups: runs of
  consecutive elements in memory order for a contiguous tensor; for a channels-last 4-D one
  (memory N, H, W, C: memstudy's default on CUDA) `group_size` consecutive pixels of one
  channel, read in place by 2-D kernels (no transposed copy): in memory order a group would
  span all channels of a few pixels, whose ranges differ, and its step would be coarse
  (256 px CPU run, 4 bits: gradient cosine 0.845 with memory-order groups, 0.990 with
  channel-major ones, 0.991 contiguous). Left alone: parameters and their autocast copies
  (weights are not activations), small tensors, integer tensors. A tensor saved by several
  ops is compressed once.
- unpack: restored into a fresh tensor of the original dtype, shape and strides.
- ReLU (`relu_mask`): a saved-tensor hook cannot know which op saves a tensor, and ReLU's
  backward only needs the sign of its output (grad * (out > 0)); restoring that sign from a
  quantised output would zero the gradient wherever a small positive value rounds down to the
  group minimum 0. So the model's nn.ReLU modules get a forward (patched on the instances;
  modules and state_dict unchanged) that saves a 1-bit sign mask instead of the output: the
  mask is exact, ReLU's backward is exact, and the output is still quantised where the next op
  saves it. Only with `which=all`.
- max-pool (`pool_offsets`): PyTorch's max-pool saves its input and an int64 index per output.
  The nn.MaxPool2d instances get a forward that saves only where each maximum sits in its
  window (4 bits for 3 x 3), from which backward rebuilds the exact indices and runs
  PyTorch's own max-pool backward: bit-identical gradients. Only with `which=all`.
- inside checkpoint regions ReLUs and max-pools stay plain: a mask packed in forward would be
  discarded there, and one packed in the recomputation lives only during that region's own
  backward, so the two extra kernels per ReLU would keep nothing across phases.
- checkpoint region inputs (`boundary_bits`, default 8 with `which=all`): backward recomputes
  each region from its saved input, so that input's error passes through the region's ReLUs
  and BatchNorm and compounds from region to region (192 px step, 4 bits: gradient cosine
  0.52; with 8-bit region inputs 0.96). The recomputation itself is never compressed
  (checkpoint's own saved-tensor hooks replace the runtime's while it runs).
- which: `all`, or `boundaries`: only the tensors checkpoint (or tile) marks as kept between
  regions (`runtime.mark_boundary`): region inputs and skip connections.
- The loss (MS-SSIM: products and quotients of single-channel maps, small next to the
  network's activations) is computed with compression paused: its saved tensors stay exact.
- impl: `triton` kernels on a GPU; `torch` runs the PyTorch references (noise from a private
  torch.Generator instead of Triton's Philox stream); `auto` = triton on CUDA, torch on the CPU
  (so auto is fixed by train.device). triton requested where it cannot run is refused.

Recorded per run (series rows, defined in docs/metrics.md): per step the saved bytes before
and after compression; once, at the last warm-up step (so no measured step pays for it), the
gradient's cosine similarity and relative error against the same step run uncompressed (same
batch, BatchNorm statistics restored): `grad_probe`.

Composes with amp (16-bit activations: half the saving), checkpoint (what is still saved,
region inputs at `boundary_bits`, is compressed; `which=boundaries` compresses only those), offload
(chained after compress: fewer bytes cross PCIe), invertible. Refused with compile (TorchDynamo
traces the pack hook and recompiles it past its limit) and, for grad_probe, with pipeline
(whose schedule replaces the runtime's forward / backward).
"""
from __future__ import annotations

import contextlib
import copy
import functools
import math
import random
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from memstudy.errors import ConfigError
from memstudy.kernels import quantize as qk
from memstudy.runtime import (BOUNDARY, Runtime, StepInfo, in_checkpoint_region, is_boundary,
                             mark_boundary)
from memstudy.techniques import register
from memstudy.techniques.base import Build, Plan, Stage, Technique

WHICH = ("all", "boundaries")
IMPLS = ("auto", "triton", "torch")
GROUPINGS = ("channel", "memory")
BOUNDARY_BITS = 8  # checkpoint region inputs with which=all, unless boundary_bits says otherwise
SIGN_MASK = "_memstudy_sign_mask"  # on a ReLU mask: the storage of the output it stands for
POOL_OFFSETS = "_memstudy_pool_offsets"  # on max-pool offsets: bytes of the indices they replace

__all__ = ["Compressor", "Quantized", "mark_boundary"]


@dataclass
class Options:
    bits: int = field(default=4, metadata={"help": "bits per element: 8, 4 or 2"})
    group_size: int = field(default=256, metadata={
        "help": "elements per quantisation group (own min and step): a power of two, 32..4096"})
    which: str = field(default="all", metadata={
        "choices": WHICH,
        "help": "all: every saved float tensor; boundaries: only what checkpoint / tile keep "
                "between regions"})
    min_numel: int = field(default=16384, metadata={
        "help": "saved tensors with fewer elements stay as they are"})
    impl: str = field(default="auto", metadata={
        "choices": IMPLS,
        "help": "triton kernels, torch references, or auto (triton on CUDA, torch on the CPU)"})
    boundary_bits: int = field(default=0, metadata={
        "help": "bits for checkpoint region inputs, from which backward recomputes each region "
                "(0: 8 with which=all, bits with which=boundaries)"})
    relu_mask: bool = field(default=True, metadata={
        "help": "ReLU saves a 1-bit sign mask instead of its output (which=all only)"})
    pool_offsets: bool = field(default=True, metadata={
        "help": "max-pool saves each maximum's place in its window (4 bits, exact) instead of "
                "its int64 index (which=all only)"})
    groups: str = field(default="channel", metadata={
        "choices": GROUPINGS,
        "help": "channels-last tensors: channel = group_size pixels of one channel per group; "
                "memory = runs in memory order, across channels (the grouping until 2026-11-23)"})
    grad_probe: bool = field(default=True, metadata={
        "help": "re-run the last warm-up step uncompressed and record the gradient deviation"})


# -- the compressed form ---------------------------------------------------------------------
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


class _SignMaskedReLU(torch.autograd.Function):
    """ReLU that saves its output's sign as bits: backward = grad where out > 0."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, inplace: bool, compressor: Compressor) -> torch.Tensor:
        if inplace:
            ctx.mark_dirty(x)
            out = x.relu_()
        else:
            out = x.relu()
        dense = out if _dense_stride(out) is not None else out.contiguous()
        ctx.compressor, ctx.stride = compressor, dense.stride()
        ctx.save_for_backward(compressor.pack_signs(out, dense))
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (signs,) = ctx.saved_tensors
        if grad.stride() != ctx.stride:  # the mask is in the output's memory order
            grad = torch.empty_strided(grad.shape, ctx.stride, dtype=grad.dtype,
                                       device=grad.device).copy_(grad)
        return ctx.compressor.apply_signs(grad, signs), None, None


def _masked_relu_forward(module: nn.ReLU, compressor: Compressor, x: torch.Tensor) -> torch.Tensor:
    # inside a checkpoint region the mask would be packed in forward only to be discarded, and
    # packed again in the recomputation for one region's backward: two kernels per ReLU for
    # no memory kept across phases
    if (compressor.active and torch.is_grad_enabled() and x.requires_grad
            and not in_checkpoint_region()):
        return _SignMaskedReLU.apply(x, module.inplace, compressor)
    return torch.nn.functional.relu(x, inplace=module.inplace)


def patch_relus(model: nn.Module, compressor: Compressor) -> int:
    """Give every nn.ReLU instance the sign-mask forward; returns how many were patched."""
    relus = [m for m in model.modules() if type(m) is nn.ReLU]
    for relu in relus:
        relu.forward = functools.partial(_masked_relu_forward, relu, compressor)
    return len(relus)


class _OffsetIndexMaxPool(torch.autograd.Function):
    """2-D max-pool that saves where each maximum sits in its window (4 bits for a 3 x 3
    window) instead of its int64 flat index (64 bits): backward rebuilds the exact indices
    and runs PyTorch's own max-pool backward on them, so the gradient is bit-identical."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, pool: nn.MaxPool2d) -> torch.Tensor:
        out, indices = torch.nn.functional.max_pool2d(
            x, pool.kernel_size, pool.stride, pool.padding, pool.dilation, pool.ceil_mode,
            return_indices=True)
        ctx.window = qk.PoolWindow(x.shape[-1], out.shape[-2], out.shape[-1],
                                   *(_pair(getattr(pool, a)) for a in POOL_ARGS))
        ctx.pool, ctx.in_shape, ctx.out_shape = pool, x.shape, out.shape
        offsets = qk.window_offsets(indices, ctx.window)
        setattr(offsets, POOL_OFFSETS, indices.untyped_storage().nbytes())
        ctx.save_for_backward(offsets)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (offsets,) = ctx.saved_tensors
        indices = qk.window_indices(offsets, ctx.window, ctx.out_shape)
        # the op reads only the input's shape: a zero-stride stand-in, no input kept
        shape_only = grad.new_zeros(()).expand(ctx.in_shape)
        pool = ctx.pool
        grad_in = torch.ops.aten.max_pool2d_with_indices_backward(
            grad, shape_only, _pair(pool.kernel_size), _pair(pool.stride), _pair(pool.padding),
            _pair(pool.dilation), pool.ceil_mode, indices)
        return grad_in, None


POOL_ARGS = ("kernel_size", "stride", "padding", "dilation")


def _pair(v) -> tuple[int, int]:
    return (v, v) if isinstance(v, int) else tuple(v)


def _offset_pool_forward(module: nn.MaxPool2d, compressor: Compressor, x: torch.Tensor
                         ) -> torch.Tensor:
    if (compressor.active and torch.is_grad_enabled() and x.requires_grad
            and not in_checkpoint_region()):  # as for the ReLU masks
        return _OffsetIndexMaxPool.apply(x, module)
    return nn.MaxPool2d.forward(module, x)


def patch_maxpools(model: nn.Module, compressor: Compressor) -> int:
    """Give every nn.MaxPool2d instance (without return_indices, with a window of at most 256
    places: one byte per offset) the offset-saving forward."""
    pools = [m for m in model.modules() if type(m) is nn.MaxPool2d and not m.return_indices
             and math.prod(_pair(m.kernel_size)) <= 256]
    for pool in pools:
        pool.forward = functools.partial(_offset_pool_forward, pool, compressor)
    return len(pools)


# -- the effect on learning ------------------------------------------------------------------
class CompressionRecord:
    """Wraps the runtime's forward / backward: per-step saved bytes, and one gradient probe."""

    def __init__(self, compressor: Compressor, runtime: Runtime, probe_after: int | None):
        self.compressor, self.runtime = compressor, runtime
        self.probe_after = probe_after  # optimizer steps taken before the probed one (None: off)
        self.steps_done = 0
        self.rows: dict[tuple[int, str], float] = {}
        self._forward, self._backward = runtime.forward, runtime.backward
        self._pending: tuple | None = None
        runtime.forward, runtime.backward = self.forward, self.backward
        runtime.step_hooks.append(self._count_step)
        runtime.series_sources.append(self.series)

    def _count_step(self, info: StepInfo) -> None:
        self.steps_done = info.step

    def forward(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        probe = self.probe_after == self.steps_done and self._pending is None
        if probe:
            self.probe_after = None  # once, on the first forward of that step
            self._pending = (model, x, y, _buffers(model), _grads(model))
        self.compressor.reset_tally()
        loss = self._forward(model, x, y)
        before, after = self.compressor.tally()
        step = self.steps_done + 1
        for name, value in (("compress_saved_before_bytes", before),
                            ("compress_saved_after_bytes", after)):
            self.rows[(step, name)] = self.rows.get((step, name), 0.0) + value
        return loss

    def backward(self, loss: torch.Tensor) -> None:
        self._backward(loss)
        if self._pending is not None:
            pending, self._pending = self._pending, None
            cosine, rel_error = self._probe(*pending)
            self.rows[(self.steps_done + 1, "compress_grad_cosine")] = cosine
            self.rows[(self.steps_done + 1, "compress_grad_rel_error")] = rel_error

    def _probe(self, model, x, y, buffers_before, grads_before) -> tuple[float, float]:
        """The same micro-batch again without compression: gradient deviation of the real one."""
        params = [p for p in model.parameters() if p.requires_grad]
        grads_after = [p.grad for p in params]
        buffers_after = _buffers(model)
        _restore(model, buffers_before)  # the reference forward starts from the same statistics
        for p in params:
            p.grad = None
        with self.compressor.paused():
            self._backward(self._forward(model, x, y))
        reference = [p.grad for p in params]
        _restore(model, buffers_after)  # as if only the compressed step had run
        for p, g in zip(params, grads_after):
            p.grad = g
        compressed = [None if a is None else a if b is None else a - b
                      for a, b in zip(grads_after, grads_before)]
        return gradient_deviation(compressed, reference)

    def series(self) -> list[tuple[int, int, str, float]]:
        rank = self.runtime.rank
        return [(rank, step, name, float(v)) for (step, name), v in sorted(self.rows.items())]


def gradient_deviation(grads: list, reference: list) -> tuple[float, float]:
    """(cosine similarity, |g - g_ref| / |g_ref|) over all parameters together, in float64."""
    dot = norm = ref_norm = diff = 0.0
    for g, r in zip(grads, reference):
        if g is None or r is None:
            continue
        g64, r64 = g.detach().double(), r.detach().double()
        dot += float((g64 * r64).sum())
        norm += float(g64.square().sum())
        ref_norm += float(r64.square().sum())
        diff += float((g64 - r64).square().sum())
    cosine = dot / (norm ** 0.5 * ref_norm ** 0.5) if norm and ref_norm else float("nan")
    return cosine, (diff ** 0.5 / ref_norm ** 0.5 if ref_norm else float("nan"))


def _buffers(model: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(b, b.detach().clone()) for b in model.buffers()]


def _restore(model: nn.Module, saved: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    with torch.no_grad():
        for buf, value in saved:
            buf.copy_(value)


def _grads(model: nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.detach().clone()
            for p in model.parameters() if p.requires_grad]


# -- the technique ---------------------------------------------------------------------------
def resolve_impl(impl: str, device: torch.device) -> str:
    """'triton' or 'torch'; refuses triton where it cannot run (never a silent switch)."""
    if impl == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if impl == "triton":
        if device.type != "cuda" and not qk.interpreted():
            raise ConfigError(f"compress: impl=triton runs Triton kernels on a CUDA GPU, and "
                              f"train.device resolves to {device}; use compress:impl=torch (the "
                              "PyTorch references) or impl=auto, or set TRITON_INTERPRET=1")
        try:
            import triton  # noqa: F401
        except ImportError:
            raise ConfigError("compress: impl=triton needs the triton package, which is not "
                              "installed; pip install triton, or use compress:impl=torch") from None
    return impl


def resolve_boundary_bits(opts: Options) -> int:
    """Bits for checkpoint region inputs. Backward recomputes each region from its input, so
    that input's quantisation error passes through the region's ReLUs and BatchNorm and the
    gradient handed from region to region compounds it (measured 192 px, 4 bits everywhere:
    gradient cosine 0.53); 8 bits keep it close unless 4 or 2 are asked for explicitly."""
    if opts.boundary_bits:
        return opts.boundary_bits
    return BOUNDARY_BITS if opts.which == "all" else opts.bits


def check(opts: Options, plan: Plan) -> None:
    if opts.bits not in qk.BITS:
        raise ConfigError(f"compress: bits={opts.bits} is not supported; use bits=8, 4 or 2")
    if opts.group_size not in qk.GROUP_SIZES:
        raise ConfigError(f"compress: group_size={opts.group_size} must be a power of two from "
                          f"{qk.GROUP_SIZES[0]} to {qk.GROUP_SIZES[-1]} (one Triton block, whole "
                          "bytes of codes per group)")
    if opts.boundary_bits and opts.boundary_bits not in qk.BITS:
        raise ConfigError(f"compress: boundary_bits={opts.boundary_bits} is not supported; use "
                          "boundary_bits=8, 4 or 2 (or 0: 8 with which=all, bits with "
                          "which=boundaries)")
    if opts.boundary_bits and opts.which == "boundaries":
        raise ConfigError("compress: with which=boundaries only region inputs are compressed, "
                          "at `bits`; drop boundary_bits and set bits instead")
    if opts.min_numel < 0:
        raise ConfigError(f"compress: min_numel={opts.min_numel} must be >= 0")
    if plan.device.type not in ("cuda", "cpu"):
        raise ConfigError(f"compress runs on CUDA (Triton kernels) or the CPU (PyTorch "
                          f"references), and train.device resolves to {plan.device}; set "
                          "train.device = 'cuda' or 'cpu', or drop compress")
    resolve_impl(opts.impl, plan.device)
    if opts.which == "boundaries" and not (plan.has("checkpoint") or plan.has("tile")):
        raise ConfigError("compress: which=boundaries compresses only what checkpoint / tile "
                          "keep between regions, and neither is in techniques; add checkpoint "
                          "(or tile) or use compress:which=all")
    if plan.has("quantization"):
        # found by the registry's outcome table: the fake-quantized activations' backward failed
        # on restored tensors (size of tensor a (64) must match b (0)); refused until supported
        raise ConfigError("compress cannot be combined with quantization: the fake quantizers' "
                          "backward does not accept compressed saved tensors; drop one of "
                          "compress, quantization")
    if plan.has("compile"):
        # seen on the CPU (torch 2.14): the compiled graph's saved tensors do reach the hooks
        # (offload relies on that), but TorchDynamo traces compress's pack hook and guards on
        # each tensor's type and flags, recompiling until fail_on_recompile_limit_hit stops it
        raise ConfigError("compress cannot be combined with compile: TorchDynamo traces "
                          "compress's saved-tensor hooks and recompiles them for the saved "
                          "tensors until its recompile limit stops the run; drop compile or "
                          "compress")
    if opts.grad_probe:
        _check_probe(plan)


def _check_probe(plan: Plan) -> None:
    if plan.has("pipeline"):
        raise ConfigError("compress: grad_probe re-runs a step through the runtime's forward / "
                          "backward, which pipeline replaces; set compress:grad_probe=false")
    if plan.config is not None and plan.config.train.warmup_steps < 1:
        raise ConfigError("compress: grad_probe re-runs the last warm-up step uncompressed (so "
                          "no measured step pays for it), and train.warmup_steps = 0; set "
                          "train.warmup_steps >= 1 or compress:grad_probe=false")


def apply(opts: Options, build: Build) -> None:
    impl = resolve_impl(opts.impl, build.device)
    compressor = Compressor(opts.bits, opts.group_size, opts.min_numel,
                            boundaries_only=opts.which == "boundaries",
                            use_triton=impl == "triton", seed=build.config.train.seed,
                            boundary_bits=resolve_boundary_bits(opts),
                            channel_groups=opts.groups == "channel")
    rt = build.runtime
    rt.add_saved_tensor_transform(compressor.pack, compressor.unpack, owner="compress")
    if opts.which == "all":
        loss_fn = rt.loss_fn

        def exact_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            with compressor.paused():
                return loss_fn(out, y)

        rt.loss_fn = exact_loss
        if opts.relu_mask:
            build.notes["compress_relus_masked"] = patch_relus(build.model, compressor)
        if opts.pool_offsets:
            build.notes["compress_pools_offset"] = patch_maxpools(build.model, compressor)
    probe_after = build.config.train.warmup_steps - 1 if opts.grad_probe else None
    build.notes["compress"] = CompressionRecord(compressor, rt, probe_after)
    build.notes["compress_impl"] = impl
    build.notes["compress_boundary_bits"] = compressor.boundary_bits


register(Technique("compress", Stage.ACTIVATION, Options,
                   "saved activations quantised to 8/4/2 bits: memory for two passes and "
                   "gradient noise", apply, check, order=40))  # before offload (60): offload
# moves the compressed bytes (runtime.add_saved_tensor_transform)
