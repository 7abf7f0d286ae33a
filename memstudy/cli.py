"""`memstudy` command line: run, techniques (grid, maxres and report join as they land)."""
from __future__ import annotations

import argparse
import sys

from memstudy.config import RunConfig, load_toml, set_value, split_techniques
from memstudy.errors import MemstudyError
from memstudy.runner import eprint, execute
from memstudy.store import ResultsDB, default_db_path
from memstudy.tables import phase_table
from memstudy.units import mb


def add_run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML file with [train], [data], [meter] tables and techniques")
    p.add_argument("--size", type=int, help="square image size in px (train.image_size)")
    p.add_argument("--batch-size", type=int, help="train.batch_size")
    p.add_argument("--epochs", type=int, help="train.epochs")
    p.add_argument("--steps", type=int, help="stop after this many optimizer steps (train.max_steps)")
    p.add_argument("--device", help="auto, cpu, cuda or cuda:N (train.device)")
    p.add_argument("--seed", type=int, help="train.seed and data.seed")
    p.add_argument("--data", help="'synthetic' (default) or a folder of radiographs")
    p.add_argument("-t", "--techniques", help="comma-separated, e.g. amp:bf16,checkpoint:block "
                   "(see `memstudy techniques`)")
    p.add_argument("--budget", help="device memory cap, e.g. 8GiB")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="any other setting, e.g. --set train.lr=1e-4 --set data.train_images=8")
    p.add_argument("--label", help="free text stored with the run")


def config_from_args(args: argparse.Namespace) -> RunConfig:
    cfg = load_toml(args.config) if args.config else RunConfig()
    t = cfg.train
    for flag, attr in (("size", "image_size"), ("batch_size", "batch_size"), ("epochs", "epochs"),
                       ("steps", "max_steps"), ("device", "device")):
        if getattr(args, flag) is not None:
            setattr(t, attr, getattr(args, flag))
    if args.seed is not None:
        t.seed = cfg.data.seed = args.seed
    if args.data is not None:
        cfg.data.source, cfg.data.path = (("synthetic", None) if args.data == "synthetic"
                                          else ("folder", args.data))
    if args.techniques is not None:
        cfg.techniques = split_techniques(args.techniques)
    if args.budget is not None:
        cfg.budget = args.budget
    if args.label is not None:
        cfg.label = args.label
    for assignment in args.set:
        set_value(cfg, assignment)
    return cfg


def cmd_run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    db = ResultsDB(args.db)
    rec = execute(cfg, db, progress=None if args.quiet else eprint)
    print(summarize(rec))
    print(f"stored in {db.path}")
    return 0 if rec.status == "ok" else 1


def summarize(rec) -> str:
    t = rec.config["train"]
    head = (f"{rec.name} | {t['image_size']} px | batch {t['batch_size']} | {rec.env.get('gpu_name') or rec.env['device']}"
            f" | status {rec.status}" + (f" in {rec.failed_phase}: {rec.error}" if rec.failed_phase else ""))
    metrics: dict[str, dict[str, float]] = {}
    for _rank, phase, name, value in rec.metrics:
        metrics.setdefault(phase, {})[name] = value
    lines = [head]
    if any(p in metrics for p in ("forward", "backward", "step")):
        lines.append(phase_table(metrics))
    run = metrics.get("run", {})
    if "step_time_s" in run:
        extra = ""
        if "meter_overhead" in run:
            extra = f" (metered {run['metered_step_time_s']:.3f} s, meter overhead {run['meter_overhead']:+.1%})"
        lines.append(f"time per step {run['step_time_s']:.3f} s{extra} | "
                     f"{run['throughput_px_s'] / 1e6:.2f} Mpx/s")
    if "nvml_peak_total_bytes" in run:
        lines.append(f"peak allocated {mb(run['alloc_peak_total_bytes']):.1f} MB | NVML device used "
                     f"peak {mb(run['nvml_peak_total_bytes']):.1f} MB (CUDA context included)")
    for e in rec.epochs:
        val = f" val loss {e['val_loss']:.4f}" if e.get("val_loss") is not None else ""
        tl = f"{e['train_loss']:.4f}" if e.get("train_loss") is not None else "-"
        lines.append(f"epoch {e['epoch'] + 1}: train loss {tl}{val} ({e['time_s']:.1f} s)")
    return "\n".join(lines)


def cmd_techniques(args: argparse.Namespace) -> int:
    import dataclasses

    from memstudy.techniques import list_techniques

    for tech in list_techniques():
        print(f"{tech.name}  [{tech.stage.name.lower()}]  {tech.summary}")
        for f in dataclasses.fields(tech.options):
            choices = f.metadata.get("choices")
            extra = f" one of {list(choices)}" if choices else ""
            print(f"    {f.name} = {f.default!r}{extra}  {f.metadata.get('help', '')}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="memstudy", description=__doc__)
    parser.add_argument("--db", default=default_db_path(), help="results database (SQLite)")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="train one configuration and record its per-phase memory")
    add_run_args(run)
    run.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    run.set_defaults(func=cmd_run)
    tech = sub.add_parser("techniques", help="list techniques and their options")
    tech.set_defaults(func=cmd_techniques)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except MemstudyError as exc:
        print(f"memstudy: error: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:  # data errors (ImageError) and byte sizes
        print(f"memstudy: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
