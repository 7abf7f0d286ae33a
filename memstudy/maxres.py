"""Largest square image that trains under a memory budget: `memstudy maxres`.

Any side, not only multiples of 32 (the model pads its input; see --step and --max-size).

For each technique set: first a prediction, then a search, reported side by side.
- Prediction: train at 2-3 small sizes, fit peak memory = a + b * pixels by least squares
  (parameters, gradients and optimizer state are the constant a; activations grow with the
  pixels), and solve a + b * pixels = budget; floored to the 64 px grid.
- Search: probes on a grid of `--step` px (default 64; any step, e.g. 1 or 4, is allowed:
  sizes need not be multiples of 32, the model pads them) plus `--max-size` itself, each a
  real run of `max_steps` steps (forward, backward and optimizer step) under the budget, in
  its own process. It starts at the prediction, strides away from it (1, 2, 4 ... grid
  steps) until the outcome flips, then bisects. A probe
  that fails with anything but out-of-memory stops the search with that error: a size is
  never called "does not fit" because of an unrelated failure.
Peak memory is what the budget caps (memstudy.report.data.absolute_phase_peaks): on CUDA
the allocator's peak plus the CUDA context (as measured by NVML when the budget was
applied); on the CPU the tensor meter's peak of live bytes. Probes are ordinary runs in the database (label 'maxres probe'); a probe whose
config hash is already recorded is read back, not rerun. Results go to the `maxres` table.
"""
from __future__ import annotations

import bisect
import copy
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from memstudy.budget import budget_bytes
from memstudy.config import RunConfig
from memstudy.errors import ConfigError
from memstudy.grid import config_hash, run_isolated
from memstudy.runner import execute, run_name
from memstudy.report.data import TRAIN_PHASES, absolute_phase_peaks
from memstudy.store import PROBE_LABEL, ResultsDB
from memstudy.byte_sizes import mb

GRID_PX = 64
MIN_PX = 192  # the smallest multiple of 64 that 5-scale MS-SSIM accepts
PROBE_MEASURED = 2  # measured steps per probe, after the config's warm-up steps

class ProbeError(RuntimeError):
    """A probe failed for a reason other than memory; the search cannot conclude."""


@dataclass
class Probe:
    size: int
    status: str  # ok / oom / error / diverged
    failed_phase: str | None
    peak_bytes: float | None  # the largest of phase_peaks
    step_time_s: float | None
    phase_peaks: dict[str, float] = field(default_factory=dict)
    device: str | None = None
    gpu_name: str | None = None


@dataclass
class MaxresResult:
    name: str
    techniques: list[str]
    budget: str
    budget_bytes: int
    fit_sizes: list[int]
    fit: tuple[float, float] | None = None  # (a, b) of the phase that binds first
    fit_phase: str | None = None
    predicted_px: int | None = None
    found_px: int | None = None
    probes: list[Probe] = field(default_factory=list)
    error: str | None = None
    max_size: int | None = None  # the search's upper end: found_px == max_size is a lower bound
    ceiling: int | None = None  # where a kernel limit, not memory, lowered that end (px)
    network: str = ""  # the network and task searched ('resnet34 U-Net, enhance')

    def at_found(self) -> Probe | None:
        return next((p for p in self.probes if p.size == self.found_px and p.status == "ok"), None)


def fit_line(sizes: list[int], peaks: list[float]) -> tuple[float, float]:
    """Least squares of peak = a + b * size**2."""
    xs = [float(s) ** 2 for s in sizes]
    n, mx, my = len(xs), sum(xs) / len(xs), sum(peaks) / len(peaks)
    sxx = sum((x - mx) ** 2 for x in xs)
    if n < 2 or sxx == 0:
        raise ConfigError("the maxres prediction needs at least two different fit sizes")
    b = sum((x - mx) * (y - my) for x, y in zip(xs, peaks)) / sxx
    return my - b * mx, b


def predict_px(a: float, b: float, limit: int) -> int | None:
    """The largest size on the 64 px grid whose predicted peak is within `limit`."""
    if b <= 0 or limit <= a:
        return None
    return int(math.sqrt((limit - a) / b)) // GRID_PX * GRID_PX


def predict(probes: list[Probe], limit: int) -> tuple[str, tuple[float, float], int | None]:
    """Fit each phase's peak on its own and keep the phase that reaches the budget first.

    One line through the largest peak would bend: at small sizes the optimizer step (a
    constant) can dominate, at large ones backward (activations); each phase alone is a line.
    """
    best = None
    for phase in TRAIN_PHASES:
        if all(phase in p.phase_peaks for p in probes):
            fit = fit_line([p.size for p in probes], [p.phase_peaks[phase] for p in probes])
            px = predict_px(*fit, limit)
            never_grows = fit[1] <= 0 and fit[0] <= limit  # this phase never binds
            size = math.inf if never_grows else px or 0
            if best is None or size < best[0]:
                best = (size, phase, fit, px)
    if best is None:
        raise ProbeError("the fit probes measured no per-phase peak memory")
    return best[1], best[2], best[3]


def size_grid(lo: int, hi: int, step: int = GRID_PX) -> list[int]:
    """The sizes a search may probe: multiples of `step` in [lo, hi], and both ends themselves
    (so --max-size 4188 probes 4188, not only 4160)."""
    first = -(-lo // step) * step
    return sorted({lo, hi, *range(first, hi + 1, step)})


def search(fits: Callable[[int], bool], start: int, lo: int = MIN_PX, hi: int = 8192,
           step: int = GRID_PX) -> int | None:
    """Largest size of `size_grid(lo, hi, step)` for which fits(size) holds (monotone)."""
    grid = size_grid(lo, hi, step)
    i = max(bisect.bisect_right(grid, start) - 1, 0)  # the grid size at or below start
    if fits(grid[i]):  # stride up until a size fails
        ok, stride = i, 1
        while True:
            n = min(ok + stride, len(grid) - 1)
            if n <= ok:
                return grid[ok]
            if not fits(grid[n]):
                fail = n
                break
            ok, stride = n, stride * 2
    else:  # stride down until a size fits
        fail, stride = i, 1
        while True:
            n = max(fail - stride, 0)
            if n >= fail:
                return None
            if fits(grid[n]):
                ok = n
                break
            fail, stride = n, stride * 2
    while fail - ok > 1:
        mid = (ok + fail) // 2
        ok, fail = (mid, fail) if fits(grid[mid]) else (ok, mid)
    return grid[ok]


def probe_config(template: RunConfig, techniques: list[str], size: int) -> RunConfig:
    cfg = copy.deepcopy(template)
    cfg.techniques, cfg.train.image_size, cfg.label = list(techniques), size, PROBE_LABEL
    return cfg


def prepare_template(template: RunConfig) -> RunConfig:
    """Probes train `max_steps` steps (default: the warm-up steps + 2 measured ones) without
    validation, on as few images."""
    cfg = copy.deepcopy(template)
    steps = cfg.train.max_steps = cfg.train.max_steps or cfg.train.warmup_steps + PROBE_MEASURED
    cfg.train.validate = False
    cfg.data.train_images = min(cfg.data.train_images, steps * cfg.train.batch_size)
    cfg.train.epochs = max(cfg.train.epochs, steps)  # few images: epochs until max_steps stops it
    cfg.data.val_images = 1
    return cfg


class Prober:
    """Runs (or reads back) probes of one technique set and remembers them in order."""

    def __init__(self, template: RunConfig, techniques: list[str], db_path: str | Path,
                 isolate: bool, timeout_s: float | None, progress: Callable[[str], None]):
        self.template, self.techniques, self.db_path = template, techniques, str(db_path)
        self.isolate, self.timeout_s, self.progress = isolate, timeout_s, progress
        self.probes: list[Probe] = []

    def run(self, size: int) -> Probe:
        cfg = probe_config(self.template, self.techniques, size)
        key = config_hash(cfg)
        db = ResultsDB(self.db_path)
        if key not in db.recorded_hashes():
            if self.isolate:
                run_isolated(cfg, self.db_path, self.timeout_s)
            else:
                execute(copy.deepcopy(cfg), db)
        probe = read_probe(db, key, size)
        self.probes.append(probe)
        what = probe.status + (f" in {probe.failed_phase}" if probe.failed_phase else "")
        peak = f", peak {mb(probe.peak_bytes):.0f} MB" if probe.peak_bytes else ""
        self.progress(f"  {run_name(cfg)} {size} px: {what}{peak}")
        if probe.status not in ("ok", "oom"):
            raise ProbeError(f"probe at {size} px ended {what}; see the run in {self.db_path}")
        return probe

    def fits(self, size: int) -> bool:
        return self.run(size).status == "ok"


def read_probe(db: ResultsDB, config_hash: str, size: int) -> Probe:
    rows = db.query("SELECT * FROM runs WHERE config_hash = ? ORDER BY id DESC LIMIT 1",
                    (config_hash,))
    if not rows:
        raise ProbeError(f"the probe at {size} px left no record (killed or crashed)")
    row = rows[0]
    metrics = {phase: m for (_rank, phase), m in db.metrics(row["id"]).items()}
    peaks = absolute_phase_peaks(metrics, json.loads(row["env_json"]))
    return Probe(size, row["status"], row["failed_phase"], max(peaks.values(), default=None),
                 metrics.get("run", {}).get("step_time_s"), peaks, row["device"], row["gpu_name"])


def maxres(template: RunConfig, techniques: list[str], db_path: str | Path,
           fit_sizes: list[int], max_size: int = 8192, isolate: bool = True,
           timeout_s: float | None = None,
           progress: Callable[[str], None] | None = None, step: int = GRID_PX) -> MaxresResult:
    """Predict, then search, the largest trainable size of one technique set."""
    progress = progress or (lambda _msg: None)
    check_search_range(max_size, step)
    template = prepare_template(template)
    limit = budget_bytes(template.budget)
    if limit is None:
        raise ConfigError("maxres needs a budget; set budget (--budget 8GiB)")
    result = MaxresResult(run_name(probe_config(template, techniques, 0)), list(techniques),
                          str(template.budget), limit, sorted(fit_sizes),
                          network=f"{template.model.describe()}, {template.train.task}")
    prober = Prober(template, techniques, db_path, isolate, timeout_s, progress)
    try:
        fitted = [prober.run(s) for s in result.fit_sizes]
        usable = [p for p in fitted if p.status == "ok" and p.phase_peaks]
        if len(usable) >= 2:
            result.fit_phase, result.fit, result.predicted_px = predict(usable, limit)
        start = result.predicted_px or max([p.size for p in usable] or [MIN_PX])
        progress(f"  {result.name}: predicted {result.predicted_px} px; searching from {start} px")
        result.max_size = max_size  # a probed size itself, multiple of the step or not
        ceiling = kernel_ceiling(template, techniques)
        if ceiling is not None and ceiling < max_size:  # no probe past it: it could not run
            result.max_size = result.ceiling = ceiling
        result.found_px = search(prober.fits, min(start, result.max_size), MIN_PX,
                                 result.max_size, step)
    except ProbeError as exc:
        result.error = str(exc)
    result.probes = prober.probes
    return result


def check_search_range(max_size: int, step: int) -> None:
    if not isinstance(step, int) or step < 1:
        raise ConfigError(f"maxres --step must be a whole number of px >= 1 (got {step!r})")
    if not isinstance(max_size, int) or max_size < MIN_PX:
        raise ConfigError(f"maxres --max-size must be >= {MIN_PX} px (got {max_size!r})")


def config_key(template: RunConfig, techniques: list[str]) -> str:
    return config_hash(probe_config(template, techniques, 0))


def store_result(db_path: str | Path, template: RunConfig, result: MaxresResult) -> None:
    """Replace this technique set's earlier result for the same settings, in one transaction."""
    template = prepare_template(template)
    key = config_key(template, result.techniques)
    best = result.at_found()
    probe0 = best or (result.probes[0] if result.probes else None)
    fit_a, fit_b = result.fit or (None, None)
    ResultsDB(db_path).replace_maxres(dict(
        config_key=key, name=result.name, techniques_json=json.dumps(result.techniques),
        budget=str(result.budget), budget_bytes=result.budget_bytes,
        device=probe0.device if probe0 else None, gpu_name=probe0.gpu_name if probe0 else None,
        batch_size=template.train.batch_size, fit_sizes_json=json.dumps(result.fit_sizes),
        fit_phase=result.fit_phase, fit_a=fit_a, fit_b=fit_b, predicted_px=result.predicted_px,
        found_px=result.found_px, step_time_s=best.step_time_s if best else None,
        peak_bytes=best.peak_bytes if best else None,
        probes_json=json.dumps([[p.size, p.status, p.peak_bytes] for p in result.probes]),
        error=result.error, created_at=time.time()))


def search_all(template: RunConfig, technique_sets: list[list[str]], db_path: str | Path,
               fit_sizes: list[int], max_size: int = 8192, isolate: bool = True,
               timeout_s: float | None = None,
               progress: Callable[[str], None] | None = None,
               step: int = GRID_PX) -> list[MaxresResult]:
    check_search_range(max_size, step)
    check_sets(template, technique_sets, min(fit_sizes))
    results = []
    for techniques in technique_sets:
        if progress:
            progress(f"maxres {run_name(probe_config(template, techniques, 0))} under {template.budget}")
        result = maxres(template, techniques, db_path, fit_sizes, max_size, isolate, timeout_s,
                        progress, step)
        store_result(db_path, template, result)
        results.append(result)
    return results


def check_sets(template: RunConfig, technique_sets: list[list[str]], size: int) -> None:
    """Refuse a bad set (unknown technique or option, impossible combination, no GPU for
    train.device) before any probe: in a probe's process the error would only read as a probe
    that left no record."""
    from memstudy.techniques.compose import make_plan  # torch-heavy: only when searching

    for techniques in technique_sets:
        make_plan(probe_config(prepare_template(template), techniques, size))


def kernel_ceiling(template: RunConfig, techniques: list[str]) -> int | None:
    """The largest square the set may train at all, whatever the memory: PyTorch's channels_last
    up-sampling backward (compose.upsampling_ceiling); None without such a limit."""
    from memstudy.techniques.compose import make_plan, upsampling_ceiling

    return upsampling_ceiling(make_plan(probe_config(template, techniques, MIN_PX)))


def _note(r: MaxresResult) -> str:
    if r.found_px is not None and r.found_px == r.ceiling:
        return (f"reached {r.ceiling} px, the largest PyTorch's channels_last up-sampling "
                "backward allows this set (add tile)")
    if r.found_px is not None and r.found_px == r.max_size:
        return "reached the largest size probed (raise --max-size)"
    return "does not train at the smallest size" if r.found_px is None else ""


def maxres_table(results: list[MaxresResult]) -> str:
    from memstudy.text_table import format_table

    rows = []
    for r in results:
        at = r.at_found()
        rows.append([r.name, r.network, r.budget, r.predicted_px, r.found_px,
                     mb(at.peak_bytes) if at and at.peak_bytes else None,
                     at.step_time_s if at else None, len(r.probes), r.error or _note(r)])
    return format_table(["techniques", "network", "budget", "predicted px", "found px",
                         "peak MB", "step s", "probes", "note"], rows)
