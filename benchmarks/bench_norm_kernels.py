"""The tiled BatchNorm's Triton kernels against PyTorch's primitives: GPU benchmark.

    python benchmarks/bench_norm_kernels.py --out benchmarks/results/h100/tile-fast

Strips shaped as the tiled levels' BatchNorm inputs (bf16, channels_last): full resolution
at 4188 px with 4 strips (16 channels), half resolution (32 and 64 channels), and full
resolution at 8192 px with 8 strips. Per strip, median of --repeat runs timed by CUDA events
after warm-up, for each of the four things memstudy/tiling/norm.py does to a strip:
  moments   batch_norm_stats (+ the variance from its invstd)   vs  norm_act.moments
  forward   batch_norm_elemt + relu_                             vs  norm_act.affine_act
  backward  threshold_backward + batch_norm_backward_reduce +
            batch_norm_backward_elemt                            vs  norm_act.affine_relu_backward
  seed      batch_norm_backward_elemt (rows + shift + scale (z - mean))  vs  affine_act(add=rows)
GB/s counts the bytes each must read and write once (z, y, grads: 2 bytes an element).
Writes norm-kernels.md and prints it.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from memstudy.tiling import norm_act as na
from cuda_timing import median_ms  # benchmarks/ is on sys.path when run as a script

SHAPES = [(1, 16, 1056, 4192), (1, 32, 530, 2096), (1, 64, 530, 2096), (1, 16, 1040, 8192)]
PASSES = {"moments": 1, "forward": 2, "backward": 4, "seed": 3}  # tensors read + written


def strip_case(shape: tuple[int, ...]) -> dict:
    """A bf16 channels_last strip, an output gradient, its statistics and a BatchNorm's affine
    parameters, seeded (the benchmark's input and tests/test_kernels_norm_act.py's)."""
    g = torch.Generator("cuda").manual_seed(0)
    z = (torch.randn(shape, device="cuda", generator=g) * 2 + 1).to(torch.bfloat16)
    z = z.contiguous(memory_format=torch.channels_last)
    c = shape[1]
    _, mean, var = na.moments(z)
    return dict(z=z, grad_y=torch.randn_like(z, memory_format=torch.channels_last), mean=mean,
                invstd=torch.rsqrt(var + 1e-5), weight=torch.rand(c, device="cuda") + 0.5,
                bias=torch.randn(c, device="cuda"))


def primitives(z, grad_y, mean, invstd, weight, bias) -> dict:
    """PyTorch's SyncBatchNorm primitives doing what each kernel does: name -> callable
    returning (moments: mean, var; forward: y; backward: grad_z, sum_dy, sum_dy_xmu; seed)."""
    zero, ones = torch.zeros_like(mean), torch.ones_like(mean)
    count = torch.full((1,), z.numel() // z.shape[1], dtype=torch.int32, device=z.device)
    one = torch.ones((1,), dtype=torch.int32, device=z.device)

    def moments():
        m, inv = torch.batch_norm_stats(z, 1e-30)
        return m, inv.pow(-2) - 1e-30

    def forward():
        return torch.batch_norm_elemt(z, weight, bias, mean, invstd, 0.0).relu_()

    y = forward()

    def backward():
        dy = torch.ops.aten.threshold_backward(grad_y, y, 0)
        sum_dy, sum_dy_xmu, _, _ = torch.batch_norm_backward_reduce(
            dy, z, mean, invstd, weight, True, True, True)
        grad_z = torch.batch_norm_backward_elemt(dy, z, mean, invstd, weight, zero, zero, count)
        return grad_z, sum_dy, sum_dy_xmu

    def seed():  # rows + shift + scale * (z - mean), with rows = grad_y, scale = weight
        return torch.batch_norm_backward_elemt(grad_y, z, mean, ones, ones, -bias, -weight, one)

    return {"moments": moments, "forward": forward, "backward": backward, "seed": seed}


def kernels(z, grad_y, mean, invstd, weight, bias) -> dict:
    """The Triton kernels doing the same (the backward's ReLU mask: the primitives' output)."""
    y = torch.batch_norm_elemt(z, weight, bias, mean, invstd, 0.0).relu_()
    return {"moments": lambda: na.moments(z)[1:],
            "forward": lambda: na.affine_act(z, mean, invstd * weight, bias, relu=True),
            "backward": lambda: na.affine_relu_backward(grad_y, y, z, mean, invstd, weight),
            "seed": lambda: na.affine_act(z, mean, weight, bias, add=grad_y)}


def measure(shape, repeat: int) -> list[str]:
    case = strip_case(shape)
    ref, new = primitives(**case), kernels(**case)
    z = case["z"]
    rows = []
    for name in ref:
        a, b = median_ms(ref[name], repeat), median_ms(new[name], repeat)
        gbs = PASSES[name] * z.numel() * z.element_size() / b / 1e6
        rows.append(f"| {'x'.join(map(str, shape))} | {name} | {a:.3f} | {b:.3f} | "
                    f"{a / b:.2f}x | {gbs:.0f} |")
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--repeat", type=int, default=30)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_norm_kernels needs a CUDA GPU")
    lines = [f"# Tiled BatchNorm kernels: Triton vs PyTorch's primitives "
             f"({torch.cuda.get_device_name()})", "",
             f"bf16 channels_last strips, torch {torch.__version__}, median of {args.repeat} "
             "(ms, CUDA events, after 5 warm-up runs); GB/s: the Triton kernel's bytes read "
             "and written once over its time", "",
             "| strip | step | PyTorch ms | Triton ms | speedup | Triton GB/s |",
             "|---|---|---|---|---|---|"]
    for shape in SHAPES:
        lines += measure(shape, args.repeat)
    text = "\n".join(lines) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "norm-kernels.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
