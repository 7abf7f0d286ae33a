"""Automatic mixed precision: `amp:fp16`, `amp:bf16` or `amp:tf32`.

Memory / compute trade-off:
- fp16 and bf16 run the forward under `torch.autocast`: convolutions (and the other ops on
  autocast's lower-precision list) compute in 16 bits and return 16-bit outputs, so most
  tensors saved for backward, and the backward's temporaries, take half the bytes. On
  tensor-core GPUs they are also faster. Parameters, gradients and optimizer state stay
  float32 (autocast casts weights per op; the cast copies are transient), and the MS-SSIM
  loss runs in float32 outside autocast (memstudy/quality.py). Precision drops: fp16 keeps
  10 mantissa bits but only a 5-bit exponent, so gradients can underflow; dynamic loss
  scaling (`torch.amp.GradScaler`) multiplies the loss before backward and unscales before
  the step, skipping steps whose gradients overflowed. bf16 keeps float32's 8-bit exponent
  (no scaler needed) but only 7 mantissa bits.
- tf32 changes no tensor's storage: float32 matmuls and convolutions use TensorFloat-32
  tensor cores (10-bit mantissa inputs, float32 accumulate). Faster on compute capability
  >= 8.0, no memory change; the flags are process-global (see `set_tf32`).

The source study ([Study] (docs/references.md)) measured fp16 AMP, so `amp` alone means `amp:fp16`. Options:
`dtype` (positional) and, for fp16, `init_scale` (the GradScaler's initial scale).
"""
from __future__ import annotations

import functools
import torch

from memstudy.env import compute_capability
from memstudy.errors import ConfigError
from memstudy.techniques import register
from memstudy.techniques.base import Build, Plan, Stage, Technique
from memstudy.techniques.options import AmpOptions as Options

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
TF32_MIN_CAPABILITY = (8, 0)  # Ampere: the first GPUs with TF32 tensor cores


def check(opts: Options, plan: Plan) -> None:
    # init_scale: refused by Options itself (memstudy/techniques/options.py)
    if opts.dtype == "fp16" and plan.device.type != "cuda":
        # CPU autocast does run float16, but through slow, unrepresentative kernels; the study
        # measured fp16 on a GPU. Refuse rather than measure something else.
        raise ConfigError(f"amp:fp16 needs a CUDA GPU but train.device resolves to "
                          f"{plan.device}; set train.device = 'cuda', or use amp:bf16 on the CPU")
    if opts.dtype == "tf32":
        _check_tf32_device(plan.device)


def _check_tf32_device(device: torch.device) -> None:
    if device.type != "cuda":
        raise ConfigError(f"amp:tf32 needs a CUDA GPU of compute capability >= 8.0 but "
                          f"train.device resolves to {device}; set train.device = 'cuda' or "
                          "use amp:bf16")
    # NVML's answer leaves CUDA unstarted for the allocator technique; torch's starts it
    capability = compute_capability(device) or torch.cuda.get_device_capability(device)
    if capability < TF32_MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise ConfigError(f"amp:tf32 needs compute capability >= 8.0 (Ampere or newer); "
                          f"{name} on train.device={device} has {capability[0]}.{capability[1]}; "
                          "use amp:fp16 instead")


def set_tf32(enabled: bool) -> None:
    """Process-global TF32 switches for float32 matmuls (cuBLAS) and convolutions (cuDNN).

    They outlive a run: the next run in the same process inherits them. PyTorch's own
    defaults are matmul off but cuDNN convolutions ON, so a float32 baseline on an Ampere+ GPU
    silently uses TF32 convolutions unless this is called with False before it is built.
    Only the legacy flags are used: mixing them with the new `fp32_precision` API raises.
    """
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled
    torch.set_float32_matmul_precision("high" if enabled else "highest")


def apply(opts: Options, build: Build) -> None:
    # Set the global flags either way, so that an amp run never inherits TF32 from an earlier
    # run in the same process: fp16/bf16 measure autocast alone, with float32 ops outside it.
    set_tf32(opts.dtype == "tf32")
    build.notes["tf32"] = opts.dtype == "tf32"
    if opts.dtype == "tf32":
        return
    device_type = build.device.type
    dtype = DTYPES[opts.dtype]
    build.runtime.forward_contexts.append(functools.partial(torch.autocast, device_type, dtype=dtype))
    build.notes["autocast_dtype"] = str(dtype)
    if opts.dtype == "fp16":
        if build.runtime.scaler is not None:
            raise ConfigError("amp:fp16 installs a GradScaler but another technique already set "
                              "one; drop one of them from techniques")
        build.runtime.scaler = torch.amp.GradScaler(device_type, init_scale=opts.init_scale)


register(Technique("amp", Stage.RUNTIME, Options,
                   "16-bit autocast halves saved activations (fp16 with loss scaling, bf16), "
                   "or TF32 matmuls (speed only)", apply, check, order=10))
