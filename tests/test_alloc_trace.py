"""Locating the caching allocator's cache releases (retries) in a step's allocator trace."""
from __future__ import annotations

import pytest
import torch

from memstudy.meters import alloc_trace


def _entry(action, size, frames=(), stream=0):
    return {"action": action, "addr": 0, "size": size, "stream": stream, "frames": list(frames)}


LOSS = {"filename": f"{alloc_trace.PACKAGE}/quality.py", "line": 88, "name": "chunk_loss"}
TORCH = {"filename": "/x/torch/nn/functional.py", "line": 5, "name": "conv2d"}

TRACE = [_entry("alloc", 10), _entry("free_requested", 10), _entry("free_completed", 10),
         # a release of two cached pieces, then the allocation that needed the room
         _entry("segment_unmap", 300_000_000), _entry("segment_unmap", 100_000_000),
         _entry("segment_map", 500_000_000), _entry("alloc", 500_000_000, [TORCH, LOSS], 7),
         _entry("alloc", 5),
         _entry("segment_free", 2_000_000)]  # a last release with nothing after it


def test_each_run_of_releases_is_one_with_the_allocation_after_it():
    found = alloc_trace.releases(TRACE)
    assert [r["released"] for r in found] == [400_000_000, 2_000_000]
    assert found[0]["request"]["size"] == 500_000_000 and found[1]["request"] is None
    assert alloc_trace.releases([_entry("alloc", 1), _entry("free_completed", 1)]) == []


MODULE = {"filename": "/x/torch/nn/modules/conv.py", "line": 9, "name": "forward"}


def test_the_table_names_the_operation_and_memstudys_frame_that_ran_it():
    table = alloc_trace.release_table(TRACE)
    assert "cache releases in the profiled step: 2" in table
    assert "| 1 | 400.0 | 500.0 | 7 | conv2d (functional.py:5) < chunk_loss (quality.py:88) |" in table
    assert "| 2 | 2.0 | - | - | (no request after it) |" in table
    # memstudy's frame deeper than the innermost two: still named, after them
    deep = alloc_trace.release_table([_entry("segment_free", 1),
                                      _entry("alloc", 1, [TORCH, MODULE, TORCH, LOSS])])
    assert "conv2d (functional.py:5) < forward (conv.py:9) < chunk_loss (quality.py:88) |" in deep
    # no frame of memstudy's: the innermost frames of any code only
    assert "| conv2d (functional.py:5) < forward (conv.py:9) |" in alloc_trace.release_table(
        [_entry("segment_free", 1), _entry("alloc", 1, [TORCH, MODULE])])


def test_without_the_variable_nothing_is_recorded(monkeypatch):
    monkeypatch.delenv(alloc_trace.ENV, raising=False)
    with alloc_trace.traced(torch.device("cpu")):  # would need CUDA if it recorded
        pass


def test_the_traced_step_appends_its_table_and_stops_recording(monkeypatch, tmp_path):
    """With the variable set, history is on over the step only (off again after a failing
    step too) and the step's releases are appended to the file; PyTorch's calls stood in."""
    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history",
                        lambda enabled=None, **kw: calls.append((enabled, kw.get("stacks"))))
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda device: {"device_traces": [[], TRACE]})
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    out = tmp_path / "releases.md"
    monkeypatch.setenv(alloc_trace.ENV, str(out))
    for _ in range(2):
        with alloc_trace.traced(torch.device("cuda", 1)):
            pass
    assert calls == [("all", "python"), (None, None)] * 2
    assert out.read_text().count("cache releases in the profiled step: 2") == 2  # appended
    with pytest.raises(RuntimeError), alloc_trace.traced(torch.device("cuda", 1)):
        raise RuntimeError("out of memory")
    assert calls[-1] == (None, None) and out.read_text().count("releases in the profiled") == 2


@pytest.mark.parametrize("name", ["MEMSTUDY_ALLOC_TRACE", "MEMSTUDY_PROFILE_TABLE"])
def test_a_file_that_cannot_be_written_is_refused_as_the_run_starts(monkeypatch, tmp_path, name):
    from memstudy.errors import ConfigError
    from memstudy.meters.profile import check_diagnosis_files

    monkeypatch.delenv("MEMSTUDY_ALLOC_TRACE", raising=False)
    monkeypatch.delenv("MEMSTUDY_PROFILE_TABLE", raising=False)
    monkeypatch.setenv(name, str(tmp_path / "ok.md"))
    check_diagnosis_files()
    monkeypatch.setenv(name, str(tmp_path / "no such folder" / "x.md"))
    with pytest.raises(ConfigError, match=f"{name}=.*cannot write there.*unset it"):
        check_diagnosis_files()


@pytest.mark.gpu
def test_gpu_a_release_under_the_cap_is_found_with_its_caller(monkeypatch, tmp_path):
    """A cached 100 MB block cannot serve 150 MB, and the cap leaves no room for both: the
    allocator releases the cached block and allocates again; the table finds that release and
    the allocation of this test's frame."""
    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(device).total_memory
    cap = torch.cuda.memory_reserved(device) + 200 * 2**20
    out = tmp_path / "releases.md"
    monkeypatch.setenv(alloc_trace.ENV, str(out))
    torch.cuda.set_per_process_memory_fraction(cap / total, device)
    try:
        with alloc_trace.traced(device):
            cached = torch.empty(100 * 2**20, dtype=torch.uint8, device=device)
            del cached
            needs_room = torch.empty(150 * 2**20, dtype=torch.uint8, device=device)
            del needs_room
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
    table = out.read_text()
    assert "cache releases in the profiled step: 0" not in table
    assert "test_gpu_a_release_under_the_cap_is_found_with_its_caller" in table
