"""The environment a result was measured in, stored beside every run."""
from __future__ import annotations

import os
import platform
import socket
import sys

import torch


def describe(device: torch.device) -> dict[str, object]:
    env: dict[str, object] = {
        "host": socket.gethostname(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "device": str(device),
        "num_threads": torch.get_num_threads(),
    }
    for pkg in ("segmentation_models_pytorch", "pytorch_msssim", "momentumnet", "triton"):
        mod = sys.modules.get(pkg)
        env[pkg] = getattr(mod, "__version__", None) if mod else None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu_name=props.name, gpu_total_bytes=props.total_memory,
                   gpu_capability=f"{props.major}.{props.minor}", gpu_count=torch.cuda.device_count(),
                   gpu_uuid=str(getattr(props, "uuid", "")) or None,  # which physical GPU ran it
                   cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
                   driver=_driver_version())
        # settings of the libraries' workspaces and kernel loading, which the context's size
        # and a budget's last bytes depend on (docs/budget.md)
        env.update({name.lower(): os.environ[name] for name in LIBRARY_SETTINGS
                    if name in os.environ})
    return env


LIBRARY_SETTINGS = ("CUDNN_CONV_WSCAP_DBG", "CUBLAS_WORKSPACE_CONFIG", "CUDA_MODULE_LOADING",
                    "TORCH_CUDNN_V8_API_LRU_CACHE_LIMIT")


def indexed_device(device: torch.device) -> torch.device:
    """'cuda' -> 'cuda:N' (the current GPU): tensors report an indexed device, and a device
    compared with theirs must carry the index too."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def compute_capability(device: torch.device) -> tuple[int, int] | None:
    """(major, minor) of a CUDA `device` without starting CUDA where it has not started: from
    NVML then, since a technique's check runs before the allocator technique configures the
    caching allocator, which refuses a process where CUDA has started. None if unknown."""
    if torch.cuda.is_initialized():
        return torch.cuda.get_device_capability(device)
    try:
        import pynvml

        pynvml.nvmlInit()
        # an explicit index: for "cuda" torch would ask current_device(), which starts CUDA
        visible = torch.device("cuda", device.index if device.index is not None else 0)
        index = torch.cuda._get_nvml_device_index(visible)  # through CUDA_VISIBLE_DEVICES
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
        return int(major), int(minor)
    except Exception:  # noqa: BLE001 - no NVML or no such device: unknown
        return None


def _driver_version() -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else version
    except Exception:  # noqa: BLE001 - the driver version is informative, never required
        return None
