"""The study's Tables 1A, 1B, 2 and Figure 2 at its own protocol, beside its published values.

Reads the runs of benchmarks/specs/paper-protocol.toml (label `paper-protocol`) from a results
database and prints, per technique set: our final train / validation loss as mean ± std over
seeds (n) next to the paper's (benchmarks/specs/paper-published.toml, Rodriguez et al.,
seeds/003, Tables 1-2), and whether the set's validation loss differs from original's beyond
the seed spread: the intervals mean ± std of the two do not overlap (a set of one seed: whether
its value lies outside original's interval). A seed whose final training loss is exactly 1
never trained (MS-SSIM clamped to 0 from its first step, so every gradient is 0; docs/paper.md):
it is named in its own column and left out of the loss means, not averaged in. Table 2: forward
and backward MB (each phase's peak above its start, the study's increment; docs/report.md) and
the time per epoch (the mean over the epochs after the first, which holds cuDNN's autotuning
and the metered steps), ours next to the paper's. Figure 2: each set's forward and backward MB
as a ratio to original's, ours next to the paper's (its 512 px bars, from its Table 2).

    python benchmarks/bench_paper.py results/paper.sqlite [--format md] [--gpu H100]
    python benchmarks/bench_paper.py --estimate benchmarks/results/h200/technique-grid/gpu.sqlite

--estimate prints the grid's training steps and, from the 512 px step times recorded in the
given database, how long the protocol would take on that GPU (one cell at a time).
"""
from __future__ import annotations

import argparse
import sys
import tomllib
from pathlib import Path

from memstudy.bytesize import mb
from memstudy.grid import expand, load_spec
from memstudy.report.data import device_of, load_runs, open_db, phase_peak
from memstudy.report.tables import spread
from memstudy.text_table import render_table

SPECS = Path(__file__).resolve().parent / "specs"
SPEC, PUBLISHED = SPECS / "paper-protocol.toml", SPECS / "paper-published.toml"
LABEL = "paper-protocol"


def runs_by_set(db: str, gpu: str | None) -> dict[str, list[dict]]:
    by_set: dict[str, list[dict]] = {}
    for run in load_runs(db):
        if run["label"] == LABEL and (gpu is None or gpu.lower() in device_of(run).lower()):
            by_set.setdefault(run["name"], []).append(run)
    return by_set


def never_trained(run: dict) -> bool:
    """1 - MS-SSIM is exactly 1 only where MS-SSIM's clamp (relu of each scale's term) gave 0,
    and then its gradient is 0 too: a last epoch whose every step had loss 1 never moved."""
    return (run["last_epoch"] or {}).get("train_loss") == 1.0


def trained(runs: list[dict]) -> list[dict]:
    return [r for r in runs if r["status"] == "ok" and not never_trained(r)]


def loss_stats(runs: list[dict], key: str, scale: float) -> tuple:
    last = [(r["last_epoch"] or {}).get(key) for r in trained(runs)]
    m, s, n = spread([v * scale if v is not None else None for v in last])
    return m, s, n


def _cell(stat: tuple) -> str:
    m, s, n = stat
    if m is None:
        return "-"
    return f"{m:.4f}" + (f" ± {s:.4f}" if s is not None else "") + f" (n={n})"


def differs(a: tuple, base: tuple) -> str:
    """'yes' / 'no' when both have a seed spread: whether mean ± std intervals are apart; a set
    of one seed against a base with a spread: whether its value lies outside the base's
    interval, said with '(one seed)' since its own spread is unknown."""
    (ma, sa, na), (mb_, sb, nb) = a, base
    if ma is None or mb_ is None:
        return "-"
    if sb is None:
        return "n/a (one seed)"
    if sa is None:
        return ("outside" if abs(ma - mb_) > sb else "inside") + " original's spread (one seed)"
    return "yes" if abs(ma - mb_) > sa + sb else "no"


def table1(part: dict, by_set: dict, scale: float) -> tuple[list[str], list[list]]:
    base = loss_stats(by_set.get("original", []), "val_loss", scale)
    rows = []
    for name, paper in part.items():
        runs = by_set.get(name, [])
        train, val = loss_stats(runs, "train_loss", scale), loss_stats(runs, "val_loss", scale)
        status = ", ".join(sorted({r["status"] for r in runs})) or "not run"
        dead = ", ".join(str(r["config"]["train"]["seed"]) for r in runs
                         if r["status"] == "ok" and never_trained(r)) or "-"
        rows.append([paper["paper"], name, _cell(train), _published(paper, "train_loss"),
                     _cell(val), _published(paper, "val_loss"),
                     "-" if name == "original" else differs(val, base), dead, status])
    return (["paper", "techniques", "train loss", "paper train", "val loss", "paper val",
             "val differs from original", "seeds never trained", "status"], rows)


def phase_mb(runs: list[dict], phase: str) -> tuple:
    """A phase's increment in MB over the runs that finished (all seeds: memory does not depend
    on whether the weights moved)."""
    return spread([mb(phase_peak(r["metrics"].get(phase, {}))) for r in runs if r["status"] == "ok"])


def epoch_times(db: str) -> dict[int, float]:
    """Per run, the mean time of its epochs after the first (rank 0)."""
    rows = open_db(db).query("SELECT run_id, AVG(time_s) AS t FROM epochs "
                             "WHERE rank = 0 AND epoch > 0 GROUP BY run_id")
    return {row["run_id"]: row["t"] for row in rows}


def table2(part: dict, by_set: dict, epoch_s: dict[int, float]) -> tuple[list[str], list[list]]:
    rows = []
    for name, paper in part.items():
        runs = by_set.get(name, [])
        epoch = spread([epoch_s.get(r["id"]) for r in runs if r["status"] == "ok"])
        rows.append([paper["paper"], name, _num(phase_mb(runs, "forward")),
                     _published(paper, "forward_mb"), _num(phase_mb(runs, "backward")),
                     _published(paper, "backward_mb"), _num(epoch), _published(paper, "epoch_s")])
    return (["paper", "techniques", "Forward MB", "paper Forward", "Backward MB",
             "paper Backward", "epoch s (2-50)", "paper epoch s"], rows)


def figure2(part: dict, by_set: dict) -> tuple[list[str], list[list]]:
    """Memory of each set as a ratio to original's, per phase: the study's Figure 2 at 512 px,
    whose bars are its Table 2's MB over original's."""
    base = part["original"]
    rows = []
    for name, paper in part.items():
        row = [paper["paper"], name]
        for phase in ("forward", "backward"):
            ours, ref = phase_mb(by_set.get(name, []), phase)[0], phase_mb(by_set.get("original", []), phase)[0]
            row.append("-" if ours is None or not ref else f"{ours / ref:.2f}")
            key = f"{phase}_mb"
            row.append(f"{paper[key] / base[key]:.2f}" if key in paper else "-")
        rows.append(row)
    return (["paper", "techniques", "Forward / original", "paper Forward", "Backward / original",
             "paper Backward"], rows)


def _published(paper: dict, key: str) -> str:
    """A published value as printed (all its digits), '-' where the set never finished."""
    return str(paper[key]) if key in paper else "-"


def _num(stat: tuple) -> str:
    m, s, _n = stat
    return "-" if m is None else f"{m:.2f}" + (f" ± {s:.2f}" if s is not None else "")


def estimate(db: str, gpu: str | None) -> str:
    """Training steps of the protocol and the time they take at the recorded 512 px step
    times (the median over the set's runs at 512 px, batch 1); per-cell start-up and
    validation passes are not in it."""
    cells = [c for c in expand(load_spec(SPEC)) if not c.error or "no CUDA GPU" in c.error]
    times: dict[str, list[float]] = {}
    for run in load_runs(db, probes=True):
        step = run["metrics"].get("run", {}).get("step_time_s")
        if (run["image_size"] == 512 and run["batch_size"] == 1 and run["status"] == "ok" and step
                and (gpu is None or gpu.lower() in device_of(run).lower())):
            times.setdefault(run["name"], []).append(step)
    lines, total, unknown = [], 0.0, []
    for cell in cells:
        steps = cell.config.train.epochs * cell.config.data.train_images // cell.config.train.batch_size
        known = sorted(times.get(cell.name, []))
        if not known:
            unknown.append(cell.name)
            continue
        total += steps * known[len(known) // 2]
    steps = sum(c.config.train.epochs * c.config.data.train_images for c in cells)
    lines.append(f"{len(cells)} cells, {steps} training steps at 512 px")
    lines.append(f"steps alone: {total / 60:.1f} min at the recorded step times"
                 + (f"; no 512 px time recorded for {sorted(set(unknown))}" if unknown else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("db", help="results database with the paper-protocol runs")
    p.add_argument("--format", choices=("term", "md", "csv", "latex"), default="term")
    p.add_argument("--gpu", help="only runs of this GPU (part of its name)")
    p.add_argument("--estimate", action="store_true", help="print the protocol's run time "
                   "from the 512 px step times in DB; read no paper-protocol runs")
    args = p.parse_args(argv)
    if not Path(args.db).is_file():
        print(f"bench_paper: error: no database {args.db}", file=sys.stderr)
        return 2
    if args.estimate:
        print(estimate(args.db, args.gpu))
        return 0
    published = tomllib.loads(PUBLISHED.read_text())
    by_set = runs_by_set(args.db, args.gpu)
    scale = published["loss_scale"]
    gpus = sorted({device_of(r) for runs in by_set.values() for r in runs}) or ["no runs"]
    print(f"paper-protocol runs of {args.db} on {', '.join(gpus)}; losses x {scale:g} as the "
          "paper prints them\n")
    epoch_s = epoch_times(args.db)
    for title, (headers, rows) in (
            ("Table 1A: loss per technique, 512 px, 50 epochs", table1(published["table1a"], by_set, scale)),
            ("Table 1B: loss per combination", table1(published["table1b"], by_set, scale)),
            ("Table 2: memory per phase (MB) and time per epoch", table2(published["table2"], by_set, epoch_s)),
            ("Figure 2: memory per phase as a ratio to original's, 512 px", figure2(published["table2"], by_set))):
        print(title)
        print(render_table(headers, rows, args.format))
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
