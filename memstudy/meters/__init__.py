"""Memory and time meters: allocator + NVML on CUDA, a tensor-level meter anywhere."""
from memstudy.meters.recorder import PHASES, PhaseRecorder, alloc_retries
from memstudy.meters.tensor import LiveTensorMeter, saved_tensors_of_graph, unique_storage_bytes

__all__ = ["PHASES", "PhaseRecorder", "alloc_retries", "LiveTensorMeter", "saved_tensors_of_graph",
           "unique_storage_bytes"]
