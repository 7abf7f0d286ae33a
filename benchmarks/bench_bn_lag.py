"""Why validation early in training is not a quality figure: BatchNorm's running statistics lag.

Trains the U-Net step by step from one initialisation, once per precision, and after every
step records, at the first decoder convolution (the layer whose eval-mode output overflowed
float16 at 2048 px): the largest |activation| in the training-mode forward, the largest in an
eval-mode forward of the validation images, how far BatchNorm's running mean lags the batch
mean (in batch standard deviations, worst channel) and the validation loss (eval mode, same
precision). Writes DIR/bn_lag.md; docs/metrics.md ("Validation early in training") reads it.

    python benchmarks/bench_bn_lag.py --out benchmarks/results/cpu/bn-lag --device cpu --size 512
    python benchmarks/bench_bn_lag.py --out $OUT --size 2048 --precisions fp32,fp16
"""
from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from memstudy import env as envinfo  # noqa: E402
from memstudy.config import RunConfig  # noqa: E402
from memstudy.datasets import build_datasets  # noqa: E402
from memstudy.models.unet import build_unet  # noqa: E402
from memstudy.quality import MSSSIMLoss, quality  # noqa: E402
from memstudy.techniques.amp import set_tf32  # noqa: E402
from memstudy.train import make_batch  # noqa: E402

LAYER = "net.decoder.blocks.0.conv1"  # [0] the convolution, [1] its BatchNorm
DTYPES = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}


def autocast(device: torch.device, precision: str):
    dtype = DTYPES[precision]
    return torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None)


def trace(base, precision: str, args, train_set, val_batch, device) -> list[dict]:
    model = copy.deepcopy(base).to(device).train()
    conv, bn = (dict(model.named_modules())[f"{LAYER}.{i}"] for i in (0, 1))
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    loss_fn, seen, rows = MSSSIMLoss(5), {}, []
    hook = conv.register_forward_hook(lambda m, i, o: seen.__setitem__("out", o.detach().float()))
    xv, yv = val_batch
    for step in range(1, args.steps + 1):
        order = torch.randperm(len(train_set), generator=torch.Generator().manual_seed(step))
        x, y = make_batch(train_set, order[:args.batch_size].tolist(), device)
        with autocast(device, precision):
            out = model(x)
        loss = loss_fn(out, y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        act = seen["out"]
        mean, std = act.mean((0, 2, 3)), act.std((0, 2, 3)).clamp_min(1e-6)
        lag = ((bn.running_mean - mean).abs() / std).max().item()
        train_max = act.abs().max().item()
        model.eval()
        with torch.no_grad(), autocast(device, precision):
            val_out = model(xv)
        model.train()
        rows.append({"step": step, "train_loss": loss.item(), "train_max": train_max,
                     "eval_max": seen["out"].abs().max().item(), "lag": lag,
                     "val_loss": quality(val_out, yv, 5)["loss"]})
        print(f"{precision} step {step:3d} " + " ".join(f"{k} {v:.4g}" for k, v in rows[-1].items()
                                                         if k != "step"), flush=True)
    hook.remove()
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--size", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--precisions", default="fp32")
    args = p.parse_args()
    precisions = args.precisions.split(",")
    for name in precisions:
        if name not in DTYPES:
            p.error(f"--precisions: unknown {name!r}; choose from {', '.join(DTYPES)}")
    device = torch.device(args.device)
    set_tf32(False)
    cfg = RunConfig()
    cfg.data.train_images, cfg.data.val_images = 16, 2
    train_set, val_set = build_datasets(cfg.data, args.size)
    val_batch = make_batch(val_set, list(range(len(val_set))), device)
    base = build_unet(cfg.encoder_weights, seed=cfg.train.seed)
    traces = {name: trace(base, name, args, train_set, val_batch, device) for name in precisions}
    env = envinfo.describe(device)
    where = env.get("gpu_name") or f"CPU ({env.get('cpu_count', '?')} cores)"
    lines = [f"# BatchNorm lag early in training ({where}, {args.size} px, batch {args.batch_size}, "
             f"Adam lr {args.lr}, torch {torch.__version__})", "",
             f"Layer `{LAYER}.0`. max |act|: largest absolute output of that convolution in the "
             "training-mode step (batch statistics) and in an eval-mode forward of the 2 "
             "validation images (running statistics). lag: worst channel's |running mean - "
             "batch mean| / batch std at the next BatchNorm. val loss: 1 - MS-SSIM, eval mode, "
             "same precision.", ""]
    head = "| step | " + " | ".join(f"{n} train loss | {n} max act train / eval | {n} lag | {n} val loss"
                                    for n in precisions) + " |"
    lines += [head, "|" + "---|" * (1 + 4 * len(precisions))]
    for i in range(args.steps):
        cells = []
        for n in precisions:
            r = traces[n][i]
            cells.append(f"{r['train_loss']:.4f} | {r['train_max']:.0f} / {r['eval_max']:.0f} | "
                         f"{r['lag']:.2f} | {r['val_loss']:.4f}")
        lines.append(f"| {i + 1} | " + " | ".join(cells) + " |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bn_lag.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out / 'bn_lag.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
