"""Activation compression kernels: per-group 8/4/2-bit quantisation and 1-bit sign masks.

Quantisation (ActNN / GACT style), on a tensor read as one flat run of `n` elements in memory
order and cut into groups of `group` consecutive elements (the last group may be short):

    lo = min(group), scale = (max(group) - lo) / (2^bits - 1)           (float32, per group)
    code = clamp(floor((x - lo) * (1 / scale) + u), 0, 2^bits - 1),     u ~ U[0, 1)
    x' = lo + code * scale

Stochastic rounding (u) makes x' an unbiased estimate of x (E[x'] = x) with |x - x'| < scale,
one quantisation step; a constant group (scale = 0) is restored exactly. The codes of
8 / bits consecutive elements are packed into one byte, element j of a byte in bits
[j * bits, (j + 1) * bits). Storage: n * bits / 8 bytes of codes + 8 bytes per group.

Channel-major groups (`quantize_channels`, for channels-last activations): a tensor whose
memory is a row-major [P, C] matrix (P = N * H * W pixels, C channels) is cut per channel into
groups of `group` consecutive pixels, the elements at memory offsets (p0 + k) * C + c, k < group
(the last group of each channel may be short: P % group). Memory order would put all C channels
of a few pixels in one group, and channels differ in range, so each group's [min, max] would be
wide and its step coarse. The kernels read [group, BLOCK_C] tiles coalesced along C straight
from the activation (no transposed copy). Stored layout: codes [ceil(P * bits / 8), C]: the
byte of pixels k * 8 / bits .. (k + 1) * 8 / bits - 1 of channel c is at k * C + c (the packing
above); group g of channel c is rows [g, g + 1) * group * bits / 8 of column c, and only a
column's last byte is padded, not its short last group; lo and scale [G, C], G = ceil(P /
group): C * G groups (`channel_groups`). The noise of element (p, c) is tl.rand(seed, p * C +
c), its memory index, so `uniform_noise` serves both layouts.

Sign masks: bit j of byte i is (x[8 i + j] > 0): what ReLU's backward needs of its output.

Each kernel has a pure-PyTorch reference doing the same float32 arithmetic in the same order
(`quantize_reference`, `dequantize_reference`, `pack_signs_reference`, `apply_signs_reference`).
The kernels draw u with Triton's Philox stream `tl.rand(seed, i)` (i = flat element index);
`uniform_noise(seed, n)` returns that same stream, so the reference given it must reproduce
the kernel's codes exactly (tests, TRITON_INTERPRET=1 on the CPU). On a GPU the compiled
kernels may contract `a * b + c` into one fused multiply-add, so a code can differ by one
level where (x - lo) / scale + u falls within an ulp of an integer (GPU test: a rare event,
bounded). Triton is imported lazily and the kernels are built per value of TRITON_INTERPRET
(triton decides at decoration time whether a function is interpreted).
"""
from __future__ import annotations

import functools
import types
from dataclasses import dataclass

import torch

from memstudy.kernels import interpreted

BITS = (8, 4, 2)
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
GROUP_SIZES = tuple(2 ** k for k in range(5, 13))  # 32 .. 4096: a Triton block, whole bytes
ELEMENTS_PER_PROGRAM = 4096  # groups per program = this // group: enough work per program
MASK_BYTES_PER_PROGRAM = 1024  # sign masks: 8192 elements per program
UNSPECIALISED = ("seed",)  # kernel arguments Triton must not specialise on (see _kernels)
# channel-major tiles: [group pixels, BLOCK_C channels] with BLOCK_C = TILE_ELEMENTS // group, at
# least MIN_BLOCK_C (32 contiguous bytes of float32 per pixel row) and at most C rounded up to a
# power of two; 8 warps above TILE_ELEMENTS elements (large groups)
TILE_ELEMENTS = 4096
MIN_BLOCK_C = 8


def n_groups(n: int, group: int) -> int:
    return -(-n // group)


def code_bytes(n: int, bits: int, group: int) -> int:
    """Bytes of packed codes for n elements: every group, the short last one too, is whole."""
    return n_groups(n, group) * group * bits // 8


def channel_groups(n: int, channels: int, group: int) -> int:
    """Groups of an n-element [n / channels, channels] matrix grouped per channel: C * G."""
    return channels * n_groups(n // channels, group)


def channel_code_bytes(n: int, channels: int, bits: int) -> int:
    """Bytes of packed codes for channel-major groups: ceil(P * bits / 8) per channel."""
    return channels * n_groups(n // channels, 8 // bits)


def block_channels(channels: int, group: int) -> int:
    """BLOCK_C of the channel-major kernels' [group, BLOCK_C] tiles (a power of two)."""
    full = 1 << max(0, channels - 1).bit_length()  # C rounded up to a power of two
    return min(full, max(MIN_BLOCK_C, TILE_ELEMENTS // group))


# -- PyTorch references ----------------------------------------------------------------------
def _grouped(flat: torch.Tensor, group: int, fill: float) -> torch.Tensor:
    pad = n_groups(flat.numel(), group) * group - flat.numel()
    return torch.nn.functional.pad(flat, (0, pad), value=fill).view(-1, group)


def quantize_reference(flat: torch.Tensor, bits: int, group: int, noise: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes uint8, lo float32, scale float32) of a 1-D tensor; `noise`: n uniforms in [0, 1)."""
    x = flat.float()
    grouped = _grouped(x, group, 0.0)
    lo, hi = grouped.amin(dim=1), grouped.amax(dim=1)
    tail = x.numel() % group
    if tail:  # the short last group: its padding must not count
        lo[-1], hi[-1] = x[-tail:].min(), x[-tail:].max()
    levels = (1 << bits) - 1
    scale = (hi - lo) / levels
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    t = (grouped - lo[:, None]) * inv[:, None]  # two roundings, as in the kernel (no FMA)
    u = _grouped(noise.float(), group, 0.0)
    codes = torch.floor(t + u).clamp_(0, levels).to(torch.int32)
    codes.view(-1)[flat.numel():] = 0  # the short last group's padding packs as zeros
    per = 8 // bits
    shifts = torch.arange(per, dtype=torch.int32, device=flat.device) * bits
    packed = (codes.view(-1, per) << shifts).sum(dim=1).to(torch.uint8)
    return packed, lo, scale


def dequantize_reference(codes: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor, n: int,
                         bits: int, group: int, dtype: torch.dtype) -> torch.Tensor:
    """The n restored elements (1-D, `dtype`) of `quantize_reference`'s output."""
    per = 8 // bits
    shifts = torch.arange(per, dtype=torch.int32, device=codes.device) * bits
    levels = (codes.to(torch.int32)[:, None] >> shifts) & ((1 << bits) - 1)
    levels = levels.view(-1, group).float()
    x = lo[:, None] + levels * scale[:, None]
    return x.reshape(-1)[:n].to(dtype)


def _pixels(n: int, channels: int) -> int:
    if channels < 1 or n % channels:
        raise ValueError(f"{n} elements are not a [pixels, {channels}] matrix")
    return n // channels


def quantize_channels_reference(flat: torch.Tensor, channels: int, bits: int, group: int,
                                noise: torch.Tensor
                                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes uint8, lo float32, scale float32) of a 1-D tensor read as a row-major
    [P, channels] matrix, in channel-major groups of `group` pixels (module docstring);
    `noise`: n uniforms in [0, 1) in memory order (element p * C + c rounds with noise[p * C + c]).
    The arithmetic of `quantize_reference`, per channel; transposed copies are fine here."""
    pixels = _pixels(flat.numel(), channels)
    groups = n_groups(pixels, group)
    pad = groups * group - pixels
    x = flat.float().view(pixels, channels).t()  # [C, P]
    grouped = torch.nn.functional.pad(x, (0, pad)).view(channels, groups, group)
    lo, hi = grouped.amin(dim=2), grouped.amax(dim=2)  # [C, G]
    tail = pixels % group
    if tail:  # each channel's short last group: its padding must not count
        lo[:, -1], hi[:, -1] = x[:, -tail:].amin(dim=1), x[:, -tail:].amax(dim=1)
    levels = (1 << bits) - 1
    scale = (hi - lo) / levels
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    t = (grouped - lo[:, :, None]) * inv[:, :, None]  # two roundings, as in the kernel
    u = torch.nn.functional.pad(noise.float().view(pixels, channels).t(), (0, pad))
    codes = torch.floor(t + u.view(channels, groups, group)).clamp_(0, levels).to(torch.int32)
    codes.view(channels, -1)[:, pixels:] = 0  # each short last group's padding packs as zeros
    per = 8 // bits
    shifts = torch.arange(per, dtype=torch.int32, device=flat.device) * bits
    packed = (codes.view(channels, -1, per) << shifts).sum(dim=2).to(torch.uint8)
    packed = packed[:, :n_groups(pixels, per)].t().reshape(-1)  # [ceil(P / per), C]
    return packed, lo.t().reshape(-1), scale.t().reshape(-1)  # [G, C]


def dequantize_channels_reference(codes: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor,
                                  n: int, channels: int, bits: int, group: int,
                                  dtype: torch.dtype) -> torch.Tensor:
    """The n restored elements (1-D, memory order, `dtype`) of `quantize_channels_reference`."""
    pixels = _pixels(n, channels)
    groups = n_groups(pixels, group)
    per = 8 // bits
    shifts = torch.arange(per, dtype=torch.int32, device=codes.device) * bits
    rows = groups * group // per - n_groups(pixels, per)  # the last groups' missing bytes
    packed = torch.nn.functional.pad(codes.to(torch.int32).view(-1, channels), (0, 0, 0, rows))
    packed = packed.view(groups, group // per, 1, channels)
    levels = (packed >> shifts[:, None]) & ((1 << bits) - 1)  # [G, group / per, per, C]
    levels = levels.view(groups, group, channels).float()
    x = lo.view(groups, 1, channels) + levels * scale.view(groups, 1, channels)
    return x.view(groups * group, channels)[:pixels].reshape(-1).to(dtype)


def pack_signs_reference(flat: torch.Tensor) -> torch.Tensor:
    """One bit per element, (x > 0), eight to a byte (the last byte zero-padded)."""
    positive = _grouped((flat > 0).to(torch.int32), 8, 0)
    shifts = torch.arange(8, dtype=torch.int32, device=flat.device)
    return (positive << shifts).sum(dim=1).to(torch.uint8)


def apply_signs_reference(grad: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """grad where the packed sign bit is set, 0 elsewhere (ReLU's backward); 1-D."""
    shifts = torch.arange(8, dtype=torch.int32, device=signs.device)
    bits = ((signs.to(torch.int32)[:, None] >> shifts) & 1).reshape(-1)[:grad.numel()]
    return torch.where(bits.bool(), grad, torch.zeros_like(grad))


# -- max-pool indices as window offsets (PyTorch; exact integer arithmetic) --------------------
@dataclass(frozen=True)
class PoolWindow:
    """A 2-D max-pool's geometry: enough to turn the flat index of each output's maximum
    (ih * W + iw in its input plane) into its place in the output's window and back."""
    in_w: int
    out_h: int
    out_w: int
    kernel: tuple[int, int]
    stride: tuple[int, int]
    padding: tuple[int, int]
    dilation: tuple[int, int]

    @property
    def offset_bits(self) -> int:
        """4 bits when a window has at most 16 places (3 x 3: 9), else 8."""
        return 4 if self.kernel[0] * self.kernel[1] <= 16 else 8

    def _origins(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Input row of each output row's window top, input column of each window's left."""
        rows = torch.arange(self.out_h, device=device) * self.stride[0] - self.padding[0]
        cols = torch.arange(self.out_w, device=device) * self.stride[1] - self.padding[1]
        return rows[:, None], cols


def window_offsets(indices: torch.Tensor, window: PoolWindow) -> torch.Tensor:
    """Packed offsets (uint8, 1-D) of max-pool `indices` within their windows, in the
    contiguous order of `indices`: offset = row_in_window * kernel_w + col_in_window."""
    rows, cols = window._origins(indices.device)
    flat = indices.contiguous()
    ih = torch.div(flat, window.in_w, rounding_mode="floor")
    iw = flat - ih * window.in_w
    ih.sub_(rows).div_(window.dilation[0], rounding_mode="floor")
    iw.sub_(cols).div_(window.dilation[1], rounding_mode="floor")
    offsets = ih.mul_(window.kernel[1]).add_(iw).to(torch.uint8).reshape(-1)
    return _pack_nibbles(offsets) if window.offset_bits == 4 else offsets


def window_indices(packed: torch.Tensor, window: PoolWindow, shape: torch.Size) -> torch.Tensor:
    """The int64 max-pool indices (contiguous, `shape`) that `window_offsets` packed."""
    n = torch.Size(shape).numel()
    offsets = (_unpack_nibbles(packed, n) if window.offset_bits == 4 else packed).to(torch.int64)
    offsets = offsets.view(shape)
    rows, cols = window._origins(packed.device)
    ih = torch.div(offsets, window.kernel[1], rounding_mode="floor")
    iw = offsets.sub_(ih * window.kernel[1])
    ih.mul_(window.dilation[0]).add_(rows)
    iw.mul_(window.dilation[1]).add_(cols)
    return ih.mul_(window.in_w).add_(iw)


def _pack_nibbles(values: torch.Tensor) -> torch.Tensor:
    """Two 4-bit values (uint8 < 16) per byte, the first in the low half."""
    if values.numel() % 2:
        values = torch.cat([values, values.new_zeros(1)])
    pairs = values.view(-1, 2)
    return pairs[:, 0] | (pairs[:, 1] << 4)


def _unpack_nibbles(packed: torch.Tensor, n: int) -> torch.Tensor:
    return torch.stack([packed & 15, packed >> 4], dim=1).reshape(-1)[:n]


# -- Triton kernels --------------------------------------------------------------------------
def _require_kernel_device(t: torch.Tensor, what: str) -> None:
    if t.device.type != "cuda" and not interpreted():
        raise ValueError(f"{what} runs a Triton kernel: pass a CUDA tensor, set "
                         "TRITON_INTERPRET=1, or use the *_reference function")


def quantize(flat: torch.Tensor, bits: int, group: int, seed: int
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The Triton kernel for `quantize_reference`, drawing its noise from `uniform_noise(seed)`."""
    _require_kernel_device(flat, "quantize")
    n = flat.numel()
    groups = n_groups(n, group)
    rows = max(1, ELEMENTS_PER_PROGRAM // group)
    codes = torch.empty(code_bytes(n, bits, group), dtype=torch.uint8, device=flat.device)
    lo = torch.empty(groups, dtype=torch.float32, device=flat.device)
    scale = torch.empty(groups, dtype=torch.float32, device=flat.device)
    kernels = _kernels(interpreted())
    kernels["quantize"][(n_groups(groups, rows),)](
        flat, codes, lo, scale, n, groups, seed, BITS=bits, GROUP=group, ROWS=rows)
    return codes, lo, scale


def dequantize(codes: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor, n: int, bits: int,
               group: int, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """The Triton kernel for `dequantize_reference`; writes into `out` (1-D, n) if given."""
    _require_kernel_device(codes, "dequantize")
    groups = lo.numel()
    rows = max(1, ELEMENTS_PER_PROGRAM // group)
    out = torch.empty(n, dtype=dtype, device=codes.device) if out is None else out
    _kernels(interpreted())["dequantize"][(n_groups(groups, rows),)](
        codes, lo, scale, out, n, groups, BITS=bits, GROUP=group, ROWS=rows,
        BF16=out.dtype == torch.bfloat16)
    return out


def quantize_channels(flat: torch.Tensor, channels: int, bits: int, group: int, seed: int
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The Triton kernel for `quantize_channels_reference` (noise: `uniform_noise(seed)`).
    `flat`: the activation's memory as a 1-D view (no copy), a row-major [P, channels] matrix."""
    _require_kernel_device(flat, "quantize_channels")
    n = flat.numel()
    pixels = _pixels(n, channels)
    groups = n_groups(pixels, group)
    block_c = block_channels(channels, group)
    codes = torch.empty(channel_code_bytes(n, channels, bits), dtype=torch.uint8,
                        device=flat.device)
    lo = torch.empty(channel_groups(n, channels, group), dtype=torch.float32, device=flat.device)
    scale = torch.empty_like(lo)
    _kernels(interpreted())["quantize_channels"][(groups, n_groups(channels, block_c))](
        flat, codes, lo, scale, pixels, channels, seed, BITS=bits, GROUP=group, BLOCK_C=block_c,
        num_warps=_warps(group, block_c))
    return codes, lo, scale


def dequantize_channels(codes: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor, n: int,
                        channels: int, bits: int, group: int, dtype: torch.dtype,
                        out: torch.Tensor | None = None) -> torch.Tensor:
    """The Triton kernel for `dequantize_channels_reference`; writes into `out` (1-D, n, in
    memory order: a view of a channels-last tensor's memory) if given."""
    _require_kernel_device(codes, "dequantize_channels")
    pixels = _pixels(n, channels)
    block_c = block_channels(channels, group)
    out = torch.empty(n, dtype=dtype, device=codes.device) if out is None else out
    _kernels(interpreted())["dequantize_channels"][(n_groups(pixels, group),
                                                    n_groups(channels, block_c))](
        codes, lo, scale, out, pixels, channels, BITS=bits, GROUP=group, BLOCK_C=block_c,
        BF16=out.dtype == torch.bfloat16, num_warps=_warps(group, block_c))
    return out


def _warps(group: int, block_c: int) -> int:
    return 4 if group * block_c <= TILE_ELEMENTS else 8


def pack_signs(flat: torch.Tensor) -> torch.Tensor:
    _require_kernel_device(flat, "pack_signs")
    n = flat.numel()
    signs = torch.empty(n_groups(n, 8), dtype=torch.uint8, device=flat.device)
    grid = (n_groups(signs.numel(), MASK_BYTES_PER_PROGRAM),)
    _kernels(interpreted())["pack_signs"][grid](flat, signs, n, BLOCK=MASK_BYTES_PER_PROGRAM)
    return signs


def apply_signs(grad: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    _require_kernel_device(grad, "apply_signs")
    n = grad.numel()
    out = torch.empty_like(grad)
    grid = (n_groups(signs.numel(), MASK_BYTES_PER_PROGRAM),)
    _kernels(interpreted())["apply_signs"][grid](grad, signs, out, n, BLOCK=MASK_BYTES_PER_PROGRAM)
    return out


def uniform_noise(n: int, seed: int, device: torch.device | str = "cuda") -> torch.Tensor:
    """tl.rand(seed, i) for i in 0..n-1: the noise `quantize(..., seed)` rounds with."""
    out = torch.empty(n, dtype=torch.float32, device=device)
    _require_kernel_device(out, "uniform_noise")
    _kernels(interpreted())["uniform"][(n_groups(n, 1024),)](out, n, seed, BLOCK=1024)
    return out


@functools.lru_cache(maxsize=2)
def _kernels(interpret: bool) -> dict:
    """Build the kernels (interpreted or compiled, as TRITON_INTERPRET says now)."""
    del interpret  # part of the cache key only: triton reads the variable itself at decoration
    import triton
    import triton.language as tl

    # Each build's kernels get their own globals. The interpreter re-executes a kernel's source
    # in its function's globals (closures are lost there), so the helper both codec kernels
    # call is reached through this scope; compiled kernels find it in their closure.
    scope = {**globals(), "tl": tl, "triton": triton}

    def jit(fn):
        rebuilt = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__,
                                     fn.__closure__)
        # FunctionType drops annotations: without them Triton (3.5, torch 2.11's) no longer sees
        # the tl.constexpr parameters and tl.arange(0, ROWS) fails to compile
        rebuilt.__annotations__ = dict(fn.__annotations__)
        rebuilt.__doc__ = fn.__doc__
        # Triton compiles a variant per integer argument's divisibility by 16 (and == 1); a
        # fresh random seed per call would hit a new variant in 1 of 16 calls, compiling it
        # inside a timed step long after warm-up (the likely cause of an H100 compress run's
        # plain-step median of 1.13 s against 0.30 s for its metered steps, H100, 2026-11-23). Shape
        # arguments repeat every step: warm-up compiles their variants.
        args = fn.__code__.co_varnames[:fn.__code__.co_argcount]
        return triton.jit(rebuilt, do_not_specialize=[a for a in UNSPECIALISED if a in args])

    @jit
    def group_layout(n_groups, BITS: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr):
        """This program's ROWS groups: (rows, row_ok, idx, j, code_idx), where idx is the
        [ROWS, GROUP // PER, PER] flat element index (group, byte within it, element within
        the byte), j the element's place in its byte, code_idx the [ROWS, GROUP // PER] byte
        index of the packed codes; PER = 8 // BITS elements per byte."""
        PER: tl.constexpr = 8 // BITS
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        byte = tl.arange(0, GROUP // PER)
        j = tl.arange(0, PER)
        idx = rows.to(tl.int64)[:, None, None] * GROUP + byte[None, :, None] * PER + j[None, None, :]
        code_idx = rows.to(tl.int64)[:, None] * (GROUP // PER) + byte[None, :]
        return rows, rows < n_groups, idx, j, code_idx

    @jit
    def quantize_kernel(x_ptr, codes_ptr, lo_ptr, scale_ptr, n, n_groups, seed,
                        BITS: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr):
        LEVELS: tl.constexpr = (1 << BITS) - 1
        rows, row_ok, idx, j, code_idx = group_layout(n_groups, BITS, GROUP, ROWS)
        inside = idx < n
        x = tl.load(x_ptr + idx, mask=inside, other=0.0).to(tl.float32)
        lo = tl.min(tl.min(tl.where(inside, x, float("inf")), axis=2), axis=1)
        hi = tl.max(tl.max(tl.where(inside, x, float("-inf")), axis=2), axis=1)
        lo = tl.where(row_ok, lo, 0.0)  # programs past the last group: no infinities
        hi = tl.where(row_ok, hi, 0.0)
        scale = tl.math.div_rn(hi - lo, LEVELS * 1.0)
        safe = tl.where(scale > 0, scale, 1.0)
        inv = tl.where(scale > 0, tl.math.div_rn(1.0, safe), 0.0)
        t = (x - lo[:, None, None]) * inv[:, None, None]
        u = tl.rand(seed, idx)
        code = tl.minimum(tl.maximum(tl.floor(t + u), 0.0), LEVELS * 1.0).to(tl.int32)
        code = tl.where(inside, code, 0)  # the short last group's padding packs as zeros
        packed = tl.sum(code << (j * BITS)[None, None, :], axis=2).to(tl.uint8)
        tl.store(codes_ptr + code_idx, packed, mask=row_ok[:, None])
        tl.store(lo_ptr + rows, lo, mask=row_ok)
        tl.store(scale_ptr + rows, scale, mask=row_ok)

    @jit
    def dequantize_kernel(codes_ptr, lo_ptr, scale_ptr, out_ptr, n, n_groups,
                          BITS: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr,
                          BF16: tl.constexpr):
        LEVELS: tl.constexpr = (1 << BITS) - 1
        rows, row_ok, idx, j, code_idx = group_layout(n_groups, BITS, GROUP, ROWS)
        packed = tl.load(codes_ptr + code_idx, mask=row_ok[:, None], other=0).to(tl.int32)
        level = (packed[:, :, None] >> (j * BITS)[None, None, :]) & LEVELS
        lo = tl.load(lo_ptr + rows, mask=row_ok, other=0.0)
        scale = tl.load(scale_ptr + rows, mask=row_ok, other=0.0)
        x = lo[:, None, None] + level.to(tl.float32) * scale[:, None, None]
        if BF16:  # round to nearest even by hand: the interpreter's own cast truncates
            word = x.to(tl.uint32, bitcast=True)
            word = word + 0x7FFF + ((word >> 16) & 1)
            tl.store(out_ptr + idx, (word >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True),
                     mask=idx < n)
        else:
            tl.store(out_ptr + idx, x.to(out_ptr.dtype.element_ty), mask=idx < n)

    @jit
    def channel_layout(pixels, channels, BITS: tl.constexpr, GROUP: tl.constexpr,
                       BLOCK_C: tl.constexpr):
        """This program's tile: group g = program_id(0) of BLOCK_C channels from
        program_id(1) * BLOCK_C: (c_ok, code_ok, inside, idx, j, code_idx, stat_idx), where
        idx is the [GROUP // PER, PER, BLOCK_C] memory index p * C + c of pixel p = g * GROUP +
        byte * PER + j (byte within the group, j its place in the byte) and channel c, inside
        says which exist, code_idx is the [GROUP // PER, BLOCK_C] index of the packed codes
        (code_ok: the bytes that exist, ceil(P / PER) per channel), stat_idx the [BLOCK_C]
        index of lo / scale; PER = 8 // BITS."""
        PER: tl.constexpr = 8 // BITS
        g = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        byte = tl.arange(0, GROUP // PER)
        j = tl.arange(0, PER)
        p = g * GROUP + byte[:, None, None] * PER + j[None, :, None]  # [GROUP // PER, PER, 1]
        c_ok = c < channels
        inside = (p < pixels) & c_ok[None, None, :]
        idx = p * channels + c[None, None, :]
        code_row = g * (GROUP // PER) + byte
        code_ok = (code_row * PER < pixels)[:, None] & c_ok[None, :]
        code_idx = code_row[:, None] * channels + c[None, :]
        return c_ok, code_ok, inside, idx, j, code_idx, g * channels + c

    @jit
    def quantize_channels_kernel(x_ptr, codes_ptr, lo_ptr, scale_ptr, pixels, channels, seed,
                                 BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_C: tl.constexpr):
        LEVELS: tl.constexpr = (1 << BITS) - 1
        c_ok, code_ok, inside, idx, j, code_idx, stat_idx = channel_layout(
            pixels, channels, BITS, GROUP, BLOCK_C)
        x = tl.load(x_ptr + idx, mask=inside, other=0.0).to(tl.float32)
        lo = tl.min(tl.min(tl.where(inside, x, float("inf")), axis=1), axis=0)  # [BLOCK_C]
        hi = tl.max(tl.max(tl.where(inside, x, float("-inf")), axis=1), axis=0)
        lo = tl.where(c_ok, lo, 0.0)  # channels past C: no inf - inf (nothing of them is stored)
        hi = tl.where(c_ok, hi, 0.0)
        scale = tl.math.div_rn(hi - lo, LEVELS * 1.0)
        safe = tl.where(scale > 0, scale, 1.0)
        inv = tl.where(scale > 0, tl.math.div_rn(1.0, safe), 0.0)
        t = (x - lo[None, None, :]) * inv[None, None, :]
        u = tl.rand(seed, idx)
        code = tl.minimum(tl.maximum(tl.floor(t + u), 0.0), LEVELS * 1.0).to(tl.int32)
        code = tl.where(inside, code, 0)  # a short last group's padding packs as zeros
        packed = tl.sum(code << (j * BITS)[None, :, None], axis=1).to(tl.uint8)
        tl.store(codes_ptr + code_idx, packed, mask=code_ok)
        tl.store(lo_ptr + stat_idx, lo, mask=c_ok)
        tl.store(scale_ptr + stat_idx, scale, mask=c_ok)

    @jit
    def dequantize_channels_kernel(codes_ptr, lo_ptr, scale_ptr, out_ptr, pixels, channels,
                                   BITS: tl.constexpr, GROUP: tl.constexpr,
                                   BLOCK_C: tl.constexpr, BF16: tl.constexpr):
        LEVELS: tl.constexpr = (1 << BITS) - 1
        c_ok, code_ok, inside, idx, j, code_idx, stat_idx = channel_layout(
            pixels, channels, BITS, GROUP, BLOCK_C)
        packed = tl.load(codes_ptr + code_idx, mask=code_ok, other=0).to(tl.int32)
        level = (packed[:, None, :] >> (j * BITS)[None, :, None]) & LEVELS
        lo = tl.load(lo_ptr + stat_idx, mask=c_ok, other=0.0)
        scale = tl.load(scale_ptr + stat_idx, mask=c_ok, other=0.0)
        x = lo[None, None, :] + level.to(tl.float32) * scale[None, None, :]
        if BF16:  # round to nearest even by hand, as dequantize_kernel does
            word = x.to(tl.uint32, bitcast=True)
            word = word + 0x7FFF + ((word >> 16) & 1)
            tl.store(out_ptr + idx, (word >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True),
                     mask=inside)
        else:
            tl.store(out_ptr + idx, x.to(out_ptr.dtype.element_ty), mask=inside)

    @jit
    def pack_signs_kernel(x_ptr, signs_ptr, n, BLOCK: tl.constexpr):
        byte = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        j = tl.arange(0, 8)
        idx = byte[:, None] * 8 + j[None, :]
        x = tl.load(x_ptr + idx, mask=idx < n, other=0.0)
        bits = (x > 0).to(tl.int32) << j[None, :]
        tl.store(signs_ptr + byte, tl.sum(bits, axis=1).to(tl.uint8), mask=byte * 8 < n)

    @jit
    def apply_signs_kernel(grad_ptr, signs_ptr, out_ptr, n, BLOCK: tl.constexpr):
        byte = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        j = tl.arange(0, 8)
        idx = byte[:, None] * 8 + j[None, :]
        inside = idx < n
        signs = tl.load(signs_ptr + byte, mask=byte * 8 < n, other=0).to(tl.int32)
        keep = ((signs[:, None] >> j[None, :]) & 1) != 0
        grad = tl.load(grad_ptr + idx, mask=inside, other=0.0)
        tl.store(out_ptr + idx, tl.where(keep, grad, 0.0).to(grad.dtype), mask=inside)

    @jit
    def uniform_kernel(out_ptr, n, seed, BLOCK: tl.constexpr):
        idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        tl.store(out_ptr + idx, tl.rand(seed, idx), mask=idx < n)

    scope["group_layout"] = group_layout
    scope["channel_layout"] = channel_layout
    return {"quantize": quantize_kernel, "dequantize": dequantize_kernel,
            "quantize_channels": quantize_channels_kernel,
            "dequantize_channels": dequantize_channels_kernel,
            "pack_signs": pack_signs_kernel, "apply_signs": apply_signs_kernel,
            "uniform": uniform_kernel}
