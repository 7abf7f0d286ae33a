"""The step profile's arithmetic (memstudy/meters/profile.py): GPU-busy time is the union of
kernel intervals, overlapping work counted once."""
from memstudy.meters.profile import busy_ms


def test_busy_time_is_the_union_of_intervals():
    # 0-10 and 5-12 overlap (12 us), 20-25 apart (5 us), 21-22 inside it
    assert busy_ms([(20.0, 25.0), (0.0, 10.0), (5.0, 12.0), (21.0, 22.0)]) == 0.017
    assert busy_ms([]) == 0.0


def test_profiler_ranges_on_the_gpu_timeline_are_not_gpu_work():
    """record_function ranges (the tile sweeps' labels) appear on the GPU's timeline as user
    annotations spanning everything launched inside them, idle gaps included; counted as
    kernels they made a tiled step's GPU-busy time exceed its wall time."""
    from types import SimpleNamespace

    import torch

    from memstudy.meters.profile import on_gpu

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    kernel = SimpleNamespace(device_type=cuda, is_user_annotation=False)
    label = SimpleNamespace(device_type=cuda, is_user_annotation=True)
    host = SimpleNamespace(device_type=cpu, is_user_annotation=False)
    assert on_gpu(kernel) and not on_gpu(label) and not on_gpu(host)
