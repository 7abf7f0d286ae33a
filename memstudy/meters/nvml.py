"""Device-level used memory from NVML, the source study's own measure.

NVML's "used" counts everything on the GPU: the CUDA context, the caching allocator's
reserved blocks, cuDNN/cuBLAS workspaces and other processes. A background thread polls
it while a measured phase runs; `phase_start`/`phase_end` take a sample synchronously,
so even a phase shorter than the interval has two samples. Between measured phases the
thread sleeps on an event without waking up, so plain steps share the CPU with nothing.
"""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import torch


class NvmlSampler:
    def __init__(self, device: torch.device, interval_s: float):
        import pynvml  # noqa: F401 - fail here, clearly, if nvidia-ml-py is missing

        self.device = device
        self.interval_s = interval_s
        self.peak = 0
        self.samples = 0
        self._active = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="memstudy-nvml", daemon=True)
        self.sample()  # fails now if NVML cannot see the device
        self._thread.start()

    def sample(self) -> int:
        used = torch.cuda.device_memory_used(self.device)  # NVML, with CUDA_VISIBLE_DEVICES mapped
        self.samples += 1
        if used > self.peak:
            self.peak = used
        return used

    def _loop(self) -> None:
        while not self._stop.is_set():
            if self._active.wait() and not self._stop.is_set():  # close() sets it to wake us
                self.sample()
                time.sleep(self.interval_s)

    def phase_start(self) -> int:
        self.peak = 0
        used = self.sample()
        self._active.set()
        return used

    def phase_end(self) -> int:
        self._active.clear()
        self.sample()
        return self.peak

    def close(self) -> None:
        self._stop.set()
        self._active.set()
        self._thread.join(timeout=1)


class EnergyCounter:
    """The GPU's total energy counter: `nvmlDeviceGetTotalEnergyConsumption`, in mJ since the
    driver was loaded (Volta and newer). A run's energy is the difference of two readings; it
    is the whole board's, so another process on the same GPU adds to it."""

    def __init__(self, handle):
        self.handle = handle
        self.start_mj: int | None = None

    @classmethod
    def open(cls, device: torch.device) -> "EnergyCounter | None":
        """The counter of a CUDA device; None on the CPU or where NVML has no energy counter."""
        if device.type != "cuda":
            return None
        import pynvml

        handle = device_handle(device)
        try:
            pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
        except pynvml.NVMLError_NotSupported:
            return None
        return cls(handle)

    def read_mj(self) -> int:
        import pynvml

        return int(pynvml.nvmlDeviceGetTotalEnergyConsumption(self.handle))

    def start(self) -> None:
        self.start_mj = self.read_mj()

    def joules(self) -> float | None:
        """Joules since `start` (None if it was never started)."""
        return None if self.start_mj is None else (self.read_mj() - self.start_mj) / 1e3


def device_handle(device: torch.device):
    """NVML's handle of a CUDA device, found by its UUID (CUDA_VISIBLE_DEVICES renumbers the
    indices, not the UUIDs)."""
    import pynvml

    pynvml.nvmlInit()
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    return pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")


class GpuNeighbours:
    """The most other processes seen holding a CUDA context on this run's GPU: NVML's compute
    processes of the device but this one and those it started (`_others`). Their kernels
    share the GPU's time, so a run that saw any has step and epoch times that are not its own
    (and an NVML peak that includes their memory); its allocator figures are its own. `look`
    is cheap (one NVML query) and is called once per measured step, before its clock starts,
    and at each epoch end, never inside a timed step."""

    def __init__(self, handle):
        self.handle = handle
        self.most: int | None = None  # None: NVML listed no process here, not even this one

    @classmethod
    def open(cls, device: torch.device) -> "GpuNeighbours | None":
        return cls(device_handle(device)) if device.type == "cuda" else None

    def look(self) -> None:
        import pynvml

        try:
            processes = pynvml.nvmlDeviceGetComputeRunningProcesses(self.handle)
        except pynvml.NVMLError:  # not supported here (some virtualised GPUs): stays unknown
            return
        # this process holds a context on the device, so an empty list means NVML cannot list
        # processes here (a container without access to them), not that the GPU is free
        if processes:
            self.most = max(self.most or 0, _others(p.pid for p in processes))


def _others(pids) -> int:
    """How many of the listed processes are neither this one nor started by it (a compiler's
    worker, say). NVML gives host pids: where this process's own pid is not among them (another
    pid namespace), every process but one is counted."""
    pids, me = list(pids), os.getpid()
    if me not in pids:
        return len(pids) - 1
    return sum(not _descends_from(pid, me) for pid in pids)


def _descends_from(pid: int, ancestor: int) -> bool:
    """`pid` is `ancestor` or one of its descendants (Linux /proc; elsewhere only itself)."""
    seen = 0
    while pid > 1 and seen < 64:
        if pid == ancestor:
            return True
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        pid, seen = int(stat.rsplit(")", 1)[1].split()[1]), seen + 1
    return pid == ancestor
