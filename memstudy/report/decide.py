"""The report's decision section: which technique set to use for a size and a memory budget.

From every recorded run (maxres probes included: they are real runs under a budget) it builds
one *candidate* per experiment (memstudy.report.experiments): the runs of one configuration
that differ only in their seed (and label); `differs` names what sets a candidate apart from
others of its set, size and device. A candidate carries the mean and spread over its seeds (mean, std, n) of the step
time and the final validation loss, and the largest absolute peak over its seeds: what a budget
caps, so the worst seed decides whether a set fits. A seed that did not train (memstudy.did_train)
keeps its memory and time but gives no validation loss; a candidate none of whose finished
seeds trained is not ranked (decisions, Pareto) and is named in the decision's note.

The trade-off this section makes explicit: a budget only caps *absolute* memory, the CUDA
context included, while the study's tables show each phase's *increment* above its start. A
run recorded without a budget never measured its context; its absolute peak here adds the
median context the same GPU measured in the database's budgeted runs (marked `context
estimated`), rather than pretending a context of zero, which would call too many sets fitting.

Tables (rows are dicts; docs/report.md defines each column):
    decisions(db, budgets)   per device, budget and size: the fastest set that fits, its step
                             time and quality cost against original
    pareto(db)               per device and size: peak against step time, Pareto-optimal marked
    phase_categories(db)     per set, size and phase: memory held at the phase end by category
    phase_peaks(db)          per set and size: each phase's increment beside its absolute peak
Torch-free, like the rest of memstudy.report.
"""
from __future__ import annotations

from collections import defaultdict
from statistics import median
from typing import Any

from memstudy.byte_sizes import mb, parse_bytes, size_text
from memstudy.report.data import (TRAIN_PHASES, device_of, did_not_train, gpu_shared,
                                  load_maxres, load_runs, open_db, phase_peak, step_time)
from memstudy.report.experiments import (comparison, describe, experiment, label_experiments,
                                         settings, split)
from memstudy.report.tables import DIFFERS, spread
from memstudy.image_sizes import size_hw, size_sort_key
from memstudy.store import NOT_TRAINED, describe_outcome

Rows = list[dict[str, Any]]
BASELINE = "original"
# the categories of docs/metrics.md, in stacking order (what every phase holds at its end)
CATEGORIES = (("cat_params_bytes", "parameters"), ("cat_grads_bytes", "gradients"),
              ("cat_optimizer_bytes", "optimizer state"), ("cat_saved_bytes", "saved activations"),
              ("cat_loss_saved_bytes", "saved by the loss"), ("cat_other_bytes", "other"))


def contexts(runs: Rows) -> dict[str, float]:
    """Median CUDA context (bytes) per GPU over the runs that measured it (budgeted runs)."""
    seen: dict[str, list[float]] = defaultdict(list)
    for run in runs:
        if run["env"].get("cuda_context_bytes"):
            seen[device_of(run)].append(run["env"]["cuda_context_bytes"])
    return {gpu: median(values) for gpu, values in seen.items()}


def missing_context(run: dict[str, Any], context: float) -> float:
    """What to add to a run's peaks to make them absolute: `context` (the GPU's measured CUDA
    context) for a CUDA run that did not measure its own, else 0."""
    cuda = any("alloc_peak_bytes" in run["metrics"].get(p, {}) for p in TRAIN_PHASES)
    return context if cuda and not run["env"].get("cuda_context_bytes") else 0.0


def absolute_peak(run: dict[str, Any], context_by_gpu: dict[str, float]) -> tuple[float | None, bool]:
    """(the run's absolute peak, whether its context was estimated): allocator + context on a
    GPU, live tensor bytes on the CPU (report.data.absolute_phase_peaks)."""
    peak = max(run["peaks"].values(), default=None)
    added = missing_context(run, context_by_gpu.get(device_of(run), 0.0))
    return (None, False) if peak is None else (peak + added, added > 0)


def candidates(db) -> Rows:
    """One row per experiment (see the module docstring) with at least one run."""
    runs = load_runs(db, probes=True)
    context_by_gpu = contexts(runs)
    groups: dict[tuple, Rows] = defaultdict(list)
    for run in runs:
        groups[experiment(run)].append(run)
    differs, same = label_experiments({k: g[0] for k, g in groups.items()})
    return [_candidate(g, context_by_gpu) | {"differs": differs[k], "comparison": same[k]}
            for k, g in groups.items()]


def _candidate(runs: Rows, context_by_gpu: dict[str, float]) -> dict[str, Any]:
    first, ok = runs[0], [r for r in runs if r["status"] == "ok"]
    peaks = [absolute_peak(r, context_by_gpu) for r in ok]
    step = spread([step_time(r) for r in ok])
    # memory and time hold for every finished seed; quality only for the seeds that trained
    val = spread([(r["last_epoch"] or {}).get("val_loss") for r in ok if not did_not_train(r)])
    failed = [r for r in runs if r["status"] != "ok"]
    return {"name": first["name"], "image_size": first["image_size"],
            "batch_size": first["batch_size"], "world_size": first["world_size"],
            "device": device_of(first), "techniques": first["config"].get("techniques", []),
            "budget": first["config"].get("budget"), "label": first["label"] or "-",
            "ok": len(ok), "runs": len(runs),
            "not_trained": sum(did_not_train(r) for r in ok),
            "shared": sum(gpu_shared(r) for r in ok),  # their times left out (step_time)
            "failed": describe_outcome(failed[-1]["status"], failed[-1]["failed_phase"])
                      if failed else None,
            "peak_bytes": max((p for p, _e in peaks if p is not None), default=None),
            "context_estimated": any(e for _p, e in peaks),
            "step_time_s": step[0], "step_time_s_std": step[1], "step_n": step[2],
            "val_loss": val[0], "val_loss_std": val[1], "val_n": val[2],
            "epochs": max(((r["last_epoch"] or {}).get("epoch", -1) + 1 for r in ok), default=0),
            "config": first["config"], "run": first, "pixels": _pixels(first["image_size"])}


def _pixels(size) -> int | None:
    hw = size_hw(size)
    return hw[0] * hw[1] if hw else None


def budgets_found(db, extra: list[str] = ()) -> list[int]:
    """Budgets (bytes) of the database's runs and maxres searches, and those given, sorted."""
    db = open_db(db)
    found = {parse_bytes(b, "budget") for b in extra}
    for run in load_runs(db, probes=True):
        if run["config"].get("budget") is not None:
            found.add(parse_bytes(run["config"]["budget"], "budget"))
    found |= {int(r["budget_bytes"]) for r in load_maxres(db)}
    return sorted(found)


def quality_cost(cands: Rows, like: dict[str, Any], size) -> dict[str, Any]:
    """`delta`: val loss of `like`'s set minus original's, `std` its spread, `at` the size
    compared at, `under` the settings compared under where they are not `like`'s own, `epochs`
    and `seeds` the fewer of the pair's (report.notes warns below what ranks quality); all None
    ('' for `under`) where there is no pair. At `size` when both were validated there, else at
    the largest size where both were. The pair is one experiment apart from its set: among
    validated candidates of `like`'s device and batch, the set and original agree on every
    setting that splits some set's rows (experiments.split), preferably with `like`'s values of
    them (a maxres probe is never validated: its set's validated runs stand in)."""
    none = {"delta": None, "std": None, "at": None, "under": "", "epochs": None, "seeds": None}
    validated = [c for c in cands if c["device"] == like["device"] and c["val_loss"] is not None
                 and c["batch_size"] == like["batch_size"]]
    _shown, keys = split({i: c["run"] for i, c in enumerate(validated)})

    def by_label(set_name: str) -> dict[str, dict]:
        out: dict[str, dict] = defaultdict(dict)
        for c in validated:
            if c["name"] == set_name:
                out[comparison(c["run"], keys)][c["image_size"]] = c
        return out

    ours, base = by_label(like["name"]), by_label(BASELINE)
    own = comparison(like["run"], keys)
    labels = [own] if own in ours and own in base else sorted(set(ours) & set(base))
    if len(labels) != 1:  # none, or several settings and none of them like's: no one answer
        return none
    common = sorted(set(ours[labels[0]]) & set(base[labels[0]]), key=size_sort_key)
    if not common:
        return none
    at = size if size in common else common[-1]
    a, b = ours[labels[0]][at], base[labels[0]][at]
    stds = [s for s in (a["val_loss_std"], b["val_loss_std"]) if s is not None]
    theirs, mine = settings(a["run"]), settings(like["run"])  # name only where they differ
    return {"delta": a["val_loss"] - b["val_loss"], "at": at,
            "std": sum(s * s for s in stds) ** 0.5 if stds else None,
            "under": describe(theirs, {k for k in keys if theirs.get(k) != mine.get(k)}),
            "epochs": min(a["epochs"], b["epochs"]), "seeds": min(a["val_n"], b["val_n"])}


def decisions(db, budgets: list[int | str] | None = None) -> Rows:
    """Per device, budget and size: the fastest ok candidate whose absolute peak fits, its
    step time over original's at that size (the fastest ok original there with the same
    settings as it, any memory; experiments.comparison) and its quality cost (quality_cost).
    A size where nothing fits names the smallest peak seen. Budgets are bytes or text as the
    user wrote it ('400MiB'), shown so (bytes in round units: byte_sizes.size_text)."""
    cands = [c for c in candidates(db) if c["world_size"] == 1]
    budgets = written(budgets if budgets is not None else budgets_found(db))
    rows = []
    for (device, size), group in _by(cands, "device", "image_size").items():
        measured = [c for c in group if c["ok"] and c["peak_bytes"] is not None and c["step_time_s"]]
        ok = [c for c in measured if works(c)]
        if not ok:
            continue  # only failed (or never trained) runs at this size: nothing to decide between
        dead = [c for c in measured if not works(c)]
        # finished, but timed only on a shared GPU: no time to rank them by
        untimed = [c for c in group if works(c) and c["peak_bytes"] is not None
                   and not c["step_time_s"] and c["shared"]]
        for budget in budgets:
            rows.append(_decision(cands, ok, size, budget, dead, untimed))
    return sorted(rows, key=lambda r: (r["device"], r["budget_bytes"], size_sort_key(r["image_size"])))


def works(cand: dict[str, Any]) -> bool:
    """A candidate ranked as a working technique set: some seed finished and not every
    finished seed did not train (memstudy.did_train; an unjudged run counts as trained)."""
    return cand["ok"] > cand["not_trained"]


def _decision(cands, ok, size, written_budget, dead=(), untimed=()) -> dict[str, Any]:
    budget, text = written_budget
    fitting = [c for c in ok if c["peak_bytes"] <= budget]
    left_out = sorted({c["name"] for c in dead if c["peak_bytes"] <= budget})
    no_time = sorted({c["name"] for c in untimed if c["peak_bytes"] <= budget})
    left_out_note = "; ".join(filter(None, (
        f"not ranked, {NOT_TRAINED}: {', '.join(left_out)}" if left_out else "",
        f"not ranked, timed only on a shared GPU: {', '.join(no_time)}" if no_time else "")))
    row = {"device": ok[0]["device"], "budget_bytes": budget, "budget": text, "image_size": size,
           "fits": f"{len({c['name'] for c in fitting})}/{len({c['name'] for c in ok})}"}
    if not fitting:
        closest = min(ok, key=lambda c: (c["peak_bytes"], c["name"], c["differs"]))
        row.update(name="(none fits)", note="; ".join(filter(None, (
            f"smallest peak {mb(closest['peak_bytes']):.0f} MB: {closest['name']}", left_out_note))))
        return row
    # a tie in time and peak goes to the name, not to the order the runs were recorded in
    best = min(fitting, key=lambda c: (c["step_time_s"], c["peak_bytes"], c["name"],
                                       c["differs"]))
    base = min((c for c in ok if c["name"] == BASELINE and c["comparison"] == best["comparison"]),
               key=lambda c: c["step_time_s"], default=None)
    q = quality_cost(cands, best, size)
    row.update(name=best["name"], differs=best["differs"], peak_mb=mb(best["peak_bytes"]),
               step_time_s=best["step_time_s"], step_time_s_std=best["step_time_s_std"],
               runs=best["ok"], val_loss_delta=q["delta"], val_loss_delta_std=q["std"],
               quality_epochs=q["epochs"], quality_seeds=q["seeds"],
               note="; ".join(filter(None, (_note(best, base, q["at"], size, q["under"]),
                                            left_out_note))))
    if base is not None:
        row["time_vs_original"] = best["step_time_s"] / base["step_time_s"]
    return row


def _note(best, base, quality_at, size, quality_under: str = "") -> str:
    notes = []
    if base is None:
        same = " with the same settings" if best["comparison"] else ""
        notes.append(f"original not measured ok at this size{same}")
    if quality_at is not None and quality_at != size:
        notes.append(f"quality at {quality_at} px")
    if quality_under:
        notes.append(f"quality from runs with {quality_under}")
    if best["not_trained"]:
        notes.append(f"{best['not_trained']} of {best['ok']} seeds {NOT_TRAINED} (quality "
                     "from the others)")
    if best["context_estimated"]:
        notes.append("context estimated")
    if best["shared"]:
        notes.append(f"time from {best['step_n']} of {best['ok']} runs (the others shared "
                     "their GPU)")
    return "; ".join(notes)


def written(budgets: list[int | str]) -> list[tuple[int, str]]:
    """(bytes, text) per budget, one per size: the text a user wrote wins over bytes."""
    out: dict[int, str] = {}
    for b in budgets:
        nbytes = parse_bytes(b, "budget")
        if isinstance(b, str) or nbytes not in out:
            out[nbytes] = b.strip() if isinstance(b, str) else size_text(nbytes)
    return sorted(out.items())


def _by(rows: Rows, *keys: str) -> dict[tuple, Rows]:
    out: dict[tuple, Rows] = defaultdict(list)
    for row in rows:
        out[tuple(row[k] for k in keys)].append(row)
    return dict(sorted(out.items(), key=lambda kv: (kv[0][0], size_sort_key(kv[0][1]))))


def pareto(db) -> Rows:
    """Per device and size, every finished single-device candidate with its absolute peak,
    step time and validation loss (one without a peak or a step time, e.g. timed only on a
    shared GPU, has no point and is left out); `pareto` marks those no other candidate
    dominates: none is at most as large and at most as slow and smaller or faster (so of two
    sets of equal peak only the faster is marked, two of equal peak and time both are).
    Sorted by peak, step time, then name (ties in a stable order)."""
    rows = []
    for (_device, _size), group in _by(candidates(db), "device", "image_size").items():
        ok = [c for c in group if works(c) and c["peak_bytes"] and c["step_time_s"]
              and c["world_size"] == 1]
        for c in ok:
            dominated = any(o is not c and o["peak_bytes"] <= c["peak_bytes"]
                            and o["step_time_s"] <= c["step_time_s"]
                            and (o["peak_bytes"], o["step_time_s"]) != (c["peak_bytes"], c["step_time_s"])
                            for o in ok)
            rows.append({k: c[k] for k in ("name", "image_size", "batch_size", "device",
                                           "step_time_s", "step_time_s_std", "val_loss",
                                           "val_loss_std", "budget", "label", "differs")}
                        | {"peak_mb": mb(c["peak_bytes"]), "runs": c["ok"], "epochs": c["epochs"],
                           "quality_seeds": c["val_n"], "pareto": "" if dominated else "*"})
    return sorted(rows, key=lambda r: (r["device"], size_sort_key(r["image_size"]),
                                       r["peak_mb"], r["step_time_s"], r["name"], r["differs"]))


def phase_groups(db) -> dict[tuple, Rows]:
    """Finished single-device runs (maxres probes left out) by experiment, seeds together,
    keyed (name, size, batch, device, label, differs, comparison: experiments.split)."""
    groups: dict[tuple, Rows] = defaultdict(list)
    for run in load_runs(db):
        if run["status"] == "ok" and run["world_size"] == 1:
            groups[experiment(run)].append(run)
    differs, same = label_experiments({k: g[0] for k, g in groups.items()})
    return {(r[0]["name"], r[0]["image_size"], r[0]["batch_size"], device_of(r[0]),
             r[0]["label"] or "-", differs[k], same[k]): r for k, r in groups.items()}


def phase_categories(db) -> Rows:
    """Per set, size and phase: MB held at the phase end in each category (mean over the
    group's runs; docs/metrics.md), their sum, and the phase's absolute peak beside them."""
    rows = []
    for (name, size, batch, device, label, differs, _same), runs in phase_groups(db).items():
        for phase in TRAIN_PHASES:
            cats = [r["metrics"].get(phase, {}) for r in runs]
            if not any("cat_params_bytes" in m for m in cats):
                continue
            row = {"name": name, "image_size": size, "batch_size": batch, "device": device,
                   "label": label, "differs": differs, "phase": phase, "runs": len(runs)}
            for key, _label in CATEGORIES:
                row[key] = mb(spread([m.get(key) for m in cats])[0])
            row["held_mb"] = sum(row[k] or 0.0 for k, _l in CATEGORIES)
            row["peak_abs_mb"] = mb(spread([r["peaks"].get(phase) for r in runs])[0])
            rows.append(row)
    return sorted(rows, key=_row_order)


def phase_peaks(db) -> Rows:
    """Per set and size: each phase's increment above its start (the study's figure) beside
    its absolute peak (what a budget caps), mean over seeds with their spread."""
    rows = []
    for (name, size, batch, device, label, differs, _same), runs in phase_groups(db).items():
        row = {"name": name, "image_size": size, "batch_size": batch, "device": device,
               "label": label, "differs": differs, "runs": len(runs)}
        for phase in TRAIN_PHASES:
            inc = spread([mb(phase_peak(r["metrics"].get(phase, {}))) for r in runs])
            absolute = spread([mb(r["peaks"].get(phase)) for r in runs])
            row[f"{phase}_inc_mb"], row[f"{phase}_inc_mb_std"] = inc[0], inc[1]
            row[f"{phase}_abs_mb"], row[f"{phase}_abs_mb_std"] = absolute[0], absolute[1]
        rows.append(row)
    return sorted(rows, key=_row_order)


def _row_order(row: dict[str, Any]) -> tuple:
    phase = TRAIN_PHASES.index(row["phase"]) if "phase" in row else 0
    return (row["device"], size_sort_key(row["image_size"]), row["name"] != BASELINE,
            row["name"], row.get("label", ""), row.get("differs", ""), phase)


COLUMNS = {
    "decisions": [("device", "device"), ("budget", "budget"), ("image_size", "px"),
                  ("name", "best techniques"), ("peak_mb", "peak MB"),
                  ("step_time_s", "step s"), ("time_vs_original", "time x original"),
                  ("val_loss_delta", "val loss - original"), ("fits", "sets fitting"),
                  ("runs", "n"), ("note", "note"), ("differs", DIFFERS)],
    "pareto": [("device", "device"), ("image_size", "px"), ("name", "techniques"),
               ("peak_mb", "peak MB"), ("step_time_s", "step s"), ("val_loss", "val loss"),
               ("runs", "n"), ("budget", "run budget"), ("label", "label"), ("pareto", "Pareto"),
               ("differs", DIFFERS)],
    "phase_categories": [("name", "techniques"), ("image_size", "px"), ("device", "device"),
                         ("label", "label"), ("phase", "phase")]
                        + [(k, f"{label} MB") for k, label in CATEGORIES]
                        + [("held_mb", "held MB"), ("peak_abs_mb", "peak abs MB"), ("runs", "n"),
                           ("differs", DIFFERS)],
    "phase_peaks": [("name", "techniques"), ("image_size", "px"), ("batch_size", "batch"),
                    ("device", "device"), ("label", "label")]
                   + [(f"{p}_{kind}_mb", f"{p.capitalize()} {label} MB") for p in TRAIN_PHASES
                      for kind, label in (("inc", "+"), ("abs", "abs"))]
                   + [("runs", "n"), ("differs", DIFFERS)],
}
TITLES = {
    "decisions": "Best technique set per budget and size: the fastest finished set whose "
                 "absolute peak fits (on a GPU the CUDA context included), against original",
    "pareto": "Peak memory against step time per size (Pareto = no other set is as small and "
              "as fast, and smaller or faster); validation loss beside",
    "phase_categories": "Memory held at each phase's end by category (MB), beside the "
                        "phase's absolute peak",
    "phase_peaks": "Per-phase peak: the study's increment above the phase start (+) beside "
                   "the absolute peak (abs)",
}
TABLES = {"decisions": decisions, "pareto": pareto, "phase_categories": phase_categories,
          "phase_peaks": phase_peaks}
