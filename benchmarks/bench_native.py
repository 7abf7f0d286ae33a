"""Native resolution on one GPU (issue 12): 4188 x 4188 phantoms, per-phase memory, the
validation peak with and without tiling, and the MS-SSIM loss's share of memory.

Runs, each a short ordinary run (1 warm-up + 2 measured steps on 3 phantoms, then one
validation image) recorded in --out/native.sqlite:
- 4188 px amp:bf16, and amp:bf16 + checkpoint + offload, each with tiled validation
  (train.val_tile_rows, the default) and untiled (val_tile_rows = 0) where the setting exists;
- the loss's share at 2048 and 4188 px under amp:bf16: pytorch-msssim's own autograd
  (train.loss_chunk_rows = 0) beside the chunked loss (the default).
Writes --out/native.md (tables) and --out/native.json (every run's figures).

    python benchmarks/bench_native.py --out results/native
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

from memstudy.cli import summarize
from memstudy.config import RunConfig, TrainConfig
from memstudy.runner import execute
from memstudy.store import ResultsDB

MB = 2 ** 20
HAS_VAL_TILES = "val_tile_rows" in {f.name for f in dataclasses.fields(TrainConfig)}


def config(size: int, techniques: list[str], **train) -> RunConfig:
    cfg = RunConfig(techniques=list(techniques))
    t = cfg.train
    t.image_size, t.device, t.epochs, t.max_steps = size, "cuda", 1, 3
    t.warmup_steps, t.measure_steps = 1, 2
    cfg.data.train_images, cfg.data.val_images = 3, 1
    for key, value in train.items():
        setattr(t, key, value)
    cfg.label = "native " + ",".join(f"{k}={v}" for k, v in train.items())
    return cfg


def runs() -> list[tuple[str, RunConfig]]:
    plans = []
    for techniques in (["amp:bf16"], ["amp:bf16", "checkpoint", "offload"]):
        name = "+".join(techniques)
        plans.append((f"4188 {name}, tiled validation", config(4188, techniques)))
        if HAS_VAL_TILES:
            plans.append((f"4188 {name}, untiled validation",
                          config(4188, techniques, val_tile_rows=0)))
    for size in (2048, 4188):
        plans.append((f"{size} amp:bf16, pytorch-msssim loss",
                      config(size, ["amp:bf16"], loss_chunk_rows=0)))
        if size == 2048:
            plans.append((f"{size} amp:bf16, chunked loss", config(size, ["amp:bf16"])))
    return plans


def figures(rec) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for rank, phase, name, value in rec.metrics:
        if rank == 0:
            out.setdefault(phase, {})[name] = value
    return out


def _mb(x) -> str:
    return "-" if x is None else f"{x / MB:.0f}"


def loss_row(label: str, rec, m: dict) -> str:
    """Loss share: what the loss holds when backward starts (its saved tensors plus its own
    backward's peak) over the model's saved activations plus that."""
    f, b = m.get("forward", {}), m.get("backward", {})
    loss_saved, model_saved = f.get("cat_loss_saved_bytes"), f.get("cat_saved_bytes")
    at_backward = (loss_saved or 0) + (b.get("loss_peak_bytes") or 0)
    share = at_backward / (at_backward + model_saved) if model_saved else None
    peak = m.get("run", {}).get("alloc_peak_total_bytes")
    return (f"| {label} | {rec.status} | {_mb(model_saved)} | {_mb(loss_saved)} | "
            f"{_mb(f.get('loss_peak_bytes'))} | {_mb(b.get('loss_peak_bytes'))} | "
            f"{'-' if share is None else f'{share:.1%}'} | {_mb(peak)} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    db = ResultsDB(out / "native.sqlite")
    gpu = torch.cuda.get_device_name(0)
    lines = [f"# Native resolution on {gpu}\n",
             f"torch {torch.__version__}; each run: 1 warm-up + 2 measured steps, 1 validation "
             "image; figures are the maximum over measured steps (docs/metrics.md).\n"]
    loss_lines = ["\n## The MS-SSIM loss's memory (forward end / backward start)\n",
                  "model saved = the network's activations saved for backward (cat_saved_bytes); "
                  "loss saved = what the loss saved (cat_loss_saved_bytes); loss fwd / bwd peak = "
                  "loss_peak_bytes of forward / backward; share = (loss saved + loss bwd peak) / "
                  "(that + model saved).\n",
                  "| run | status | model saved MB | loss saved MB | loss fwd peak MB | "
                  "loss bwd peak MB | loss share | step peak MB |", "|---|---|---|---|---|---|---|---|"]
    val_lines = ["\n## Validation peak (eval forward + loss figures, one 4188 px image)\n",
                 "| run | status | validation peak MB | validation time s |", "|---|---|---|---|"]
    dump = {}
    for label, cfg in runs():
        t0 = time.perf_counter()
        rec = execute(cfg, db, progress=print)
        m = figures(rec)
        print(f"{label}: {rec.status} in {time.perf_counter() - t0:.0f} s", flush=True)
        dump[label] = {"status": rec.status, "error": rec.error, "metrics": m,
                       "config": rec.config, "data": rec.env.get("data")}
        lines += [f"\n## {label}\n", "```", summarize(rec), "```"]
        loss_lines.append(loss_row(label, rec, m))
        v = m.get("validation", {})
        peak = v.get("alloc_peak_bytes", v.get("tensor_peak_bytes"))  # GPU: allocator
        val_lines.append(f"| {label} | {rec.status} | {_mb(peak)} | "
                         f"{v.get('time_s', float('nan')):.2f} |")
        (out / "native.md").write_text("\n".join(lines + loss_lines + val_lines) + "\n")
        (out / "native.json").write_text(json.dumps(dump, indent=1, default=str))
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
