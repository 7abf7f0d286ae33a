"""The meters measure what docs/metrics.md says, checked against independent counts."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from memstudy.config import MeterConfig
from memstudy.meters import LiveTensorMeter, PhaseRecorder, saved_tensors_of_graph, unique_storage_bytes
from memstudy.runner import execute
from memstudy.techniques.compose import build_pipeline, make_plan


def _forward_metrics(cfg):
    """Meter one forward of the U-Net; also count its saved tensors by walking the graph."""
    build = build_pipeline(make_plan(cfg))
    model, rt = build.model, build.runtime
    rec = PhaseRecorder(build.device, model, rt, lambda: None, MeterConfig(tensor="on"))
    size = cfg.train.image_size
    x = torch.rand(1, 1, size, size, generator=torch.Generator().manual_seed(0))
    with rec.step(measured=True):
        with rec.phase("forward"), rt.forward_context():
            out = model(x)
        state = [*model.parameters(), *model.buffers()]  # model state, not activations
        params = {(str(p.device), p.untyped_storage().data_ptr()) for p in state}
        graph = [t for t in saved_tensors_of_graph(out) if t.dim() > 0]  # hooks skip wrapped scalars
        independent = unique_storage_bytes(graph, exclude=params)
    return rec.measured["forward"][0], independent


def test_saved_bytes_equal_an_independent_count_of_the_graph(make_config):
    m, independent = _forward_metrics(make_config(192))
    assert m["saved_bytes"] == independent
    assert independent > 10 * 2**20
    # what forward leaves alive is what it saved for backward (the sigmoid's output among it)
    assert abs(m["tensor_held_bytes"] - m["saved_bytes"]) < 0.02 * m["saved_bytes"]


def test_saved_bytes_scale_with_pixel_count(make_config):
    small, _ = _forward_metrics(make_config(192))
    large, _ = _forward_metrics(make_config(384))
    ratio = large["saved_bytes"] / small["saved_bytes"]
    assert abs(ratio - 4) < 0.4, ratio


def test_tensor_meter_counts_storages_once_and_releases_them():
    meter = LiveTensorMeter()
    with meter:
        a = torch.ones(1000)  # 4000 bytes
        view = a[:10]  # a view shares the storage: not counted again
        b = a + 1
        assert meter.current == 8000 and meter.peak == 8000
        a.add_(1)  # in place: no new storage
        del b
        assert meter.current == 4000
        del a, view
        assert meter.current == 0 and meter.peak == 8000


def test_tensor_meter_enforces_a_limit_with_out_of_memory():
    meter = LiveTensorMeter(limit_bytes=10_000)
    with meter:
        keep = torch.ones(1000)
        try:
            torch.ones(2000)
        except torch.OutOfMemoryError as exc:
            assert "budget" in str(exc)
        else:
            raise AssertionError("limit not enforced")
    assert keep.numel() == 1000


def test_run_records_phase_categories_that_add_up(make_config):
    rec = execute(make_config(192), db=None)
    assert rec.status == "ok", rec.error
    m = {(p, n): v for _, p, n, v in rec.metrics}
    weights = rec.env["parameters"] * 4  # float32
    assert weights <= m[("forward", "cat_params_bytes")] < 1.01 * weights  # + BatchNorm buffers
    # after backward the gradients equal the parameters in size; after step they are freed
    assert m[("backward", "cat_grads_bytes")] == weights
    assert m[("step", "cat_grads_bytes")] == 0
    assert m[("step", "tensor_held_bytes")] == -m[("backward", "cat_grads_bytes")]
    adam = m[("backward", "cat_optimizer_bytes")]
    assert 2 * weights <= adam < 2.01 * weights  # Adam's two moments (+ a step counter per tensor)
    assert m[("forward", "saved_bytes")] > 0 and m[("forward", "time_s")] > 0
    assert ("run", "step_time_s") in m and ("run", "metered_step_time_s") in m
    # the host's peak beside the device's: at least the model, its gradients and Adam's state
    assert m[("run", "host_peak_bytes")] > 4 * weights


def test_the_plain_steps_spread_is_recorded_beside_their_median(make_config):
    cfg = make_config(64, msssim_scales=1)
    cfg.data.train_images = 5  # 1 warm-up, 1 measured, 3 plain
    rec = execute(cfg, db=None)
    assert rec.status == "ok", rec.error
    m = {(p, n): v for _, p, n, v in rec.metrics}
    assert m[("run", "plain_steps")] == 3
    assert m[("run", "step_time_min_s")] <= m[("run", "step_time_s")] <= m[("run", "step_time_max_s")]
    assert m[("run", "step_time_min_s")] < m[("run", "step_time_max_s")]  # three real clocks


@pytest.mark.gpu
@pytest.mark.alone
def test_allocator_tensor_meter_and_nvml_agree_on_cuda(make_config):
    """Three independent meters on one CUDA run (H200 at 512 px: forward 387.9 vs 386.9 MB).
    Backward's allocator peak also holds cuDNN's convolution workspaces, which no tensor the
    tensor meter sees holds (H100, 512 px: 74.7 vs 32.5 MB with cudnn.benchmark on and off
    alike), so there the tensor meter must only not exceed the allocator."""
    cfg = make_config(512, device="cuda", warmup_steps=2, measure_steps=2, validate=False)
    cfg.data.train_images = 5
    cfg.meter.tensor = "on"
    rec = execute(cfg, db=None)
    assert rec.status == "ok", rec.error
    m = {(p, n): v for _, p, n, v in rec.metrics}
    for phase in ("forward", "backward", "step"):
        alloc, tensor = m[(phase, "alloc_peak_bytes")], m[(phase, "tensor_peak_bytes")]
        if phase == "backward":
            assert tensor <= alloc + 2**20, (phase, alloc, tensor)
        else:
            assert abs(alloc - tensor) <= 0.05 * alloc + 2**20, (phase, alloc, tensor)
        # NVML sees the allocator's reserved segments plus the CUDA context
        assert m[(phase, "nvml_peak_bytes")] > m[(phase, "reserved_peak_bytes")]
        assert m[(phase, "alloc_retries")] == 0  # recorded per phase; no cap, no retry


# -- other processes on the GPU ------------------------------------------------------------
class _Process:
    def __init__(self, pid: int):
        self.pid = pid


def test_gpu_neighbours_keep_the_most_other_processes_seen(monkeypatch):
    """NVML lists this process too; an empty list or an NVML error says nothing (unknown)."""
    import pynvml

    from memstudy.meters.nvml import GpuNeighbours

    listed: list = []

    def processes(handle):
        if listed == ["error"]:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return [_Process(pid) for pid in listed]

    monkeypatch.setattr(pynvml, "nvmlDeviceGetComputeRunningProcesses", processes)
    seen = GpuNeighbours(handle=None)
    # pids of another namespace (this process's own is not listed): all but one are others
    for now, most in (([], None), (["error"], None), ([7], 0), ([7, 8, 9], 2), ([7], 2),
                      (["error"], 2)):
        listed[:] = now
        seen.look()
        assert seen.most == most, now
    # this process's own pid listed: it and the processes it started are not others
    import os
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        listed[:] = [os.getpid(), child.pid]
        mine = GpuNeighbours(handle=None)
        mine.look()
        assert mine.most == 0
        listed[:] = [os.getpid(), child.pid, os.getppid()]  # the test's parent did not start from it
        mine.look()
        assert mine.most == 1
    finally:
        child.kill()


def test_the_recorder_records_other_processes_it_looked_at(monkeypatch):
    """A measured step looks, and the run's summary carries the most seen; a recorder that
    never learnt anything records nothing (not a 0 that would claim the GPU was free)."""
    from memstudy.meters.nvml import GpuNeighbours

    counts = iter([0, 2, 1])

    def look(self):
        self.most = max(self.most or 0, next(counts))

    monkeypatch.setattr(GpuNeighbours, "look", look)
    rec = PhaseRecorder(torch.device("cpu"), torch.nn.Linear(2, 2), None, lambda: None,
                        MeterConfig(tensor="off", nvml=False))
    assert "gpu_other_processes" not in rec.summary()["run"]
    rec.neighbours = GpuNeighbours(handle=None)
    assert "gpu_other_processes" not in rec.summary()["run"]
    for _ in range(3):
        rec.look_at_gpu()
    assert rec.summary()["run"]["gpu_other_processes"] == 2


def test_memstudy_run_says_when_the_gpu_was_shared():
    from memstudy.cli import summarize
    from memstudy.store import RunRecord

    def record(others):
        metrics = [] if others is None else [(0, "run", "gpu_other_processes", others)]
        return RunRecord(config={"train": {"image_size": 256, "batch_size": 1}, "world_size": 1},
                         config_hash="h", name="original", status="ok",
                         env={"device": "cuda:0", "gpu_name": "Test GPU"}, started_at=0.0,
                         metrics=metrics)

    assert "the GPU was shared: 2 other process(es)" in summarize(record(2))
    assert "shared" not in summarize(record(0)) and "shared" not in summarize(record(None))


def test_the_training_loop_looks_at_the_gpu_after_every_epoch(make_config, monkeypatch):
    """Cells that share a GPU may start after a run's metered steps: the loop looks at each
    epoch's end too (3 epochs of 1 step, only the first step measured: once for that step,
    before its clock, + 3 epochs)."""
    looks = []
    monkeypatch.setattr(PhaseRecorder, "look_at_gpu", lambda self: looks.append(1))
    cfg = make_config(192, epochs=3, warmup_steps=0, measure_steps=1, validate=False)
    cfg.data.train_images = 1
    assert execute(cfg, db=None).status == "ok"
    assert len(looks) == 1 + 3


@pytest.mark.gpu
@pytest.mark.alone
def test_a_run_beside_another_process_on_its_gpu_says_so(make_config):
    """Another process holding a CUDA context on the GPU is seen (gpu_other_processes >= 1);
    alone, the count is 0."""
    import os
    import signal
    import subprocess
    import sys
    import time

    cfg = make_config(256, device="cuda", warmup_steps=1, measure_steps=1, validate=False)
    alone = execute(cfg, db=None)
    m = {(p, n): v for _, p, n, v in alone.metrics}
    if ("run", "gpu_other_processes") not in m:
        pytest.skip("NVML lists no process on this GPU (not even this one)")
    # the neighbour must not descend from this process (a run leaves out the processes it
    # started, a compiler's workers say): the shell starts it in the background and exits, so
    # it is reparented
    holder = ("import os, time, torch; torch.zeros(1, device='cuda'); "
              "print(os.getpid(), flush=True); time.sleep(120)")
    shell = subprocess.Popen(["sh", "-c", '"$0" -c "$1" &', sys.executable, holder],
                             stdout=subprocess.PIPE, text=True)
    other_pid = int(shell.stdout.readline())
    try:
        time.sleep(0.5)
        beside = execute(cfg, db=None)
    finally:
        os.kill(other_pid, signal.SIGKILL)
        shell.wait()
    assert m[("run", "gpu_other_processes")] == 0
    assert {(p, n): v for _, p, n, v in beside.metrics}[("run", "gpu_other_processes")] >= 1


# -- per-phase peaks of a network small enough to count by hand ----------------------------
B, IN, OUT, F32 = 8, 256, 128, 4  # batch, Linear in / out features, bytes per float32


def _linear_phases(momentum: float) -> dict[str, dict[str, float]]:
    """One measured step of y = x W^T (no bias), loss = sum(y * target), SGD."""
    from torch import nn

    from memstudy.runtime import Runtime

    torch.manual_seed(0)
    model = nn.Linear(IN, OUT, bias=False)
    rt = Runtime(device=torch.device("cpu"), batch_size=B, loss_fn=lambda out, y: (out * y).sum(),
                 optimizer_factory=lambda m: torch.optim.SGD(m.parameters(), lr=0.1,
                                                             momentum=momentum, foreach=False))
    optimizer = rt.optimizer_factory(model)
    rec = PhaseRecorder(torch.device("cpu"), model, rt, lambda: optimizer,
                        MeterConfig(tensor="on", nvml=False))
    x, y = torch.rand(B, IN), torch.rand(B, OUT)
    with rec.step(measured=True):
        with rec.phase("forward"):
            loss = rt.forward(model, x, y)
        with rec.phase("backward"):
            rt.backward(loss)
        del loss
        with rec.phase("step"):
            rt.step(optimizer)
    return {phase: recs[0] for phase, recs in rec.measured.items()}


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_phase_peaks_equal_a_count_by_hand(momentum):
    """Each phase's peak is above the memory held when *that* phase began: the step's own
    allocations only, however high forward and backward went before it."""
    m = _linear_phases(momentum)
    out, weight, scalar = B * OUT * F32, IN * OUT * F32, F32
    # forward: the output, the product with the target, the loss
    assert m["forward"]["tensor_peak_bytes"] == 2 * out + scalar
    # backward: the loss's seed gradient, the output's gradient, the weight's gradient
    assert m["backward"]["tensor_peak_bytes"] == scalar + out + weight
    assert m["backward"]["cat_grads_bytes"] == weight
    # step: plain SGD updates in place (nothing); with momentum its buffer (one weight) appears
    assert m["step"]["tensor_peak_bytes"] == (weight if momentum else 0)
    assert m["step"]["cat_optimizer_bytes"] == (weight if momentum else 0)
    assert m["step"]["cat_grads_bytes"] == 0  # zero_grad(set_to_none) freed the gradient


# -- out of memory in each phase -------------------------------------------------------------
@pytest.mark.parametrize("phase", ["forward", "backward", "step", "validation"])
def test_out_of_memory_is_recorded_with_the_phase_it_happened_in(make_config, monkeypatch,
                                                                  tmp_path, phase):
    import memstudy.runner as runner
    import memstudy.train as train_loop
    from memstudy.store import ResultsDB

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError(f"injected in {phase}")

    real_build = runner.build_pipeline

    def build_with_failure(plan):
        build = real_build(plan)
        if phase != "validation":  # Runtime.forward / backward / step
            setattr(build.runtime, phase, out_of_memory)
        return build

    cfg = make_config(64, msssim_scales=1, warmup_steps=0, measure_steps=1, max_steps=1,
                      optimizer="sgd")
    cfg.data.train_images = 1
    db = ResultsDB(tmp_path / "results.sqlite")
    first = execute(cfg, db)  # recorded before the failing run: must survive it
    assert first.status == "ok", first.error
    monkeypatch.setattr(runner, "build_pipeline", build_with_failure)
    if phase == "validation":
        monkeypatch.setattr(train_loop, "validation_forward", out_of_memory)
    rec = execute(cfg, db)
    assert (rec.status, rec.failed_phase) == ("oom", phase), (rec.status, rec.failed_phase, rec.error)
    assert f"injected in {phase}" in rec.error
    rows = db.runs()
    assert [(r["status"], r["failed_phase"]) for r in rows] == [("ok", None), ("oom", phase)]


HOST_PEAK_PROBE = """
import os
import numpy as np
from memstudy.meters.recorder import host_peak_bytes
before = host_peak_bytes()
with open("/proc/self/statm") as statm:
    resident = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
block = np.ones(int(before - resident + 256 * 2**20) // 8)  # written: resident past the peak
after = host_peak_bytes()
del block
print(before, after, host_peak_bytes())
"""


def test_host_peak_follows_what_the_process_holds():
    """host_peak_bytes: the process's peak resident set. In a fresh process (whose peak so far
    is its imports' own, under a GiB), holding 256 MiB more than that peak raises it by about
    that much; it is never lowered."""
    if not Path("/proc/self/statm").exists():
        pytest.skip("needs /proc (Linux) to read the resident set now")
    out = subprocess.run([sys.executable, "-c", HOST_PEAK_PROBE], capture_output=True, text=True,
                         check=True).stdout
    before, after, later = map(float, out.split())
    assert 200 * 2**20 < after - before < 400 * 2**20, (before, after)
    assert later >= after - 2**20  # the kernel syncs its RSS counters lazily: within pages
