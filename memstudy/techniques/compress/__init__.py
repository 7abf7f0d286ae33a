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
  elements is cut into groups of `group_size` and quantised by the kernels of quantize.py
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

The machinery is beside this file, in this package:
- `codec`: saved tensors to codes + per-group statistics and back (the runtime's pack /
  unpack pair), over the kernels of `quantize`;
- `quantize`: the Triton kernels, each beside its pure-PyTorch reference (docs/kernels.md);
- `patches`: ReLU and max-pool forwards that save a 1-bit sign mask / 4-bit window offsets
  instead of their output / int64 indices (exact backward);
- `probe`: per-step saved bytes, and the gradient's deviation from an uncompressed re-run.

Composes with amp (16-bit activations: half the saving), checkpoint (what is still saved,
region inputs at `boundary_bits`, is compressed; `which=boundaries` compresses only those), offload
(chained after compress: fewer bytes cross PCIe), invertible. Refused with compile (TorchDynamo
traces the pack hook and recompiles it past its limit) and, for grad_probe, with pipeline
(whose schedule replaces the runtime's forward / backward).
"""
from __future__ import annotations

import torch

import memstudy.techniques.compress.quantize as qk
from memstudy.errors import ConfigError
from memstudy.kernels import resolve_impl
from memstudy.techniques.compress.codec import Compressor
from memstudy.techniques.compress.patches import patch_maxpools, patch_relus
from memstudy.techniques.compress.probe import CompressionRecord
from memstudy.techniques import register
from memstudy.techniques.base import Build, Plan, Stage, Technique
from memstudy.techniques.options import CompressOptions as Options

BOUNDARY_BITS = 8  # checkpoint region inputs with which=all, unless boundary_bits says otherwise


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
    resolve_impl(opts.impl, plan.device, "compress:impl")
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
    impl = resolve_impl(opts.impl, build.device, "compress:impl")
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
            build.notes["compress_relus_masked"] = patch_relus(build.model, compressor,
                                                               rt.checkpoint_regions)
        if opts.pool_offsets:
            build.notes["compress_pools_offset"] = patch_maxpools(build.model, compressor,
                                                                  rt.checkpoint_regions)
    probe_after = build.config.train.warmup_steps - 1 if opts.grad_probe else None
    build.notes["compress"] = CompressionRecord(compressor, rt, probe_after)
    build.notes["compress_impl"] = impl
    build.notes["compress_boundary_bits"] = compressor.boundary_bits


register(Technique("compress", Stage.ACTIVATION, Options,
                   "saved activations quantised to 8/4/2 bits: memory for two passes and "
                   "gradient noise", apply, check, order=40))  # before offload (60): offload
# moves the compressed bytes (runtime.add_saved_tensor_transform)
