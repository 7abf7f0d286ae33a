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


def _event(name, device, start=0.0, end=0.0, parent=None, self_us=0.0, shapes=(), stream=0):
    from types import SimpleNamespace

    import torch

    kind = torch.autograd.DeviceType.CUDA if device == "cuda" else torch.autograd.DeviceType.CPU
    return SimpleNamespace(name=name, device_type=kind, is_user_annotation=False,
                           time_range=SimpleNamespace(start=start, end=end), cpu_parent=parent,
                           self_device_time_total=self_us, input_shapes=list(shapes),
                           device_resource_id=stream)


def test_attribution_groups_gpu_time_by_op_shapes_and_callers_up_to_the_sweep_label():
    from memstudy.meters.profile import attribution_table

    sweep = _event("tile:top:apply backward", "cpu")
    outer = _event("aten::convolution_backward", "cpu", parent=_event(
        "autograd::engine::evaluate_function: ConvolutionBackward0", "cpu", parent=sweep))
    copies = [_event("aten::copy_", "cpu", parent=_event("aten::_to_copy", "cpu", parent=outer),
                     self_us=2000.0, shapes=[[1, 32, 8, 8], [1, 32, 8, 8]]) for _ in range(2)]
    other = _event("aten::copy_", "cpu", parent=_event("_NoopSaveInputs", "cpu"), self_us=500.0,
                   shapes=[[1, 64, 4, 4]])
    table = attribution_table([*copies, other, _event("kernel", "cuda", self_us=9e9)])
    lines = table.splitlines()
    assert lines[0].startswith("GPU time by op") and "(4.5 ms in all)" in lines[0]
    # the two copies under one sweep are one row, largest first; its callers stop at the label
    assert lines[3] == ("| 4.0 | 2 | aten::copy_ | 1x32x8x8,1x32x8x8 | aten::_to_copy < "
                        "aten::convolution_backward < ConvolutionBackward0 < "
                        "tile:top:apply backward |")
    assert lines[4] == "| 0.5 | 1 | aten::copy_ | 1x64x4x4 | _NoopSaveInputs |"


def test_copy_overlap_counts_only_kernels_of_other_streams():
    from memstudy.meters.profile import copy_overlap

    events = [_event("Memcpy DtoH (Device -> Pinned)", "cuda", 0, 10_000, stream=7),
              _event("Memcpy HtoD (Pinned -> Device)", "cuda", 20_000, 30_000, stream=7),
              _event("conv", "cuda", 5_000, 25_000, stream=1),  # overlaps both by 5 ms
              _event("same stream", "cuda", 0, 30_000, stream=7),  # never counted
              _event("cudaStreamSynchronize", "cpu", 0, 4_000)]
    text = copy_overlap(events)
    assert "| Memcpy DtoH (1) | 10.0 | 5.0 |" in text
    assert "| Memcpy HtoD (1) | 10.0 | 5.0 |" in text
    assert "| cudaStreamSynchronize | 4.0 | 1 |" in text


def test_exposed_copies_names_the_issuer_the_next_kernel_and_why_the_gpu_idled():
    """Copy time with no kernel running, split where kernels run, grouped by the op that
    issued the copy and the first kernel after it (found through the CUDA runtime call with the
    GPU event's correlation id, which runs inside the op): `waited` when that kernel had been
    launched before the copy ended (queued behind it), `host` when it was launched later."""
    from memstudy.meters.profile import exposed_copies

    def gpu(name, start, end, correlation, stream=1):
        event = _event(name, "cuda", start, end, stream=stream)
        event.id = correlation
        return event

    def call(name, start, op, correlation):
        event = _event(name, "cpu", start, start + 10, parent=op)
        event.id = correlation
        return event

    sweep = _event("tile:top:apply backward", "cpu")
    unpack = _event("aten::copy_", "cpu", parent=sweep)
    conv = _event("aten::cudnn_convolution", "cpu", parent=sweep)
    late = _event("aten::add", "cpu")
    events = [sweep, unpack, conv, late,
              # a 10 ms copy back; a kernel covers 2-4 ms of it: 8 ms exposed in two pieces
              gpu("Memcpy HtoD (Pinned -> Device)", 0, 10_000, 100, stream=7),
              call("cudaMemcpyAsync", 0, unpack, 100),
              gpu("other kernel", 2_000, 4_000, 101), call("cudaLaunchKernel", 100, conv, 101),
              # the convolution runs after the copy; it was launched at 1 ms: it waited
              gpu("conv kernel", 10_050, 12_000, 102), call("cudaLaunchKernel", 1_000, conv, 102),
              # a 1 ms copy out whose first 0.3 ms a kernel begun before it covers, then a
              # kernel launched only after it ended: the host was late
              gpu("Memcpy DtoH (Device -> Pinned)", 20_000, 21_000, 103, stream=7),
              call("cudaMemcpyAsync", 19_000, unpack, 103),
              gpu("earlier kernel", 19_500, 20_300, 105), call("cudaLaunchKernel", 19_400, late, 105),
              gpu("add kernel", 21_500, 21_600, 104), call("cudaLaunchKernel", 21_400, late, 104),
              # a later 1 ms copy back of the same group: `first at` stays the earliest piece's
              gpu("Memcpy HtoD (Pinned -> Device)", 30_000, 31_000, 106, stream=7),
              call("cudaMemcpyAsync", 29_000, unpack, 106),
              gpu("conv kernel", 31_100, 32_000, 107), call("cudaLaunchKernel", 1_500, conv, 107)]
    for order in (events, events[::-1]):  # the profiler's events need not come in time order
        lines = exposed_copies(order).splitlines()
        assert lines[0].startswith("Copy time with no kernel running (9.7 ms")
        assert lines[3] == ("| 9.0 | 3 | 0.0 | HtoD | aten::copy_ < tile:top:apply backward | "
                            "aten::cudnn_convolution < tile:top:apply backward | waited |")
        assert lines[4] == ("| 0.7 | 1 | 20.3 | DtoH | aten::copy_ < tile:top:apply backward | "
                            "aten::add | host |")
