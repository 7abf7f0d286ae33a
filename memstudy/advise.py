"""`memstudy advise`: which technique sets should train a size under a budget, from what was
measured, before anything runs.

For each experiment recorded on the chosen GPU (single device, the requested batch size): the
runs of one technique set that agree on every measured setting but the image size and the
budget (memstudy.report.experiments; the budget is what advise reasons about, see below),
each training phase's absolute peak (report.decide: allocator + CUDA context, estimated from
the GPU's budgeted runs where a run did not measure it) is fitted as a + b * pixels by least
squares over the set's finished runs, as `memstudy maxres` fits it (maxres.fit_line), and so is
the step time. The predicted peak is the largest phase's value at the requested pixels.
Recorded runs overrule the fit: an ok run at the very size is a measurement, an out-of-memory
run at no more pixels under no larger budget says the set does not fit.

The trade-off: a line through a few sizes is cheap and usually right within the range it was
measured in, and increasingly wrong beyond it (allocator rounding, cuDNN choosing other
algorithms, a technique whose memory is not linear in pixels). So every prediction says how
it was obtained: `measured`, `interpolated` between two measured sizes, or `extrapolated`
with the pixel ratio beyond the nearest measured size, plus the fit's relative error at the
sizes it was fitted on. Predictions are stored with their experiment (table `predictions`);
`advise --check` sets each beside the runs of that experiment recorded after it, naming the
later runs of its set and size under other settings that it leaves out, and `--confirm` runs
the top candidate to make one.
"""
from __future__ import annotations

import copy
import json
import math
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from memstudy.byte_sizes import mb, parse_bytes
from memstudy.errors import ConfigError
from memstudy.maxres import fit_line
from memstudy.report.data import TRAIN_PHASES, device_of, load_runs, open_db, step_time
from memstudy.report.decide import candidates, contexts, missing_context, quality_cost
from memstudy.image_sizes import parse_size, size_hw, size_label
from memstudy.store import ResultsDB
from memstudy.techniques import canonical
from memstudy.report.notes import quality_warning
from memstudy.report.experiments import (describe as describe_settings, experiment,
                                         label_experiments, settings, technique_set)
from memstudy.text_table import format_table

CONFIRM_LABEL = "advise confirm"
# How far beyond its nearest measured size (in pixels) a line is trusted: the H100 checks of
# docs/advise.md ("Measured") were within 9% at 1.9x and 20% inside the range; farther,
# memory stops being linear (allocator rounding, cuDNN's choices). --confirm refuses more
# unless --force.
SAFE_REACH = 2.0
CONFIRM_TIMEOUT_S = 1800  # --confirm's default time limit: the study's grid specs' timeout_s
CONFIRM_PROGRESS_S = 30  # between --confirm's progress lines


@dataclass
class Prediction:
    name: str
    peak_bytes: float
    step_time_s: float | None
    phase: str  # the phase whose peak is largest at the requested size
    confidence: str
    fit_error: float | None  # largest relative residual of the peak fit at its own sizes
    fits: bool
    reach: float = 1.0  # pixels over the nearest measured size's, extrapolated (1: not)
    measured_px: list[int] = field(default_factory=list)  # the pixel counts the line went through
    why_not: str | None = None  # a recorded run that overrules the fit
    quality_under: str = ""  # the settings of the runs quality_cost compared, where not its own
    quality_epochs: int | None = None  # the fewer epochs and seeds of that pair
    quality_seeds: int | None = None
    differs: str = ""  # what sets it apart from the set's other experiments (experiments.split)
    experiment: dict[str, str] = field(default_factory=dict)  # its settings but ACROSS (stored)
    val_loss_delta: float | None = None
    quality_at: Any = None
    template: dict[str, Any] = field(default_factory=dict)  # config of the set's largest run
    phase_fits: dict[str, tuple[float, float]] = field(default_factory=dict)


def current_gpu() -> str | None:
    """This machine's first GPU by NVML, or None (no GPU, no driver)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0))
        return name.decode() if isinstance(name, bytes) else name
    except Exception:  # noqa: BLE001 (any NVML failure means: no GPU to name)
        return None


def choose_gpu(runs: list[dict], wanted: str | None) -> str:
    """The device whose runs advise reads: --gpu (a case-insensitive part of its name), else
    this machine's GPU if the database has runs on it, else the database's only device."""
    devices = sorted({device_of(r) for r in runs})
    if not devices:
        raise ConfigError("the results database holds no runs; record some first "
                          "(memstudy grid, memstudy maxres) or pass another --db")
    if wanted:
        match = [d for d in devices if wanted.lower() in d.lower()]
        if len(match) != 1:
            what = "no runs on" if not match else "several devices match"
            raise ConfigError(f"--gpu {wanted!r}: {what} it in this database; choose one of "
                              f"{devices}")
        return match[0]
    here = current_gpu()
    if here in devices:
        return here
    if len(devices) == 1:
        return devices[0]
    raise ConfigError(f"the database holds runs of several devices {devices}; choose one with "
                      "--gpu NAME")


def predict_all(db, budget: str, size, batch_size: int = 1, gpu: str | None = None
                ) -> tuple[str, list[Prediction], list[tuple[str, str]]]:
    """(device, predictions ranked: fitting sets fastest first, then the others by peak,
    [(set, why it has no prediction)])."""
    limit = parse_bytes(budget, "--budget")
    size = parse_size(size, "--size")
    hw = size_hw(size)
    if hw is None:
        raise ConfigError("advise needs a size in pixels (4188 or 4188x3500), not 'native'")
    pixels = hw[0] * hw[1]
    runs = load_runs(db, probes=True)
    device = choose_gpu(runs, gpu)
    context_by_gpu = contexts(runs)
    mine = [r for r in runs if device_of(r) == device and r["world_size"] == 1
            and r["batch_size"] == batch_size]
    if not mine:
        raise ConfigError(f"no single-device runs at batch size {batch_size} on {device}; "
                          "record some or change --batch-size")
    cands = [c for c in candidates(db) if c["device"] == device]
    predictions, skipped = [], []
    for runs_of, differs in experiments_of(mine):
        name = runs_of[0]["name"]
        try:
            p = predict_set(name, runs_of, pixels, size, limit, context_by_gpu.get(device, 0.0))
        except NoFit as exc:
            skipped.append((name + (f" ({differs})" if differs else ""), str(exc)))
            continue
        p.differs, p.experiment = differs, fit_settings(runs_of[0])
        like = {"name": name, "device": device, "batch_size": batch_size, "run": runs_of[-1]}
        q = quality_cost(cands, like, size)
        p.val_loss_delta, p.quality_at, p.quality_under = q["delta"], q["at"], q["under"]
        p.quality_epochs, p.quality_seeds = q["epochs"], q["seeds"]
        predictions.append(p)
    predictions.sort(key=lambda p: (not p.fits, p.step_time_s if p.fits and p.step_time_s
                                    is not None else math.inf, p.peak_bytes))
    return device, predictions, skipped


ACROSS = ("train.image_size", "budget")  # what one fit spans (experiments.experiment)


def fit_settings(run: dict) -> dict[str, str]:
    """The run's experiment settings but those a fit spans (ACROSS): what a prediction stores
    and --check compares a later run's with."""
    return {k: v for k, v in settings(run).items() if k not in ACROSS}


def experiments_of(runs: list[dict]) -> list[tuple[list[dict], str]]:
    """The runs by experiment across sizes and budgets, each with what sets it apart from the
    same set's other experiments; by set name."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for run in runs:
        groups[experiment(run, ACROSS)].append(run)
    differs, _same = label_experiments({k: g[0] for k, g in groups.items()}, technique_set,
                                       ACROSS)
    return sorted(((g, differs[k]) for k, g in groups.items()),
                  key=lambda item: (item[0][0]["name"], item[1]))


class NoFit(Exception):
    """A set with too few measured sizes for a prediction."""


def _pixels(run) -> int:
    h, w = size_hw(run["image_size"])
    return h * w


def predict_set(name: str, runs: list[dict], pixels: int, size, limit: int,
                context: float) -> Prediction:
    ok = [r for r in runs if r["status"] == "ok" and r["peaks"]]
    by_px: dict[int, list[dict]] = defaultdict(list)
    for r in ok:
        if size_hw(r["image_size"]) is not None:
            by_px[_pixels(r)].append(r)
    if len(by_px) < 2:
        raise NoFit(f"measured at {len(by_px)} size(s); a prediction needs two")
    xs = sorted(by_px)
    fits, worst = {}, (0.0 if len(xs) > 2 else None)  # a line through two points: no check
    for phase in TRAIN_PHASES:
        peaks = [max(_abs(r, phase, context) for r in by_px[px]) for px in xs]
        if None in peaks:
            continue
        fits[phase] = fit_line([math.sqrt(px) for px in xs], peaks)  # a + b * side**2 = pixels
        if worst is not None:
            worst = max(worst, max(abs(fits[phase][0] + fits[phase][1] * px - y) / y
                                   for px, y in zip(xs, peaks)))
    if not fits:
        raise NoFit("its runs recorded no per-phase peak")
    phase = max(fits, key=lambda p: fits[p][0] + fits[p][1] * pixels)
    peak = fits[phase][0] + fits[phase][1] * pixels
    steps = [(px, _median([step_time(r) for r in by_px[px]]))
             for px in xs]
    steps = [(px, s) for px, s in steps if s is not None]
    step = None
    if len(steps) >= 2:
        a, b = fit_line([math.sqrt(px) for px, _ in steps], [s for _, s in steps])
        step = max(a + b * pixels, 0.0) or None
    exact = by_px.get(pixels, [])
    if exact:  # a measurement at the very size beats the line
        peak = max(max(r["peaks"].values()) + missing_context(r, context) for r in exact)
        step = _median([step_time(r) for r in exact]) or step
    confidence, reach = _confidence(xs, pixels, bool(exact))
    pred = Prediction(name, peak, step, phase, confidence, worst, peak <= limit, reach, xs,
                      template=max(ok, key=_pixels)["config"], phase_fits=fits)
    pred.why_not = _recorded_oom(runs, pixels, limit)
    if pred.why_not:
        pred.fits = False
    return pred


def _abs(run: dict, phase: str, context: float) -> float | None:
    peak = run["peaks"].get(phase)
    return None if peak is None else peak + missing_context(run, context)


def _median(values: list[float | None]) -> float | None:
    present = sorted(v for v in values if v is not None)
    return present[len(present) // 2] if present else None


def _confidence(measured_px: list[int], pixels: int, exact: bool) -> tuple[str, float]:
    """(how the prediction was made, its reach: the pixel ratio beyond the nearest measured
    size, 1 inside the range); beyond SAFE_REACH the text says so."""
    side = lambda px: round(math.sqrt(px))  # noqa: E731 (a square of those pixels)
    if exact:
        return "measured", 1.0
    lo, hi = measured_px[0], measured_px[-1]
    if lo < pixels < hi:
        below = max(px for px in measured_px if px < pixels)
        above = min(px for px in measured_px if px > pixels)
        return f"interpolated {side(below)}-{side(above)} px", 1.0
    near = hi if pixels > hi else lo
    reach = max(pixels / near, near / pixels)
    unsafe = f", beyond the {SAFE_REACH:g}x advise trusts" if reach > SAFE_REACH else ""
    return f"extrapolated {pixels / near:.1f}x the pixels of {side(near)} px{unsafe}", reach


def check_reach(p: Prediction, size) -> None:
    """--confirm's refusal of a prediction extrapolated beyond SAFE_REACH, naming the sizes
    whose runs would bring it within reach or make it an interpolation (--force runs it)."""
    if p.reach <= SAFE_REACH:
        return
    h, w = size_hw(parse_size(size))
    pixels, above = h * w, h * w > p.measured_px[-1]
    within = math.sqrt(pixels / SAFE_REACH) if above else math.sqrt(pixels * SAFE_REACH)
    inside = math.sqrt(pixels)
    what = (f"at {math.ceil(within)} px or more (within {SAFE_REACH:g}x), or above "
            f"{math.floor(inside)} px (an interpolation)" if above else
            f"at {math.floor(within)} px or less (within {SAFE_REACH:g}x), or below "
            f"{math.ceil(inside)} px (an interpolation)")
    raise ConfigError(f"--confirm: {p.name} at {size_label(parse_size(size))} px is "
                      f"{p.confidence}: record it {what} first (memstudy run -t ... --size N), "
                      "or run it anyway with --confirm --force")


def _recorded_oom(runs: list[dict], pixels: int, limit: int) -> str | None:
    """An out-of-memory run at no more pixels under no larger budget: the set does not fit."""
    for r in runs:
        budget = r["config"].get("budget")
        if (r["status"] == "oom" and budget is not None and size_hw(r["image_size"])
                and _pixels(r) <= pixels and parse_bytes(budget) >= limit):
            return f"recorded oom in {r['failed_phase']} at {size_label(r['image_size'])} px under {budget}"
    return None


def needs(p: Prediction, pixels: int, limit: int) -> str:
    """What the closest set would need: a budget, or the largest square under this one."""
    sides = []
    for a, b in p.phase_fits.values():
        if b > 0:
            sides.append(math.sqrt(max(limit - a, 0) / b))
    side = int(min(sides)) if sides else None
    if p.why_not or p.peak_bytes <= limit:  # a recorded run overrules the line
        return "more than this budget, which a recorded run already exceeded"
    fit_side = f", or a size of at most ~{side} px (square) under this budget" if side else ""
    return f"a budget of at least {_gib(p.peak_bytes)}{fit_side}"


def _gib(nbytes: float) -> str:
    return f"{math.ceil(nbytes / 1024**3 * 10) / 10:g}GiB"


def refuse_if_none_fits(device: str, size, budget: str, preds: list[Prediction]) -> None:
    if any(p.fits for p in preds):
        return
    if not preds:
        raise ConfigError(f"no technique set on {device} was measured at two sizes; record "
                          "more runs (memstudy grid, memstudy maxres) before asking advise")
    limit = parse_bytes(budget, "--budget")
    h, w = size_hw(parse_size(size))
    # the set a recorded run does not already rule out, else any
    closest = min(preds, key=lambda p: (p.why_not is not None, p.peak_bytes))
    why = f" ({closest.why_not})" if closest.why_not else ""
    raise ConfigError(f"no technique set is predicted to fit {size_label(parse_size(size))} px "
                      f"under {budget} on {device}: the closest is {closest.name}"
                      f"{f' ({closest.differs})' if closest.differs else ''}, predicted "
                      f"peak {mb(closest.peak_bytes):.0f} MB{why}; it would need "
                      f"{needs(closest, h * w, limit)}")


def table(preds: list[Prediction], limit: int) -> str:
    differs = any(p.differs for p in preds)  # a set with several experiments: name each
    rows = [[rank + 1 if p.fits else "-", p.name, f"{mb(p.peak_bytes):.0f}",
             f"{p.peak_bytes / limit:.0%}", p.step_time_s, _delta(p), p.confidence,
             f"{p.fit_error:.0%}" if p.fit_error is not None else "-", p.phase,
             "yes" if p.fits else f"no{': ' + p.why_not if p.why_not else ''}"]
            + ([p.differs or "-"] if differs else [])
            for rank, p in enumerate(preds)]
    return format_table(["rank", "techniques", "peak MB", "of budget", "step s",
                         "val loss - original", "confidence", "fit error", "binding phase",
                         "fits"] + (["settings that differ"] if differs else []), rows)


def _delta(p: Prediction) -> str:
    if p.val_loss_delta is None:
        return "-"
    where = ", ".join(filter(None, (f"at {p.quality_at} px" if p.quality_at else "",
                                    f"from runs with {p.quality_under}" if p.quality_under else "")))
    return f"{p.val_loss_delta:+.4f}" + (f" ({where})" if where else "")


def store(db_path: str | Path, device: str, size, budget: str, batch_size: int,
          preds: list[Prediction]) -> float:
    """Record the predictions; returns their timestamp (runs finished after it check them)."""
    now = time.time()
    ResultsDB(db_path).add_predictions([
        {"created_at": now, "gpu_name": device, "name": p.name,
         "image_size": size_label(parse_size(size)), "batch_size": batch_size, "budget": budget,
         "budget_bytes": parse_bytes(budget), "fits": int(p.fits), "peak_bytes": p.peak_bytes,
         "step_time_s": p.step_time_s, "confidence": p.confidence,
         "experiment": json.dumps(p.experiment, sort_keys=True)} for p in preds])
    return now


def confirm_config(p: Prediction, size, budget: str):
    """The top candidate's run: its largest recorded run's settings at the requested size,
    under the budget, labelled so reports can tell it apart."""
    from memstudy.config import from_dict

    raw = copy.deepcopy(p.template)
    raw["train"]["image_size"] = parse_size(size)
    raw["budget"], raw["label"] = budget, CONFIRM_LABEL
    return from_dict(raw)


def confirm(db_path: str | Path, p: Prediction, size, budget: str,
            progress: Callable[[str], None], timeout_s: float = CONFIRM_TIMEOUT_S) -> str:
    """Run the candidate in its own process (the grid's run path) under a time limit, with a
    progress line every CONFIRM_PROGRESS_S; returns its outcome. A run past the limit is
    recorded as 'error in timeout', one stopped by Ctrl-C or SIGTERM as 'error in
    interrupted' (the KeyboardInterrupt goes on to the caller)."""
    from memstudy.grid import Watch, cells_folder, run_isolated

    cfg = confirm_config(p, size, budget)
    progress(f"confirming {p.name} at {size_label(parse_size(size))} px under {budget}: at most "
             f"{timeout_s:.0f} s (--timeout), progress in {cells_folder(db_path)}")
    watch = Watch(progress, CONFIRM_PROGRESS_S,
                  f"memstudy advise --budget {budget} --size {size} --confirm --timeout SECONDS",
                  "advise --confirm was interrupted (Ctrl-C or SIGTERM) and its run killed")
    return run_isolated(cfg, db_path, timeout_s, watch=watch)


NO_KEY = "no experiment key: recorded before advise stored one"


def check(db) -> list[dict[str, Any]]:
    """Each stored prediction beside the latest run of its experiment recorded after it: its
    set, size, batch and GPU, and every other setting of the fit's runs but size and budget
    (fit_settings, stored with it). The measured peak and step time, their relative errors,
    and whether the fit call was right (a run under no larger budget that ended ok or oom).
    Later runs of its set, size, batch and GPU under other settings are not used: `not_used`
    names them and what differs (a prediction with only such runs gets a row without a run).
    A prediction stored before advise kept its experiment (`keyed` False) is matched by set,
    size, batch and GPU only, as then."""
    db = open_db(db)
    try:
        preds = db.query("SELECT * FROM predictions ORDER BY id")
    except Exception:  # noqa: BLE001 (sqlite3.OperationalError: no advise has run here)
        return []
    runs = load_runs(db, probes=True)
    context_by_gpu = contexts(runs)
    defaults = fit_settings({})  # a setting added after the prediction reads as its default
    rows = []
    for p in preds:
        size = parse_size(p["image_size"])
        # the set as hashed: a run recorded under another spelling of it (a confirm run stores
        # every option spelled out) is the same set
        wanted = tuple(canonical(_specs(p["name"])))
        later = [r for r in runs if (r["name"] == p["name"] or technique_set(r) == wanted)
                 and r["image_size"] == size
                 and device_of(r) == p["gpu_name"] and r["batch_size"] == p["batch_size"]
                 and r["finished_at"] > p["created_at"]]
        if not later:
            continue
        key = p.get("experiment")
        key = None if key is None else defaults | json.loads(key)
        same = [r for r in later if key is None or not _apart(key, fit_settings(r))]
        row = (_checked(p, same[-1], context_by_gpu.get(p["gpu_name"], 0.0)) if same
               else _unchecked(p))
        used = {r["id"] for r in same}
        rows.append(row | {"prediction": p["id"], "keyed": key is not None,
                           "not_used": _not_used(key, [r for r in later if r["id"] not in used])})
    return rows


def _apart(key: dict[str, str], values: dict[str, str]) -> set[str]:
    """The settings in which a run's fit_settings differ from a prediction's."""
    return {k for k in key.keys() | values.keys() if key.get(k) != values.get(k)}


def _not_used(key: dict[str, str] | None, runs: list[dict]) -> list[str]:
    """'runs 7, 9 (data.train_images=6; predicted for data.train_images=4)': later runs of the
    prediction's set and size in another experiment, by what differs (experiments.describe)."""
    by_what: dict[tuple[str, str], list[int]] = defaultdict(list)
    for r in runs:
        values = fit_settings(r)
        apart = _apart(key, values)
        by_what[(describe_settings(values, apart), describe_settings(key, apart))].append(r["id"])
    return [f"run{'s' if len(ids) > 1 else ''} {', '.join(map(str, ids))} ({theirs}; predicted "
            f"for {ours})" for (theirs, ours), ids in by_what.items()]


def _unchecked(p: dict) -> dict[str, Any]:
    """The row of a prediction whose later runs are all of other experiments."""
    return {"name": p["name"], "size": p["image_size"], "budget": p["budget"],
            "gpu": p["gpu_name"], "confidence": p["confidence"], "run": None,
            "status": "no run of its experiment", "predicted_mb": mb(p["peak_bytes"]),
            "measured_mb": None, "peak_error": None, "predicted_s": p["step_time_s"],
            "measured_s": None, "step_error": None, "fit_call": "-"}


def _specs(name: str) -> list[str]:
    """A run name's technique specs ('amp:bf16+checkpoint'; 'original' is none)."""
    return [] if name in ("original", "none") else name.split("+")


def _checked(p: dict, run: dict, context: float) -> dict[str, Any]:
    peak = max(run["peaks"].values()) + missing_context(run, context) if run["peaks"] else None
    step = step_time(run)
    budget = run["config"].get("budget")
    judged = budget is not None and parse_bytes(budget) <= p["budget_bytes"] and run["status"] in ("ok", "oom")
    return {"name": p["name"], "size": p["image_size"], "budget": p["budget"],
            "gpu": p["gpu_name"], "confidence": p["confidence"], "run": run["id"],
            "status": run["status"], "predicted_mb": mb(p["peak_bytes"]), "measured_mb": mb(peak),
            "peak_error": _rel(p["peak_bytes"], peak), "predicted_s": p["step_time_s"],
            "measured_s": step, "step_error": _rel(p["step_time_s"], step),
            "fit_call": ("right" if bool(p["fits"]) == (run["status"] == "ok") else "wrong")
            if judged else "-"}


def _rel(predicted: float | None, measured: float | None) -> float | None:
    if predicted is None or not measured:
        return None
    return predicted / measured - 1


def check_table(rows: list[dict[str, Any]]) -> str:
    """The check rows as a table, and under it one line per prediction whose later runs of
    its set and size were not used (another experiment), one for those without a key."""
    pct = lambda v: "-" if v is None else f"{v:+.1%}"  # noqa: E731
    text = format_table(
        ["prediction", "techniques", "px", "budget", "confidence", "run", "status",
         "predicted MB", "measured MB", "peak error", "predicted s", "measured s", "step error",
         "fit call"],
        [[r["prediction"], r["name"], r["size"], r["budget"], r["confidence"], r["run"],
          r["status"], r["predicted_mb"], r["measured_mb"], pct(r["peak_error"]),
          r["predicted_s"], r["measured_s"], pct(r["step_error"]), r["fit_call"]] for r in rows])
    notes = [f"prediction {r['prediction']} ({r['name']} at {r['size']} px): not used, another "
             f"experiment: {'; '.join(r['not_used'])}" for r in rows if r["not_used"]]
    old = [str(r["prediction"]) for r in rows if not r["keyed"]]
    if old:
        notes.append(f"prediction{'s' if len(old) > 1 else ''} {', '.join(old)} ({NO_KEY}): "
                     "checked against runs of its techniques, size, batch and GPU, whatever "
                     "their other settings")
    return "\n".join([text, *notes])


def describe(device: str, size, budget: str, preds: list[Prediction]) -> str:
    limit = parse_bytes(budget, "--budget")
    peaks = ("live tensor bytes, parameters and optimizer state included" if device == "cpu"
             else "allocator bytes plus the CUDA context")  # what a budget caps there
    head = (f"{size_label(parse_size(size))} px under {budget} on {device}: "
            f"{sum(p.fits for p in preds)} of {len(preds)} technique sets predicted to fit "
            f"(fastest first; peaks: {peaks})")
    warning = quality_warning([vars(p) for p in preds], "val_loss_delta", "quality_epochs",
                              "quality_seeds")
    return "\n".join(filter(None, (head, table(preds, limit), warning)))


__all__ = ["Prediction", "check", "check_table", "choose_gpu", "confirm", "describe",
           "predict_all", "refuse_if_none_fits", "store"]
