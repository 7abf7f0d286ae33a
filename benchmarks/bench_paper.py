"""The study's Tables 1A-6 and Figure 2 at its own protocol, beside its published values.

Reads the runs of benchmarks/specs/paper-protocol.toml (label `paper-protocol`) from a results
database and prints, per technique set: our final train / validation loss as mean ± std over
seeds (n) next to the paper's (benchmarks/specs/paper-published.toml, Rodriguez et al.,
seeds/003, Tables 1-2), and whether the set's validation loss differs from original's beyond
the seed spread: the intervals mean ± std of the two do not overlap (a set of one seed: whether
its value lies outside original's interval). A seed that did not train (the recorded flag
runs.trained: its loss bit-identical at every step, MS-SSIM clamped to 0 so every gradient is
0; docs/metrics.md, docs/paper.md) is named in its own column and left out of the loss means,
not averaged in. Table 2: forward
and backward MB (each phase's peak above its start, the study's increment; docs/report.md) and
the time per epoch (the mean over the epochs after the first, which holds cuDNN's autotuning
and the metered steps; only runs that had their GPU to themselves), ours next to the paper's. Figure 2: each set's forward and backward MB
as a ratio to original's, ours next to the paper's (its 512 px bars, from its Table 2).

Tables 3-6 (two GPUs): the runs of benchmarks/specs/paper-protocol-2gpu.toml (data parallel,
Tables 3-4) and paper-protocol-2gpu-mp.toml (model parallel, Tables 5-6), label
`paper-protocol-2gpu`, in the same columns: losses as Table 1's, against Original's (the
one-GPU set, from the same database or --original's); memory as Table 2's plus the paper's
Total (forward + backward). A two-GPU run's phase figures are the mean over its two ranks
(the paper's per-GPU "average"); its losses and epoch time are rank 0's (model parallel:
rank 0 logs the loss rank 1 computed). Their epoch times come only from runs that had their
host to themselves: a run that overlapped another run of the database in time on the same
host (two cells on a 4-GPU host, one GPU pair each) is left out and counted, and the short
timing specs' runs (label `paper-protocol-2gpu-timing`, one cell at a time) give the time;
their losses enter no table. Each row names the GPU its runs ran on (Original may be
another). A set with no run prints "not measured".

    python benchmarks/bench_paper.py results/paper.sqlite [--format md] [--gpu H100] [--figure f2.png]
    python benchmarks/bench_paper.py results/paper-2gpu.sqlite --original results/paper.sqlite
    python benchmarks/bench_paper.py --estimate benchmarks/results/h200/technique-grid/gpu.sqlite

--estimate prints the grid's training steps and, from the 512 px step times recorded in the
given database, how long the protocol would take on that GPU (one cell at a time).
"""
from __future__ import annotations

import argparse
import sys
import tomllib
from pathlib import Path

from memstudy.byte_sizes import mb
from memstudy.errors import MemstudyError
from memstudy.grid import expand, load_spec
from memstudy.report.data import (device_of, did_not_train, gpu_shared, load_runs, open_db,
                                  phase_peak, step_time)
from memstudy.report.tables import spread
from memstudy.text_table import render_table

SPECS = Path(__file__).resolve().parent / "specs"
SPEC, PUBLISHED = SPECS / "paper-protocol.toml", SPECS / "paper-published.toml"
SPECS_2GPU = (SPECS / "paper-protocol-2gpu.toml", SPECS / "paper-protocol-2gpu-mp.toml")
LABEL, LABEL_2GPU = "paper-protocol", "paper-protocol-2gpu"
LABEL_TIMING = "paper-protocol-2gpu-timing"  # the short timing specs' runs (epoch times only)


def runs_by_set(db: str, gpu: str | None, labels=(LABEL, LABEL_2GPU)) -> dict[str, list[dict]]:
    """The protocol's runs (one GPU and two; `labels`) per technique set, each with its
    `epoch_s` and `beside` (how many other runs of the database ran at the same time on its
    host, `beside_counts`)."""
    by_set: dict[str, list[dict]] = {}
    epoch_s = epoch_times(db)
    runs = load_runs(db)
    beside = beside_counts(runs)
    for run in runs:
        if run["label"] in labels and (gpu is None or gpu.lower() in device_of(run).lower()):
            run["epoch_s"], run["beside"] = epoch_s.get(run["id"]), beside[run["id"]]
            by_set.setdefault(run["name"], []).append(run)
    return by_set


def beside_counts(runs: list[dict]) -> dict[int, int]:
    """Per run, how many other runs overlapped it in time on the same host (env `host`): two
    two-GPU cells on one 4-GPU host share its CPUs, memory bandwidth and PCIe, so neither's
    epoch time is its own, though neither saw the other on its GPUs (gpu_shared). A run
    without a finish time overlaps nothing here."""
    spans = [(r["id"], r["env"].get("host"), r["started_at"], r["finished_at"]) for r in runs]
    return {rid: sum(1 for other, h, s, f in spans
                     if other != rid and h == host and None not in (start, end, s, f)
                     and s < end and start < f)
            for rid, host, start, end in spans}


def trained(runs: list[dict]) -> list[dict]:
    """The finished runs that trained: the recorded flag (runs.trained, memstudy.did_train)."""
    return [r for r in runs if r["status"] == "ok" and not did_not_train(r)]


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


def table1(part: dict, by_set: dict, scale: float, gpu: bool = False) -> tuple[list[str], list[list]]:
    """Tables 1A, 1B, 3 and 5: the losses, whether the validation loss differs from
    Original's, the seeds that never trained, (with `gpu`) the GPU and the status."""
    base = loss_stats(by_set.get("original", []), "val_loss", scale)
    rows = []
    for name, paper in part.items():
        runs = by_set.get(name, [])
        train, val = loss_stats(runs, "train_loss", scale), loss_stats(runs, "val_loss", scale)
        dead = ", ".join(str(r["config"]["train"]["seed"]) for r in runs
                         if did_not_train(r)) or "-"
        rows.append([paper["paper"], name, _cell(train), _published(paper, "train_loss"),
                     _cell(val), _published(paper, "val_loss"),
                     "-" if name == "original" else differs(val, base), dead,
                     *([gpu_names(runs)] if gpu else []), run_status(runs)])
    return (["paper", "techniques", "train loss", "paper train", "val loss", "paper val",
             "val differs from original", "seeds never trained", *(["GPU"] if gpu else []),
             "status"], rows)


def run_status(runs: list[dict]) -> str:
    return ", ".join(sorted({r["status"] for r in runs})) or "not measured"


def phase_mb(runs: list[dict], phase: str) -> tuple:
    """A phase's increment in MB over the runs that finished (all seeds: memory does not depend
    on whether the weights moved)."""
    return spread([_run_mb(r, phase) for r in runs if r["status"] == "ok"])


def total_mb(runs: list[dict]) -> tuple:
    """Forward + backward MB of each finished run (Tables 4 and 6's Total), over the runs."""
    per_run = [(_run_mb(r, "forward"), _run_mb(r, "backward")) for r in runs if r["status"] == "ok"]
    return spread([f + b if f is not None and b is not None else None for f, b in per_run])


def _run_mb(run: dict, phase: str) -> float | None:
    return mb(phase_peak(run["metrics"].get(phase, {})))


def epoch_times(db: str) -> dict[int, float]:
    """Per run, the mean time of its epochs after the first (rank 0)."""
    rows = open_db(db).query("SELECT run_id, AVG(time_s) AS t FROM epochs "
                             "WHERE rank = 0 AND epoch > 0 GROUP BY run_id")
    return {row["run_id"]: row["t"] for row in rows}


MEMORY_HEADERS = ["paper", "techniques", "Forward MB", "paper Forward", "Backward MB",
                  "paper Backward"]
EPOCH_HEADERS = ["epoch s (2-50)", "paper epoch s"]


def table2(part: dict, by_set: dict) -> tuple[list[str], list[list]]:
    rows = [[paper["paper"], name, *memory_cells(by_set.get(name, []), paper),
             *epoch_cells(by_set.get(name, []), paper)] for name, paper in part.items()]
    return MEMORY_HEADERS + EPOCH_HEADERS, rows


def table4(part: dict, by_set: dict, timing: dict) -> tuple[list[str], list[list]]:
    """Tables 4 and 6: Table 2's columns with the Total (forward + backward), the epoch time
    from the runs with no neighbour (`timing`: the short timing specs' runs per set), the GPU
    and the status."""
    rows = []
    for name, paper in part.items():
        runs = by_set.get(name, [])
        rows.append([paper["paper"], name, *memory_cells(runs, paper), _num(total_mb(runs)),
                     _published(paper, "total_mb"),
                     *epoch_cells(runs, paper, timing.get(name, [])), gpu_names(runs),
                     run_status(runs)])
    return (MEMORY_HEADERS + ["Total MB", "paper Total", "epoch s (after the first, alone)",
                              "paper epoch s", "GPU", "status"], rows)


def gpu_names(runs: list[dict]) -> str:
    """The GPUs a row's runs ran on ('NVIDIA H200'; two names where a row mixes them)."""
    return ", ".join(sorted({device_of(r) for r in runs})) or "-"


def memory_cells(runs: list[dict], paper: dict) -> list[str]:
    """Forward and backward MB, ours beside the paper's."""
    return [_num(phase_mb(runs, "forward")), _published(paper, "forward_mb"),
            _num(phase_mb(runs, "backward")), _published(paper, "backward_mb")]


def epoch_cells(runs: list[dict], paper: dict, timing: list[dict] | None = None) -> list[str]:
    """The time per epoch over the finished runs (and `timing`'s) that had their GPU and host
    to themselves (a run that shared its GPU, report.data.gpu_shared, or ran beside another
    cell on its host, `beside`, keeps its losses and memory here, not its time), ours beside
    the paper's."""
    done = [r for r in [*runs, *(timing or [])] if r["status"] == "ok"]
    own = [r["epoch_s"] for r in done if not gpu_shared(r) and not r.get("beside")]
    shared = sum(gpu_shared(r) for r in done)
    beside = sum(bool(r.get("beside")) and not gpu_shared(r) for r in done)
    notes = [f"{shared} on a shared GPU" if shared else "",
             f"{beside} beside another cell" if beside else ""]
    left_out = " and ".join(n for n in notes if n)
    counted = f" (n={len(own)})" if timing is not None and own else ""
    cell = _num(spread(own)) + counted + (f" ({left_out} left out)" if left_out else "")
    return [cell, _published(paper, "epoch_s")]


FIGURE2_PHASES = ("forward", "backward")


def figure2_ratios(part: dict, by_set: dict) -> list[tuple[str, str, dict]]:
    """Per set: (paper's label, techniques, {phase: (ours, paper's)}), each a ratio of the
    phase's MB to original's (None where either is missing): the study's Figure 2 at 512 px,
    whose bars are its Table 2's MB over original's."""
    base = part["original"]
    refs = {phase: phase_mb(by_set.get("original", []), phase)[0] for phase in FIGURE2_PHASES}
    out = []
    for name, paper in part.items():
        ratios = {}
        for phase in FIGURE2_PHASES:
            ours, ref = phase_mb(by_set.get(name, []), phase)[0], refs[phase]
            key = f"{phase}_mb"
            ratios[phase] = (ours / ref if ours is not None and ref else None,
                             paper[key] / base[key] if key in paper else None)
        out.append((paper["paper"], name, ratios))
    return out


def figure2(part: dict, by_set: dict) -> tuple[list[str], list[list]]:
    """Figure 2 as a table: each phase's ratio, ours beside the paper's."""
    rows = [[label, name, *("-" if v is None else f"{v:.2f}" for phase in FIGURE2_PHASES
                            for v in ratios[phase])]
            for label, name, ratios in figure2_ratios(part, by_set)]
    return (["paper", "techniques", "Forward / original", "paper Forward", "Backward / original",
             "paper Backward"], rows)


def figure2_chart(ratios: list[tuple[str, str, dict]], gpu: str):
    """Figure 2 drawn: per phase a panel, per set our bar beside the paper's (hatched); a set
    without a value has no bar there, named under the axis all the same."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4.2), dpi=100, layout="constrained")
    axes = fig.subplots(1, len(FIGURE2_PHASES), sharey=True)
    xs = range(len(ratios))
    for ax, phase in zip(axes, FIGURE2_PHASES):
        ours = [r[phase][0] if r[phase][0] is not None else float("nan") for _l, _n, r in ratios]
        paper = [r[phase][1] if r[phase][1] is not None else float("nan") for _l, _n, r in ratios]
        ax.bar([x - 0.2 for x in xs], ours, 0.4, label=f"memstudy, {gpu}", color="tab:blue")
        ax.bar([x + 0.2 for x in xs], paper, 0.4, label="paper (RTX 2060)", color="white",
               edgecolor="tab:gray", hatch="//")
        ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
        ax.set_xticks(list(xs), [label for label, _n, _r in ratios], rotation=35, ha="right",
                      fontsize=8)
        ax.set_title(f"{phase.capitalize()}: memory / Original's, 512 px")
    axes[0].set_ylabel("ratio to Original")
    axes[0].legend(fontsize=8)
    return fig


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
        step = step_time(run)
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


def tables(published: dict, by_set: dict, scale: float,
           timing: dict | None = None) -> list[tuple[str, tuple]]:
    """(title, (headers, rows)) of every table, in the paper's order."""
    per_gpu = "memory per phase (MB, mean over the two GPUs) and time per epoch"
    return [("Table 1A: loss per technique, 512 px, 50 epochs",
             table1(published["table1a"], by_set, scale)),
            ("Table 1B: loss per combination", table1(published["table1b"], by_set, scale)),
            ("Table 2: memory per phase (MB) and time per epoch",
             table2(published["table2"], by_set)),
            ("Figure 2: memory per phase as a ratio to original's, 512 px",
             figure2(published["table2"], by_set)),
            ("Table 3: loss, data parallel on two GPUs",
             table1(published["table3"], by_set, scale, gpu=True)),
            (f"Table 4: data parallel, {per_gpu}",
             table4(published["table4"], by_set, timing or {})),
            ("Table 5: loss, model parallel on two GPUs",
             table1(published["table5"], by_set, scale, gpu=True)),
            (f"Table 6: model parallel, {per_gpu}",
             table4(published["table6"], by_set, timing or {}))]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("db", help="results database with the paper-protocol runs")
    p.add_argument("--format", choices=("term", "md", "csv", "latex"), default="term")
    p.add_argument("--gpu", help="only runs of this GPU (part of its name)")
    p.add_argument("--original", metavar="DB", help="take Original's runs from this database "
                   "(e.g. the one-GPU one when DB holds the two-GPU runs)")
    p.add_argument("--figure", metavar="PNG", help="also draw Figure 2 (ours beside the "
                   "paper's) into this PNG file")
    p.add_argument("--estimate", action="store_true", help="print the protocol's run time "
                   "from the 512 px step times in DB; read no paper-protocol runs")
    args = p.parse_args(argv)
    for db in (args.db, args.original):
        if db is not None and not Path(db).is_file():
            print(f"bench_paper: error: no database {db}", file=sys.stderr)
            return 2
    if args.estimate:
        print(estimate(args.db, args.gpu))
        return 0
    published = tomllib.loads(PUBLISHED.read_text())
    by_set = runs_by_set(args.db, args.gpu)
    if args.original:
        by_set["original"] = runs_by_set(args.original, args.gpu).get("original", [])
    scale = published["loss_scale"]
    gpus = sorted({device_of(r) for runs in by_set.values() for r in runs}) or ["no runs"]
    origin = f" (Original's: {args.original})" if args.original else ""
    print(f"paper-protocol runs of {args.db}{origin} on {', '.join(gpus)}; losses x {scale:g} "
          "as the paper prints them\n")
    timing = runs_by_set(args.db, args.gpu, labels=(LABEL_TIMING,))
    for title, (headers, rows) in tables(published, by_set, scale, timing):
        print(title)
        print(render_table(headers, rows, args.format))
        print()
    if args.figure:
        chart = figure2_chart(figure2_ratios(published["table2"], by_set), ", ".join(gpus))
        chart.savefig(args.figure, format="png")
    return 0


def cli(argv: list[str] | None = None) -> int:
    """main, with a bad database or setting said in one line (exit 2) instead of a traceback."""
    try:
        return main(argv)
    except MemstudyError as exc:  # a bad database (store.DatabaseError), a bad setting
        print(f"bench_paper: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(cli())
