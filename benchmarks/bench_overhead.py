"""memstudy's plain training step against a minimal hand-written loop, same GPU, same process.

    python benchmarks/bench_overhead.py --out benchmarks/results/h100
    python benchmarks/bench_overhead.py --out /tmp/ov --sizes 2048 --sets original,amp:bf16

For each technique set (original, amp:bf16, amp:bf16+checkpoint) and size (2048, 4160 px):
- the loop: written below with segmentation-models-pytorch, pytorch-msssim and torch only
  (no memstudy code on its path): U-Net/ResNet-34 (1 channel in and out, sigmoid), Adam
  (lr 1e-3), loss 1 - MS-SSIM (5 scales, 11 px window, float32 outside autocast),
  channels_last weights and inputs, cudnn.benchmark on, TF32 off (float32 "original"),
  bf16 autocast for amp:bf16, non-reentrant torch.utils.checkpoint around every residual
  and decoder block for checkpoint (what `checkpoint:block` places);
- memstudy: `memstudy.runner.execute` of the same configuration (its defaults on CUDA:
  channels_last and cudnn.benchmark on; train.loss_chunk_rows = 0, so the loss is
  pytorch-msssim's, as in the loop), whose `step_time_s` is the median plain step.
Both time a step the same way: warm-up steps excluded, `torch.cuda.synchronize()` before and
after, the step being forward + loss, backward, optimizer step, zero_grad and `loss.item()`
(batch preparation is outside the timed step in both). The ratio memstudy / loop is the
harness's overhead on what a user gets for free (target: within 2%). Writes overhead.md and
overhead.json into --out.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

SETS = {"original": [], "amp:bf16": ["amp:bf16"], "amp:bf16+checkpoint": ["amp:bf16", "checkpoint"]}
MSSSIM_WEIGHTS = (0.0448, 0.2856, 0.3001, 0.2363, 0.1333)


# -- the hand-written loop: torch, segmentation-models-pytorch and pytorch-msssim only ------
def loop_model(checkpoint: bool) -> torch.nn.Module:
    import segmentation_models_pytorch as smp
    from torch.utils.checkpoint import checkpoint as ckpt

    torch.manual_seed(0)
    model = smp.Unet("resnet34", encoder_weights=None, in_channels=1, classes=1, activation="sigmoid")
    if checkpoint:
        blocks = [b for layer in (model.encoder.layer1, model.encoder.layer2, model.encoder.layer3,
                                  model.encoder.layer4) for b in layer] + list(model.decoder.blocks)
        for block in blocks:
            block.forward = (lambda f: lambda *a, **k: ckpt(f, *a, use_reentrant=False, **k))(block.forward)
    return model.cuda().to(memory_format=torch.channels_last)


def loop_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    from pytorch_msssim import ms_ssim

    weights = [w / sum(MSSSIM_WEIGHTS) for w in MSSSIM_WEIGHTS]
    with torch.autocast("cuda", enabled=False):
        return 1 - ms_ssim(out.float(), target.float(), data_range=1.0, win_size=11, weights=weights)


def time_loop(size: int, techniques: list[str], warmup: int, steps: int) -> dict:
    torch.backends.cudnn.benchmark = True
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    model = loop_model("checkpoint" in techniques)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    autocast = "amp:bf16" in techniques
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(1, 1, size, size, generator=gen).cuda().contiguous(memory_format=torch.channels_last)
    y = torch.rand(1, 1, size, size, generator=gen).cuda().contiguous(memory_format=torch.channels_last)
    times = []
    for i in range(warmup + steps):
        if i == warmup:
            torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            out = model(x)
        loss = loop_loss(out, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated()
    del model, optimizer, x, y, out, loss
    torch.cuda.empty_cache()
    return {"step_time_s": statistics.median(times), "peak_alloc_bytes": peak, "steps": len(times)}


# -- memstudy -------------------------------------------------------------------------------
def time_memstudy(size: int, techniques: list[str], warmup: int, steps: int) -> dict:
    from memstudy.config import RunConfig
    from memstudy.runner import execute

    cfg = RunConfig(techniques=list(techniques))
    cfg.train.device, cfg.train.image_size, cfg.train.validate = "cuda", size, False
    cfg.train.warmup_steps, cfg.train.measure_steps = warmup, 1
    cfg.train.max_steps = warmup + 1 + steps
    cfg.data.train_images, cfg.data.val_images = 4, 1  # phantoms are reused over epochs
    if hasattr(cfg.train, "loss_chunk_rows"):  # the loop's loss: pytorch-msssim's own autograd
        cfg.train.loss_chunk_rows = 0
    cfg.train.epochs = cfg.train.max_steps
    rec = execute(cfg, db=None)
    if rec.status != "ok":
        raise RuntimeError(f"memstudy {techniques} at {size} px: {rec.status} {rec.error}")
    run = {n: v for _, phase, n, v in rec.metrics if phase == "run"}
    torch.cuda.empty_cache()
    return {"step_time_s": run["step_time_s"], "metered_step_time_s": run.get("metered_step_time_s"),
            "peak_alloc_bytes": run.get("alloc_peak_total_bytes"), "steps": steps,
            "channels_last": rec.config["train"]["channels_last"],
            "cudnn_benchmark": rec.config["train"]["cudnn_benchmark"]}


def markdown(rows: list[dict], gpu: str) -> str:
    lines = [f"# memstudy's plain step vs a hand-written loop ({gpu})", "",
             f"torch {torch.__version__}, CUDA {torch.version.cuda}; batch 1; median of the timed "
             "steps after warm-up, synchronised (benchmarks/bench_overhead.py). Ratio = memstudy / "
             "loop (target <= 1.02).", "",
             "| set | px | loop step ms | memstudy step ms | ratio | memstudy measured-step ms | "
             "loop peak MB | memstudy peak MB |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        m, lp = r["memstudy"], r["loop"]
        metered = f"{m['metered_step_time_s'] * 1e3:.1f}" if m.get("metered_step_time_s") else "-"
        mpeak = f"{m['peak_alloc_bytes'] / 2**20:.0f}" if m.get("peak_alloc_bytes") else "-"
        lines.append(f"| {r['set']} | {r['size']} | {lp['step_time_s'] * 1e3:.1f} | "
                     f"{m['step_time_s'] * 1e3:.1f} | {r['ratio']:.3f} | {metered} | "
                     f"{lp['peak_alloc_bytes'] / 2**20:.0f} | {mpeak} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--sizes", default="2048,4160")
    p.add_argument("--sets", default=",".join(SETS), help=f"comma-separated among {list(SETS)}")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10, help="timed steps per side")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_overhead needs a CUDA GPU", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for size in (int(s) for s in args.sizes.split(",")):
        for name in args.sets.split(","):
            techniques = SETS[name]
            loop = time_loop(size, techniques, args.warmup, args.steps)
            ours = time_memstudy(size, techniques, args.warmup, args.steps)
            rows.append({"set": name, "size": size, "loop": loop, "memstudy": ours,
                         "ratio": ours["step_time_s"] / loop["step_time_s"]})
            print(f"{name} {size} px: loop {loop['step_time_s'] * 1e3:.1f} ms, memstudy "
                  f"{ours['step_time_s'] * 1e3:.1f} ms, ratio {rows[-1]['ratio']:.3f}", flush=True)
    gpu = torch.cuda.get_device_name(0)
    (out / "overhead.json").write_text(json.dumps({"gpu": gpu, "torch": torch.__version__,
                                                   "rows": rows}, indent=1))
    text = markdown(rows, gpu)
    (out / "overhead.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
