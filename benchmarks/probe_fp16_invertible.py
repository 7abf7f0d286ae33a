"""Probe: why `amp:fp16` + `invertible` (Momentum-Net) diverges, traced on the CPU.

Trains the study's U-Net/ResNet-34 the way `memstudy run` does (the protocol's synthetic
phantoms, batch 1, Adam, 1 - MS-SSIM, the epoch order of memstudy.train) for a few variants
and records, at every step:
- the loss and the GradScaler's scale (and whether the scaler skipped the step);
- per momentum run (the `invertible` stages) and block: the largest |x| entering the block,
  the largest |f(x)|, the largest increment (1 - gamma)(f(x) - x) added to the velocity, its
  dtype, how many of its elements saturated momentumnet's int64 fixed point, and |v| after;
- every convolution's and BatchNorm's largest |output| (float16 overflows above 65504);
- the first module whose output holds a non-finite value (the forward NaN), if any.

float16 on the CPU (`--fp16`):
- `autocast`: torch.autocast("cpu", float16), exactly what `amp:fp16` installs (the technique
  itself refuses the CPU; the probe applies it directly). CPU float16 convolution *backward* is
  about 30x slower than float32 here (400 s a step at 512 px), so it is for forwards and
  short runs.
- `emulate` (default): no autocast; every Conv2d computes in float32 from float16-rounded input,
  weight and bias and returns float16, which is what autocast + cuDNN do on a GPU (float16 in,
  float32 accumulation, float16 out); the rest of the network then runs on those float16
  tensors as under autocast. The report gives the largest difference between the two forwards.

int64 conversion of inf (`--int64-cast`): momentumnet stores the velocity as int64(v * 2**52).
A CUDA GPU saturates an out-of-range float -> int64 conversion (inf -> 2**63 - 1, -inf ->
-2**63; PTX cvt clamps); an x86 CPU returns -2**63 for any out-of-range value. `cuda` (default)
makes the CPU do what the GPU did; `native` leaves the CPU's conversion.

`--unfixed` runs the code as it was before the fix in memstudy/techniques/invertible.py (a
float16 input enters the momentum run in float16): the recorded GPU runs used that code.

The result files of docs/paper.md, "Why AMP with Momentum-Net diverges" (192 px: at 512 px a
CPU step takes 25 s in float32 and ~400 s with autocast's float16 backward):
    python benchmarks/probe_fp16_invertible.py --size 192 --steps 200 --max-minutes 12 \\
        --threads 1 --unfixed --variants amp:fp16,invertible --tag=-unfixed
    python benchmarks/probe_fp16_invertible.py --size 192 --steps 12 --threads 1 \\
        --no-forward-check --variants amp:fp16,invertible invertible amp:fp16 \\
        --tag=-fixed-and-controls
Writes <out>/probe-<size>px<tag>.json and .md (default out: benchmarks/results/cpu/fp16-invertible).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import platform
import time
from pathlib import Path

import torch
from torch import nn

import momentumnet.exact_rep_pytorch as exact_rep
from memstudy.config import from_dict
from memstudy.datasets.dataset import build_datasets
from memstudy.quality import min_side
from memstudy.runner import seed_everything
from memstudy.techniques import get_technique, invertible
from memstudy.techniques.compose import build_pipeline, make_plan
from memstudy.train import make_batch

FP16_MAX = 65504.0
OUT = Path(__file__).resolve().parent / "results" / "cpu" / "fp16-invertible"
INT64_MIN, INT64_MAX = -2 ** 63, 2 ** 63 - 1


# ---------------------------------------------------------------------------- float16 on the CPU
class EmulatedFp16Conv:
    """Every nn.Conv2d: float16-rounded operands, float32 arithmetic, float16 output."""

    def __init__(self):
        self.original = nn.Conv2d._conv_forward

    def __enter__(self):
        original = self.original

        def conv(module, x, weight, bias):
            h = torch.float16
            b = bias.to(h).float() if bias is not None else None
            return original(module, x.to(h).float(), weight.to(h).float(), b).to(h)

        nn.Conv2d._conv_forward = conv
        return self

    def __exit__(self, *exc):
        nn.Conv2d._conv_forward = self.original


@contextlib.contextmanager
def int64_cast(mode: str):
    """momentumnet's float -> fixed point conversion, with the GPU's saturating int64 cast."""
    original = exact_rep.TorchExactRep.float_to_intrep
    if mode == "native":
        yield
        return

    def float_to_intrep(self, x):
        if type(x) is torch.Tensor:
            scaled = x * exact_rep.RADIX_SCALE  # in x's dtype, as momentumnet computes it
            out = scaled.long()
            out = torch.where(scaled >= 2.0 ** 63, torch.full_like(out, INT64_MAX), out)
            out = torch.where(scaled <= -2.0 ** 63, torch.full_like(out, INT64_MIN), out)
            return torch.where(scaled.isnan(), torch.zeros_like(out), out)
        return original(self, x)

    exact_rep.TorchExactRep.float_to_intrep = float_to_intrep
    try:
        yield
    finally:
        exact_rep.TorchExactRep.float_to_intrep = original


@contextlib.contextmanager
def unfixed(on: bool):
    """The code before the fix: the run's input enters momentumnet in its own dtype."""
    original = invertible.velocity_input
    if on:
        invertible.velocity_input = lambda x: x
    try:
        yield
    finally:
        invertible.velocity_input = original


# ---------------------------------------------------------------------------- the recorder
def amax(t: torch.Tensor) -> float:
    """Largest |value| (inf if any is inf, nan if any is NaN)."""
    t = t.detach()
    if t.numel() == 0:
        return 0.0
    if t.isnan().any():
        return math.nan
    return float(t.abs().max().float())


class Recorder:
    """Forward hooks and momentumnet's velocity updates, per step."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.step: dict = {}
        self.run_name: str | None = None
        self.block_index = 0
        self.handles = []
        self.names = {m: n for n, m in model.named_modules()}
        for name, module in model.named_modules():
            if isinstance(module, invertible.MomentumBlocks):
                self.handles.append(module.register_forward_pre_hook(self._run_start))
            if isinstance(module, invertible._Replayable):
                self.handles.append(module.register_forward_hook(self._block))
            if isinstance(module, (nn.Conv2d, nn.modules.batchnorm._BatchNorm)):
                self.handles.append(module.register_forward_hook(self._layer))
            if len(list(module.children())) == 0 or isinstance(module, invertible._Replayable):
                self.handles.append(module.register_forward_hook(self._finite))
        self.original_add = exact_rep.TorchExactRep.add
        recorder = self

        def add(rep, a):
            before = rep.intrep.clone() if torch.is_tensor(a) else None
            out = recorder.original_add(rep, a)
            if torch.is_tensor(a):
                recorder._velocity(rep, a, before)
            return out

        exact_rep.TorchExactRep.add = add

    def close(self):
        exact_rep.TorchExactRep.add = self.original_add
        for h in self.handles:
            h.remove()

    def begin(self, step: int):
        self.step = {"step": step, "blocks": [], "layers": {}, "first_nonfinite": None,
                     "rebuild_v_max": 0.0}
        self.in_forward = True  # False from the backward on: rebuilds are not the forward

    # hooks
    def _run_start(self, module, args):
        self.run_name, self.block_index = self.names[module], 0

    def _block(self, module, args, out):
        if module.replay_autocast is not None or not self.in_forward:  # the rebuild in backward
            return
        self.step["blocks"].append({"run": self.run_name, "block": self.block_index,
                                    "x_max": amax(args[0]), "x_dtype": str(args[0].dtype)[6:],
                                    "f_max": amax(out)})

    def _velocity(self, rep, a, before):
        if not self.in_forward:  # momentumnet's backward: the rebuilt velocity
            self.step["rebuild_v_max"] = max(self.step["rebuild_v_max"], amax(rep.val))
            return
        blocks = self.step["blocks"]
        if not blocks:
            return
        inc = exact_rep.TorchExactRep.float_to_intrep(rep, a)
        saturated = int(((inc == INT64_MIN) | (inc == INT64_MAX)).sum())
        blocks[-1].update({"increment_max": amax(a), "increment_dtype": str(a.dtype)[6:],
                           "saturated": saturated, "saturated_share": saturated / a.numel(),
                           "v_max": amax(rep.val)})
        self.block_index += 1

    def _layer(self, module, args, out):
        if not self.in_forward:  # the rebuild / checkpoint recomputation in backward
            return
        name = self.names[module]
        value = amax(out)
        prev = self.step["layers"].get(name)
        if prev is None or not (value <= prev):  # first call of a step, or larger (nan wins)
            self.step["layers"][name] = value

    def _finite(self, module, args, out):
        if not self.in_forward or self.step.get("first_nonfinite") or not torch.is_tensor(out):
            return
        if not torch.isfinite(out.detach()).all():
            inputs_finite = all(torch.isfinite(a.detach()).all() for a in args
                                if torch.is_tensor(a) and a.is_floating_point())
            self.step["first_nonfinite"] = {
                "module": self.names[module], "type": type(module).__name__,
                "inputs_finite": bool(inputs_finite), "out_dtype": str(out.dtype)[6:],
                "inputs_max": [amax(a) for a in args if torch.is_tensor(a)]}

    def summary(self) -> dict:
        s = self.step
        layers = s["layers"]
        def largest(d):
            return max(d.items(), key=lambda kv: (math.isnan(kv[1]), kv[1])) if d else (None, 0)
        top = largest(layers)
        top_conv = largest({k: v for k, v in layers.items() if "encoder." in k
                            and isinstance(self.model.get_submodule(k), nn.Conv2d)})
        blocks = s["blocks"]
        return {
            "step": s["step"],
            "layer_max": top[1], "layer_max_at": top[0],
            "encoder_conv_max": top_conv[1], "encoder_conv_max_at": top_conv[0],
            "block_x_max": max((b["x_max"] for b in blocks), default=0.0),
            "v_max": max((b.get("v_max", 0.0) for b in blocks), default=0.0),
            "saturated": sum(b.get("saturated", 0) for b in blocks),
            "rebuild_v_max": s["rebuild_v_max"],
            "first_nonfinite": s["first_nonfinite"],
        }


# ---------------------------------------------------------------------------- one variant
def config_for(techniques: list[str], args) -> dict:
    return {"techniques": techniques, "train": {
        "image_size": args.size, "batch_size": 1, "epochs": 50, "lr": args.lr,
        "optimizer": "adam", "seed": args.seed, "device": "cpu", "validate": False},
        "data": {"source": "synthetic", "train_images": args.train_images, "val_images": 1,
                 "seed": 0}}


def build(variant: str, args):
    techniques = [t for t in variant.split(",") if t and t != "original"]
    amp = [t for t in techniques if t.startswith("amp")]
    rest = [t for t in techniques if not t.startswith("amp")]
    cfg = from_dict(config_for(rest, args))
    plan = make_plan(cfg)  # amp:fp16 refuses the CPU: applied below, as amp.apply does
    train_set, _ = build_datasets(cfg.data, cfg.train.image_size, 1, min_side(cfg.train))
    seed_everything(cfg.train.seed)
    b = build_pipeline(plan)
    fp16 = bool(amp)
    if fp16:
        tech = get_technique("amp")
        opts = tech.parse(amp[0].split(":")[1:])
        if args.fp16 == "autocast":
            tech.apply(opts, b)  # autocast("cpu", float16) + GradScaler("cpu", 65536)
        else:
            b.runtime.scaler = torch.amp.GradScaler("cpu", init_scale=opts.init_scale)
    return cfg, b, train_set, fp16


def train_variant(variant: str, args, fixed: bool) -> dict:
    cfg, b, train_set, fp16 = build(variant, args)
    rt, model = b.runtime, b.model
    optimizer = rt.optimizer_factory(model)
    emulate = fp16 and args.fp16 == "emulate"
    rec = Recorder(model)
    steps, started, outcome = [], time.perf_counter(), "ok"
    detail_steps = {}
    with EmulatedFp16Conv() if emulate else contextlib.nullcontext(), \
            int64_cast(args.int64_cast), unfixed(not fixed):
        step = 0
        for epoch in range(cfg.train.epochs):
            model.train()
            order = torch.randperm(len(train_set),
                                   generator=torch.Generator().manual_seed(cfg.train.seed + epoch))
            for i in order.tolist():
                if step >= args.steps or time.perf_counter() - started > args.max_minutes * 60:
                    break
                step += 1
                x, y = make_batch(train_set, [i], torch.device("cpu"))
                rec.begin(step)
                scale = rt.scaler.get_scale() if rt.scaler is not None else None
                loss = rt.forward(model, x, y)
                value = float(loss.detach())
                row = rec.summary()
                row.update({"loss": value, "scale": scale})
                if not math.isfinite(value):
                    steps.append(row)
                    detail_steps["diverged"] = rec.step
                    outcome = f"diverged: loss {value} at step {step} (forward)"
                    break
                rec.in_forward = False
                rt.backward(loss)
                rt.step(optimizer)
                if rt.scaler is not None:
                    row["skipped"] = rt.scaler.get_scale() < scale
                row["rebuild_v_max"] = rec.step["rebuild_v_max"]
                steps.append(row)
                if step == 1:
                    detail_steps["first"] = rec.step
                detail_steps["last"] = rec.step
                if args.verbose and (step % 10 == 0 or step == 1):
                    print(f"  {variant} step {step} loss {value:.4f} scale {scale} "
                          f"block|x| {row['block_x_max']:.4g} |v| {row['v_max']:.4g} "
                          f"enc conv {row['encoder_conv_max']:.4g} ({row['encoder_conv_max_at']})",
                          flush=True)
            else:
                continue
            break
    rec.close()
    elapsed = time.perf_counter() - started
    return {"variant": variant, "fixed": fixed, "outcome": outcome, "steps_run": len(steps),
            "seconds": round(elapsed, 1), "steps": steps, "detail": detail_steps,
            "fp16": args.fp16 if fp16 else None}


def forward_check(args) -> dict:
    """One forward at step 0: autocast vs emulated float16, unfixed: the largest difference
    of the model output, and the first momentum block's velocity under each."""
    out = {}
    for mode in ("autocast", "emulate"):
        a = argparse.Namespace(**{**vars(args), "fp16": mode})
        cfg, b, train_set, _ = build("amp:fp16,invertible", a)
        x, y = make_batch(train_set, [0], torch.device("cpu"))
        rec = Recorder(b.model)
        rec.begin(0)
        with EmulatedFp16Conv() if mode == "emulate" else contextlib.nullcontext(), \
                int64_cast(args.int64_cast), unfixed(True), torch.no_grad():
            with b.runtime.forward_context():
                y_hat = b.model(x)
        rec.close()
        out[mode] = {"output": y_hat.float(), "blocks": rec.step["blocks"][:2]}
    diff = float((out["autocast"]["output"] - out["emulate"]["output"]).abs().max())
    return {"max_output_difference": diff,
            "autocast_first_blocks": out["autocast"]["blocks"],
            "emulate_first_blocks": out["emulate"]["blocks"]}


# ---------------------------------------------------------------------------- report
def markdown(result: dict) -> str:
    a = result["args"]
    lines = [f"# amp:fp16 + invertible on the CPU: {a['size']} px, seed {a['seed']}, "
             f"lr {a['lr']}, up to {a['steps']} steps", "",
             f"float16: {a['fp16']}; int64 cast of inf: {a['int64_cast']}; "
             f"torch {result['torch']}.", ""]
    fc = result.get("forward_check")
    if fc:
        lines += [f"Step-0 forward, autocast vs emulated float16 (before the fix): largest output "
                  f"difference {fc['max_output_difference']:.3g}.", ""]
    lines += ["| variant | code | outcome | steps | loss step 1 / 10 / last | max block |x| "
              "| max |v| | max encoder conv |out| (where) | saturated velocity elements "
              "| scale first / last, skipped |", "|" + "---|" * 10]
    for r in result["variants"]:
        s = r["steps"]
        if not s:
            continue

        def loss_at(k):
            return f"{s[k - 1]['loss']:.4f}" if len(s) >= k else "-"
        worst = max(s, key=lambda row: (math.isnan(row["encoder_conv_max"]),
                                        row["encoder_conv_max"]))
        skipped = sum(bool(row.get("skipped")) for row in s)
        scale = f"{s[0]['scale']:.0f} / {s[-1]['scale']:.0f}, {skipped}" \
            if s[0]["scale"] is not None else "-"
        lines.append(
            f"| {r['variant']} | {'fixed' if r['fixed'] else 'unfixed'} | {r['outcome']} "
            f"| {r['steps_run']} | {loss_at(1)} / {loss_at(10)} / {s[-1]['loss']:.4g} "
            f"| {max(row['block_x_max'] for row in s):.4g} | {max(row['v_max'] for row in s):.4g} "
            f"| {worst['encoder_conv_max']:.4g} (step {worst['step']}, "
            f"{worst['encoder_conv_max_at']}) | {s[0]['saturated']} at step 1 | {scale} |")
        nf = s[-1].get("first_nonfinite")
        if nf:
            lines.append(f"|  | first non-finite | {nf['module']} ({nf['type']}, "
                         f"{nf['out_dtype']}), inputs finite: {nf['inputs_finite']}, "
                         f"input max {nf['inputs_max']} |||||||")
    lines.append("")
    for r in result["variants"]:
        first = r["detail"].get("first")
        if not first:
            continue
        lines += [f"## {r['variant']} ({'fixed' if r['fixed'] else 'unfixed'}): momentum blocks "
                  "at step 1", "", "| run | block | x dtype | max |x| | max |f(x)| "
                  "| max increment (dtype) | saturated share | max |v| after |", "|" + "---|" * 8]
        for bl in first["blocks"]:
            lines.append(f"| {bl['run']} | {bl['block']} | {bl['x_dtype']} | {bl['x_max']:.4g} "
                         f"| {bl['f_max']:.4g} | {bl.get('increment_max', 0):.4g} "
                         f"({bl.get('increment_dtype', '-')}) | {bl.get('saturated_share', 0):.3f} "
                         f"| {bl.get('v_max', 0):.4g} |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", nargs="+",
                   default=["amp:fp16,invertible", "invertible", "amp:fp16"],
                   help="technique sets, comma-separated (amp:fp16 applied on the CPU)")
    p.add_argument("--size", type=int, default=512, help="image side in px (protocol: 512)")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps per variant")
    p.add_argument("--max-minutes", type=float, default=15.0, help="per variant")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--train-images", type=int, default=48)
    p.add_argument("--fp16", choices=("emulate", "autocast"), default="emulate")
    p.add_argument("--int64-cast", choices=("cuda", "native"), default="cuda")
    p.add_argument("--unfixed", action="store_true",
                   help="run invertible as before the fix (float16 run input)")
    p.add_argument("--fixed-too", action="store_true",
                   help="with --unfixed: also run the fp16 + invertible variants with the fix")
    p.add_argument("--no-forward-check", action="store_true")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--tag", default="", help="suffix of the result files")
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    result = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "torch": torch.__version__, "python": platform.python_version(), "variants": []}
    if not args.no_forward_check:
        result["forward_check"] = forward_check(args)
        print("forward check:", json.dumps(result["forward_check"])[:600], flush=True)
    runs = [(v, not args.unfixed) for v in args.variants]
    if args.unfixed and args.fixed_too:
        runs += [(v, True) for v in args.variants if "amp:fp16" in v and "invertible" in v]
    for variant, fixed in runs:
        print(f"{variant} ({'fixed' if fixed else 'unfixed'})", flush=True)
        r = train_variant(variant, args, fixed)
        print(f"  -> {r['outcome']} after {r['steps_run']} steps, {r['seconds']} s", flush=True)
        result["variants"].append(r)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"probe-{args.size}px{args.tag}"
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    (args.out / f"{stem}.md").write_text(markdown(result) + "\n")
    print(f"wrote {args.out / stem}.json and .md")
    return result


if __name__ == "__main__":
    main()
