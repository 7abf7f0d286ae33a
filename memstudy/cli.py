"""`memstudy` command line: run, techniques, grid, maxres, report, advise, tune."""
from __future__ import annotations

import argparse
import os
import signal
import sqlite3
import sys
from pathlib import Path

from memstudy.config import RunConfig, load_toml, set_value, split_techniques
from memstudy.errors import ConfigError, MemstudyError
from memstudy.phases import TRAIN_PHASES
from memstudy.console import eprint
from memstudy.techniques import check_early, parse_techniques
from memstudy.image_sizes import check_input_fits, parse_size
from memstudy.store import RANK_MAX, RANK_MEAN, ResultsDB, check_writable, default_db_path
from memstudy.text_table import phase_table
from memstudy.did_train import describe, loss_ranges
from memstudy.byte_sizes import mb, size_text


def add_run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML file with [train], [data], [meter] tables and techniques")
    p.add_argument("--size", help="train.image_size: 4188 (square), 4188x3500 (height x width) "
                   "or native (folder data: each image at its own size)")
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
    # config, size, budget, technique, option and file errors before torch loads; what it
    # parsed is handed down, so the run parses nothing again
    checked = check_early(cfg)
    check_input_fits(cfg.train.image_size, cfg.train.batch_size)  # refused, never recorded
    if args.dry_run:
        print(dry_run(cfg, checked))
        return 0
    check_writable(args.db)  # before anything trains: a run that cannot be stored is lost
    from memstudy.launch_ranks import launched_by_torchrun, run_distributed
    from memstudy.runner import execute

    if cfg.world_size > 1 or launched_by_torchrun():  # docs/distributed.md
        rec = run_distributed(cfg, args.db, None if args.quiet else eprint)
        if rec is None:  # a torchrun rank other than 0: rank 0 reports the run
            return 0
        print(summarize(rec))
        print(f"stored in {args.db}")
        return 0 if rec.status == "ok" else 1
    db = ResultsDB(args.db)
    rec = execute(cfg, db, progress=None if args.quiet else eprint, checked=checked)
    print(summarize(rec))
    print(f"stored in {db.path}")
    return 0 if rec.status == "ok" else 1


def dry_run(cfg: RunConfig, checked) -> str:
    """The run planned as `memstudy run` would plan it (every refusal included), and what each
    technique says of how it resolves; nothing built, trained or recorded. A CUDA device is
    planned as one GPU of that kind even where this machine has none."""
    import torch

    from memstudy.techniques.compose import make_plan

    device = str(cfg.train.device)
    cuda = torch.device(device) if device.startswith("cuda") else None
    plan = make_plan(cfg, checked=checked, device=cuda, n_gpus=None if cuda is None else 1)
    t, network = cfg.train, cfg.model
    lines = [f"planned: {t.image_size} px, batch {t.batch_size}, {plan.device}, budget "
             f"{size_text(plan.budget_bytes) if plan.budget_bytes else 'none'}, "
             f"{network.factory or network.encoder + ' U-Net'}, {t.task}",
             "techniques: " + (", ".join(plan.applied()) or "none")]
    for name, options in plan.chosen.items():
        if (said := plan.techniques[name].explained(options, plan)):
            lines.append(said)
    return "\n".join([*lines, "nothing trained or recorded (--dry-run)"])


def not_trained_reason(rec) -> str:
    """'' unless the run did not train: then why it is flagged (memstudy.did_train)."""
    return describe(rec.trained, loss_ranges(rec.series))


def summarize(rec) -> str:
    t = rec.config["train"]
    head = (f"{rec.name} | {t['image_size']} px | batch {t['batch_size']} | {rec.env.get('gpu_name') or rec.env['device']}"
            f" | status {rec.status}" + (f" in {rec.failed_phase}: {rec.error}" if rec.failed_phase else "")
            + (f" | {why}" if (why := not_trained_reason(rec)) else ""))
    metrics: dict[str, dict[str, float]] = {}
    world = rec.config.get("world_size", 1)
    shown = 0 if world == 1 else RANK_MAX  # distributed: the maximum over ranks decides fit
    for rank, phase, name, value in rec.metrics:
        if rank == shown:
            metrics.setdefault(phase, {})[name] = value
    lines = [head]
    for note in rec.env.get("notes", {}).values():  # what a technique says of how it ran
        if isinstance(note, dict) and "says" in note:
            lines.append(note["says"])
    if world > 1:
        lines.append(f"per-rank maximum over {world} ranks (each rank's rows, and the mean as "
                     f"rank {RANK_MEAN}, are in the database)")
    if any(p in metrics for p in TRAIN_PHASES):
        lines.append(phase_table(metrics))
    run = metrics.get("run", {})
    if "step_time_s" in run:
        extra = ""
        if "meter_overhead" in run:
            extra = f" (metered {run['metered_step_time_s']:.3f} s, meter overhead {run['meter_overhead']:+.1%})"
        lines.append(f"time per step {run['step_time_s']:.3f} s{extra} | "
                     f"{run['throughput_px_s'] / 1e6:.2f} Mpx/s | "
                     f"{run.get('model_tflops_s', float('nan')):.2f} model TFLOP/s")
    if "nvml_process_peak_bytes" in run:
        lines.append(f"peak allocated {mb(run['alloc_peak_total_bytes']):.1f} MB | this process's "
                     f"device memory peak {mb(run['nvml_process_peak_bytes']):.1f} MB (NVML, CUDA "
                     "context included)")
    elif "nvml_peak_total_bytes" in run:
        lines.append(f"peak allocated {mb(run['alloc_peak_total_bytes']):.1f} MB | NVML device used "
                     f"peak {mb(run['nvml_peak_total_bytes']):.1f} MB (CUDA context included)")
    if "host_peak_bytes" in run:
        lines.append(f"host memory peak {mb(run['host_peak_bytes']):.1f} MB (the process's "
                     "resident set)")
    if others := run.get("gpu_other_processes"):
        lines.append(f"the GPU was shared: {others:.0f} other process(es) held a CUDA context on it "
                     "during the run, so its times, energy and NVML peak include their work "
                     "(the reports leave this run's times out; its allocator figures are its own)")
    for e in rec.epochs:
        val = f" val loss {e['val_loss']:.4f}" if e.get("val_loss") is not None else ""
        if e.get("val_dice") is not None:  # segmentation (train.task): its validation figures
            val += f" Dice {e['val_dice']:.4f} IoU {e['val_iou']:.4f}"
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


def cmd_grid(args: argparse.Namespace) -> int:
    from memstudy.grid import cell_table, expand, load_spec, plan_outcomes, run_grid
    from memstudy.grid.claims import parse_retry
    from memstudy.grid.scheduler import check_gpu_needs, check_sharing

    retry = parse_retry(args.retry)
    spec = load_spec(args.spec)
    if args.budget is not None:
        spec.budget = args.budget
    if args.timeout is not None:
        spec.timeout_s = args.timeout
    if args.seeds is not None:
        spec.seeds = pick_seeds(spec.seeds, args.seeds, args.spec)
    gpus = [g.strip() for g in args.gpus.split(",")] if args.gpus else None
    if not args.dry_run:
        check_writable(args.db)
    if args.dry_run:
        cells = expand(spec)
        check_sharing(cells, args.cells_per_gpu)
        check_gpu_needs(cells, gpus)
        print(cell_table(cells, plan_outcomes(cells, ResultsDB(args.db), retry)))
        return 0
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM stops cells as Ctrl-C does
    try:
        result = (_run_grid_jobs(spec, args) if args.launcher != "processes" else
                  run_grid(spec, args.db, gpus, progress=None if args.quiet else eprint,
                           retry=retry, per_gpu=args.cells_per_gpu,
                           start_within=args.start_within))
    except KeyboardInterrupt:
        eprint("interrupted: recorded cells are kept; the cells that were running left no "
               "record and the same command runs them")
        return 130
    print(cell_table(result.cells, result.outcomes))
    print(f"stored in {args.db}")
    for line in rerun_advice(result.outcomes, args):
        eprint(line)
    if result.not_started:
        eprint(f"{len(result.not_started)} cells not started (--start-within {args.start_within:g}"
               " s had passed); the same command runs them")
    if result.failed:  # exit 1 (docs/grid.md): a script must not take the grid for complete
        eprint(f"{len(result.failed)} of the {len(result.ran)} cells run here ended in error, "
               "timeout or without a record; exit status 1")
    return 1 if result.failed else 0


def pick_seeds(spec_seeds: list[int], given: str, spec_path: str) -> list[int]:
    """--seeds: the spec's seeds to run now, in the order given (a cell's hash does not depend
    on which seeds run with it, so a later run of the whole spec skips these cells)."""
    try:
        seeds = [int(s) for s in given.split(",")]
    except ValueError:
        raise ConfigError(f"--seeds {given!r}: give comma-separated integers, e.g. --seeds 0,2")
    if stray := [s for s in seeds if s not in spec_seeds]:
        raise ConfigError(f"--seeds {given}: seed {stray[0]} is not among {spec_path}'s seeds "
                          f"{spec_seeds}; give some of those")
    return seeds


def rerun_advice(outcomes: dict[int, str], args: argparse.Namespace) -> list[str]:
    """For cells that ended badly: the command that runs them again (a plain rerun skips them)."""
    from memstudy.grid.claims import RETRY_KINDS

    kinds = {"timeout" if o == "error in timeout" else o.split()[0] for o in outcomes.values()}
    failed = [k for k in RETRY_KINDS if k in kinds]
    if not failed:
        return []
    again = f"memstudy --db {args.db} grid {args.spec} --retry {','.join(failed)}"
    longer = " --timeout SECONDS (longer than the spec's timeout_s)" if "timeout" in failed else ""
    return [f"cells ended in {', '.join(failed)} (their logs: {_cells_folder(args.db)}); a "
            f"plain rerun skips them; to run them again: {again}{longer}"]


def _cells_folder(db: str) -> str:
    from memstudy.grid import cells_folder

    return str(cells_folder(db))


def _run_grid_jobs(spec, args: argparse.Namespace):
    """A grid whose cells are submitit jobs (docs/grid.md, "On a Slurm cluster")."""
    from memstudy.grid.slurm import run_grid_submitit

    if args.gpus or args.cells_per_gpu != 1 or args.start_within is not None:
        flag = ("--gpus" if args.gpus else "--cells-per-gpu" if args.cells_per_gpu != 1
                else "--start-within")
        raise ConfigError(f"{flag} applies to --launcher processes; with --launcher "
                          f"{args.launcher} each job gets its GPUs from the scheduler")
    if args.retry:
        raise ConfigError(f"--retry applies to --launcher processes; with --launcher "
                          f"{args.launcher} rerun the failed cells' jobs with --launcher processes "
                          "or drop --retry")
    width = args.max_jobs or (1 if args.launcher == "submitit-local" else None)
    if width is not None and width < 1:
        raise ConfigError(f"--max-jobs {width}: give 1 or more")
    return run_grid_submitit(spec, args.db, args.launcher, args.partition, width,
                             progress=None if args.quiet else eprint)


def cmd_maxres(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    if cfg.budget is None:
        raise ConfigError("memstudy maxres needs --budget, e.g. --budget 8GiB")
    sets = [split_techniques(s) for s in args.sets] if args.sets else [cfg.techniques]
    for techniques in sets:  # a mistyped technique or option before torch loads
        parse_techniques(techniques)
    fit = [int(s) for s in args.fit_sizes.split(",")]
    check_input_fits(args.max_size, cfg.train.batch_size, "maxres --max-size")
    check_writable(args.db)
    from memstudy.maxres import maxres_table, search_all  # torch: once the arguments are checked

    results = search_all(cfg, sets, args.db, fit_sizes=fit, max_size=args.max_size,
                         timeout_s=args.timeout, progress=None if args.quiet else eprint,
                         step=args.step)
    print(maxres_table(results))
    return 0 if all(r.error is None for r in results) else 1


def cmd_report(args: argparse.Namespace) -> int:
    from memstudy.report import build_report, parse_weights

    weights = parse_weights(args.cost_weights) if args.cost_weights else None
    if args.out:
        check_output(args.out)  # before the report is built
    text = build_report(args.report_db or args.db, args.format, budget=args.budget,
                        cost_weights=weights)
    if args.out:
        write_output(args.out, text)
        eprint(f"wrote {args.out}")
    else:
        print(text)
    return 0


DB_AFTER = dict(default=argparse.SUPPRESS, help="results database (SQLite); also accepted "
                "before the subcommand")


def add_study_parsers(sub) -> None:
    """grid, maxres and report."""
    db = DB_AFTER
    grid = sub.add_parser("grid", help="run a grid of technique sets x sizes, resumably")
    grid.add_argument("spec", help="grid spec (TOML, docs/grid.md)")
    grid.add_argument("--db", **db)
    grid.add_argument("--gpus", help="comma-separated GPU ids, the GPUs cells run on "
                      "(default: all visible GPUs for GPU cells)")
    grid.add_argument("--cells-per-gpu", type=int, default=1, metavar="N",
                      help="run N cells side by side on each GPU (default 1: a GPU is a "
                      "cell's alone); their losses and allocator figures are their own, their "
                      "times are not, and the reports leave those out (docs/grid.md); not with "
                      "a budget, nor for cells on several GPUs")
    grid.add_argument("--budget", help="memory budget for every cell, e.g. 8GiB")
    grid.add_argument("--seeds", metavar="S,S", help="run only these of the spec's seeds "
                      "(e.g. one seed of every set first); their cells are the spec's own")
    grid.add_argument("--timeout", type=float, help="per-cell timeout in seconds")
    grid.add_argument("--start-within", type=float, metavar="SECONDS", help="start no cell "
                      "after this many seconds; the running ones finish and the rest are left "
                      "for the same command (a time slot used without killing a cell)")
    grid.add_argument("--retry", metavar="KINDS", help="run again the recorded cells whose last "
                      "attempt is one of these comma-separated kinds: error, oom, diverged, "
                      "timeout (earlier attempts stay in the database)")
    grid.add_argument("--dry-run", action="store_true", help="list the cells; run nothing")
    grid.add_argument("--launcher", choices=("processes", "slurm", "submitit-local"),
                      default="processes", help="processes: cells as processes of this host "
                      "(default); slurm: one Slurm job per cell through submitit; "
                      "submitit-local: the same jobs on this host (docs/grid.md)")
    grid.add_argument("--partition", help="Slurm partition for --launcher slurm")
    grid.add_argument("--max-jobs", type=int, help="jobs at once (default: every cell for "
                      "slurm, 1 for submitit-local, so CPU timings do not compete)")
    grid.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    grid.set_defaults(func=cmd_grid)
    maxres = sub.add_parser("maxres", help="largest square size that trains under --budget")
    add_run_args(maxres)
    maxres.add_argument("--db", **db)
    maxres.add_argument("--sets", action="append", metavar="TECHNIQUES",
                        help="a technique set to search, e.g. amp:bf16,checkpoint (repeatable; "
                        "default: the set given by -t, else original)")
    maxres.add_argument("--fit-sizes", default="256,384,512", help="sizes measured for the "
                        "prediction (2-3, px)")
    maxres.add_argument("--max-size", type=int, default=8192, help="largest size probed (px; "
                        "probed itself even if not on the --step grid, e.g. 4188)")
    maxres.add_argument("--step", type=int, default=64, help="search grid in px (any value, "
                        "e.g. 4; sizes need not be multiples of 32)")
    maxres.add_argument("--timeout", type=float, help="per-probe timeout in seconds")
    maxres.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    maxres.set_defaults(func=cmd_maxres)
    report = sub.add_parser("report", help="tables and plots of a results database")
    report.add_argument("report_db", nargs="?", help="results database (default: --db)")
    report.add_argument("--format", choices=("term", "md", "csv", "latex", "html"), default="term")
    report.add_argument("--out", help="write to this file instead of the terminal")
    report.add_argument("--cost-weights", help="w1,w2,w3 of the cost objective C = w1 T + w2 M "
                        "+ w3 E (time to target, peak memory, energy; docs/metrics.md), e.g. 1,1,0")
    report.add_argument("--budget", help="a budget to decide for besides those of the database's "
                        "runs (decision table), and the budget line of the memory-vs-resolution "
                        "plot, e.g. 8GiB")
    report.set_defaults(func=cmd_report)


def check_output(path: str) -> None:
    """Refuse an --out that cannot be written: a missing or read-only folder, a read-only file,
    a folder in its place; one error naming it."""
    folder = Path(path).parent
    if not folder.is_dir():
        raise ConfigError(f"--out {path}: folder {folder} does not exist; create it "
                          f"(mkdir -p {folder}) or write elsewhere")
    if Path(path).is_dir():
        raise ConfigError(f"--out {path} is a folder; name a file in it")
    target = Path(path) if Path(path).exists() else folder
    if not os.access(target, os.W_OK):
        raise ConfigError(f"--out {path}: {target} is read-only; make it writable or write "
                          "elsewhere")


def write_output(path: str, text: str) -> None:
    """Write `text` to `path`; a missing folder or an unwritable file is one error naming it."""
    check_output(path)
    try:
        with open(path, "w") as fh:
            fh.write(text)
    except OSError as exc:
        raise ConfigError(f"--out {path}: cannot write ({exc.strerror}); choose a writable "
                          "file") from None


def cmd_advise(args: argparse.Namespace) -> int:
    from memstudy import advise

    db = args.db
    if args.check:
        rows = advise.check(db)
        print(advise.check_table(rows) if rows else "no stored prediction has a run recorded "
              "after it yet; run one (memstudy advise ... --confirm, or memstudy run)")
        return 0
    if not args.budget or not args.size:
        raise ConfigError("memstudy advise needs --budget and --size, e.g. --budget 8GiB "
                          "--size 4188x3500 (or --check)")
    check_confirm_args(args)
    check_writable(db)  # advise stores its predictions (and --confirm a run)
    device, preds, skipped = advise.predict_all(db, args.budget, args.size, args.batch_size,
                                                args.gpu)
    advise.store(db, device, args.size, args.budget, args.batch_size, preds)
    advise.refuse_if_none_fits(device, args.size, args.budget, preds)
    print(advise.describe(device, args.size, args.budget, preds[:args.top] if args.top else preds))
    for name, why in skipped:
        print(f"not predicted: {name}: {why}")
    if args.confirm:
        top = preds[0]
        check_input_fits(parse_size(args.size, "--size"), args.batch_size, "advise --size")
        if not args.force:
            advise.check_reach(top, args.size)
        signal.signal(signal.SIGTERM, signal.default_int_handler)  # stop it as Ctrl-C does
        try:
            outcome = advise.confirm(db, top, args.size, args.budget, eprint,
                                     args.timeout or advise.CONFIRM_TIMEOUT_S)
        except KeyboardInterrupt:
            eprint(f"interrupted: the confirm run of {top.name} was stopped and recorded as "
                   f"'error in interrupted' in {db}")
            return 130
        print(f"confirmed {top.name}: {outcome}")
        rows = [r for r in advise.check(db) if r["name"] == top.name]
        if rows:
            print(advise.check_table(rows[-1:]))
        return 0 if outcome == "ok" else 1
    return 0


def check_confirm_args(args: argparse.Namespace) -> None:
    for flag in ("force", "timeout"):
        if getattr(args, flag) is not None and getattr(args, flag) is not False and not args.confirm:
            raise ConfigError(f"advise --{flag} applies to --confirm; add --confirm or drop it")
    if args.timeout is not None and not args.timeout > 0:
        raise ConfigError(f"advise --timeout {args.timeout:g}: give a positive number of seconds")


def add_advise_parser(sub) -> None:
    advise = sub.add_parser("advise", help="rank technique sets predicted to train a size under "
                            "a budget, from the recorded runs (docs/advise.md)")
    advise.add_argument("--budget", help="device memory budget, e.g. 8GiB (CUDA context included)")
    advise.add_argument("--size", help="image size: 4188 or 4188x3500 (height x width)")
    advise.add_argument("--batch-size", type=int, default=1, help="batch size of the runs to "
                        "fit (default 1)")
    advise.add_argument("--gpu", help="read runs of this GPU (part of its name, e.g. H100); "
                        "default: this machine's GPU, else the database's only device")
    advise.add_argument("--top", type=int, help="show only the first N sets")
    advise.add_argument("--confirm", action="store_true", help="run the top candidate at the "
                        "size under the budget, record it and show the prediction's error")
    advise.add_argument("--force", action="store_true", help="with --confirm: run a top "
                        "candidate extrapolated beyond the reach advise trusts (docs/advise.md)")
    advise.add_argument("--timeout", type=float, help="with --confirm: its time limit in seconds "
                        "(default 1800); a run past it is recorded as 'error in timeout'")
    advise.add_argument("--check", action="store_true", help="compare stored predictions with "
                        "the runs recorded after them; predict nothing")
    advise.set_defaults(func=cmd_advise)


def cmd_merge(args: argparse.Namespace) -> int:
    from memstudy.store import merge_databases

    missing = [src for src in args.sources if not Path(src).is_file()]
    if missing:
        raise ConfigError(f"no such database: {', '.join(missing)}")
    check_writable(args.db)
    for src, copied, known in merge_databases(args.db, args.sources):
        if copied == 0:
            print(f"{src}: nothing copied; all {known} of its runs are in {args.db} already")
        else:
            print(f"{src}: copied {copied} runs into {args.db}"
                  + (f" ({known} already there, not copied again)" if known else ""))
    return 0


def cmd_tune(args: argparse.Namespace) -> int:
    from memstudy.tune import load_tune_spec
    from memstudy.tune.search import run_tune

    # refuses a bad spec before any trial runs; reading a recorded search (--best) plans
    # nothing on the spec's device, so a GPU search can be read on any machine
    spec = load_tune_spec(args.spec, plan_corners=args.best is None)
    if args.check:
        print(f"spec ok: {len(spec.space)} setting(s) searched: {', '.join(spec.space)}")
        return 0
    if args.best is not None:  # read the recorded search; trains nothing, needs no Propulate
        from memstudy.tune.results import best_table

        if args.best < 1 or not Path(args.db).is_file():
            raise ConfigError(f"tune --best {args.best}: give N >= 1 and an existing --db "
                              f"({args.db})")
        print(best_table(spec, ResultsDB(args.db), args.best))
        return 0
    check_writable(args.db)
    try:
        trials = run_tune(spec, ResultsDB(args.db), progress=None if args.quiet else eprint)
    except KeyboardInterrupt:
        eprint("interrupted: recorded trials are kept; the trial that was running left no "
               "record; the same command resumes the search (docs/tune.md)")
        return 130
    print(f"trained {len(trials.ran)} trial(s), {len(trials.reused)} found already recorded, "
          f"{len(trials.refused)} refused before running; stored in {args.db}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="memstudy", description=__doc__)
    parser.add_argument("--db", default=default_db_path(), help="results database (SQLite)")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="train one configuration and record its per-phase memory")
    add_run_args(run)
    run.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    run.add_argument("--dry-run", action="store_true", help="plan the run and say how each "
                     "technique resolves (tile:auto's pick and its predicted peak); train and "
                     "record nothing (a GPU run may be planned on a machine without one)")
    run.set_defaults(func=cmd_run)
    tech = sub.add_parser("techniques", help="list techniques and their options")
    tech.set_defaults(func=cmd_techniques)
    merge = sub.add_parser("merge", help="copy the runs of several databases into --db")
    merge.add_argument("sources", nargs="+", help="results databases to copy from")
    merge.set_defaults(func=cmd_merge)
    add_study_parsers(sub)
    add_advise_parser(sub)
    tune = sub.add_parser("tune", help="evolutionary hyperparameter search with Propulate "
                          "(docs/tune.md); every trial a recorded run, resumable")
    tune.add_argument("spec", help="tune spec (TOML: [base], [space], [search], [fitness])")
    tune.add_argument("--check", action="store_true", help="validate the spec; run nothing")
    tune.add_argument("--best", type=int, metavar="N", help="print the N best recorded trials of "
                      "this spec in --db and the best one's settings; run nothing")
    tune.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    tune.set_defaults(func=cmd_tune)
    for command in sub.choices.values():  # `memstudy run --db X` as well as `memstudy --db X run`
        if not any("--db" in a.option_strings for a in command._actions):
            command.add_argument("--db", **DB_AFTER)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (MemstudyError, ValueError) as exc:  # ValueError: data errors (ImageError), sizes
        return fail(str(exc))
    except BrokenPipeError:  # `memstudy report db | head`: the reader left early
        _silence_stdout()
        return fail("the output pipe was closed before everything was written (e.g. by head); "
                    "nothing else was affected; use --out FILE for the whole output")
    except sqlite3.Error as exc:  # one not translated by the store: still one line
        return fail(f"results database {args.db}: {exc}")
    except OSError as exc:
        where = f" {exc.filename}" if exc.filename else ""
        return fail(f"{exc.strerror or exc}{where}; check the path and its permissions")


def fail(message: str) -> int:
    try:
        print(f"memstudy: error: {message}", file=sys.stderr, flush=True)
    except OSError:
        pass
    return 2


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush does not fail again."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):
        pass


if __name__ == "__main__":
    sys.exit(main())
