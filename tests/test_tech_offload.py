"""offload: the pack / unpack pair on the CPU (host = compute = cpu), the harness on a GPU."""
from pathlib import Path

import pytest
import torch

from memstudy.errors import ConfigError
from memstudy.models import build_unet
from memstudy.runner import execute
from memstudy.techniques import get_technique
from memstudy.techniques.base import Plan
from memstudy.techniques.offload import CopyTimes, Offloader, PrefetchWindow
from helpers import hooked_grads, saved_bytes

TECH = get_technique("offload")
CPU = torch.device("cpu")


def _plan(device: str) -> Plan:
    return Plan(config=None, device=torch.device(device), n_gpus=1, chosen={})


def test_refused_on_the_cpu_naming_train_device():
    with pytest.raises(ConfigError, match="train.device"):
        TECH.check(TECH.parse([]), _plan("cpu"))


def test_negative_min_bytes_is_refused():
    with pytest.raises(ConfigError, match="min_bytes"):
        TECH.check(TECH.parse(["-1"]), _plan("cuda"))


@pytest.mark.parametrize("args,option", [
    (["prefetch=-1"], "prefetch"),
    (["row_chunks=-1"], "row_chunks"),
    (["hold=-1"], "hold"),
    (["prefetch=2", "pin_memory=false"], "pin_memory"),  # pageable copies cannot overlap
    (["which=boundaries"], "which=boundaries"),  # nothing marks boundaries without checkpoint
])
def test_bad_prefetch_and_which_are_refused(args, option):
    with pytest.raises(ConfigError, match=option):
        TECH.check(TECH.parse(args), _plan("cuda"))
    plan = Plan(config=None, device=torch.device("cuda"), n_gpus=1, chosen={"checkpoint": None})
    TECH.check(TECH.parse(["prefetch=2", "which=boundaries"]), plan)  # accepted


def test_pack_copies_large_tensors_once_and_leaves_small_ones_and_parameters():
    off = Offloader(CPU, CPU, min_bytes=1024)
    big, small = torch.randn(64, 64), torch.randn(8)
    param = torch.nn.Parameter(torch.randn(64, 64))
    packed = off.pack(big)
    assert packed.untyped_storage().data_ptr() != big.untyped_storage().data_ptr()
    assert torch.equal(packed, big) and off.offloaded_bytes == big.nbytes
    assert off.pack(big) is packed  # saved twice (e.g. by ReLU and the next conv): one copy
    assert off.pack(small) is small and off.pack(param) is param
    big.mul_(2)  # a new version is a new value: copied again
    again = off.pack(big)
    assert again is not packed and torch.equal(again, big) and off.offloaded_bytes == 2 * big.nbytes


def test_unpack_restores_values_in_fresh_storage_and_keeps_layout():
    off = Offloader(CPU, CPU, min_bytes=0)
    t = torch.randn(2, 8, 16, 16).to(memory_format=torch.channels_last)
    packed = off.pack(t)
    restored = off.unpack(packed)
    assert torch.equal(restored, t) and restored.stride() == t.stride()
    assert restored.untyped_storage().data_ptr() not in (t.untyped_storage().data_ptr(),
                                                         packed.untyped_storage().data_ptr())
    plain = torch.randn(3)
    assert off.unpack(plain) is plain  # never offloaded: passed through
    assert off.restored_bytes == t.nbytes  # one copy back, counted host -> device
    assert off.transfer_stats["h2d_bytes"] == off.transfer_stats["d2h_bytes"] == t.nbytes




@pytest.fixture(scope="module")
def model_and_plain_grads():
    model = build_unet(seed=0).eval()  # eval: BatchNorm state does not change between runs
    x = torch.rand(1, 1, 96, 96, generator=torch.Generator().manual_seed(0))
    return model, x, hooked_grads(model, x), saved_bytes(model, x)


def test_gradients_are_identical_with_offload(model_and_plain_grads):
    model, x, plain, saved = model_and_plain_grads
    off = Offloader(CPU, CPU, min_bytes=16 * 1024)
    brought = []  # the size of every copy back
    copy_back = off._copy_back
    off._copy_back = lambda host, *rest: brought.append(host.nbytes) or copy_back(host, *rest)
    offloaded = hooked_grads(model, x, (off.pack, off.unpack))
    assert 0.95 * saved < off.offloaded_bytes <= saved  # 51.8 of 52.0 MiB at 192 px, 64 KiB
    assert all(torch.equal(a, b) for a, b in zip(plain, offloaded))
    # host -> device: every copy back counted; a copy shared by saved tensors whose uses are
    # far apart comes back again, so more than went out
    assert off.stats["h2d_bytes"] == off.restored_bytes == sum(brought) > off.offloaded_bytes


@pytest.mark.parametrize("prefetch", [1, 4])
def test_prefetch_keeps_gradients_identical_and_bounds_what_is_in_flight(model_and_plain_grads,
                                                                        prefetch):
    model, x, plain, _ = model_and_plain_grads
    off = Offloader(CPU, CPU, min_bytes=16 * 1024, prefetch=prefetch)
    for _ in range(2):  # the second forward numbers its copies anew
        grads = hooked_grads(model, x, (off.pack, off.unpack))
        assert all(torch.equal(a, b) for a, b in zip(plain, grads))
    stats = off.stats
    assert stats["max_in_flight"] == prefetch
    # each copy of both steps came back once, prefetched or on demand
    assert stats["h2d_bytes"] == stats["d2h_bytes"] == off.offloaded_bytes > 0
    # backward runs almost in reverse pack order: most copies were brought back ahead of use
    assert stats["prefetched"] > 0.8 * (stats["prefetched"] + stats["on_demand"]), stats
    none = Offloader(CPU, CPU, min_bytes=16 * 1024)
    hooked_grads(model, x, (none.pack, none.unpack))
    assert none.stats["prefetched"] == 0 and none.stats["max_in_flight"] == 0


def test_hold_keeps_the_last_saved_tensors_on_the_device_from_the_second_step(
        model_and_plain_grads):
    """hold=N: from the second forward on, the last N distinct tensors a forward would offload
    stay where they are (backward needs them first); gradients are unchanged."""
    model, x, plain, _ = model_and_plain_grads
    off = Offloader(CPU, CPU, min_bytes=16 * 1024, prefetch=1, hold=2)
    sizes = []  # per step: the sizes of the tensors offloaded, in pack order
    copy_to_host = off._copy_to_host
    off._copy_to_host = lambda t, **kw: sizes[-1].append(t.nbytes) or copy_to_host(t, **kw)
    for step in range(3):
        sizes.append([])
        grads = hooked_grads(model, x, (off.pack, off.unpack))
        assert all(torch.equal(a, b) for a, b in zip(plain, grads))
    first, second, third = sizes
    assert second == third == first[:-2] and len(first) > 10
    assert off.held_bytes == 2 * sum(first[-2:]) and off.stats["held_bytes"] == off.held_bytes
    assert off.offloaded_bytes == sum(first) + 2 * sum(second)


def test_a_held_tensor_saved_twice_is_held_for_both():
    off = Offloader(CPU, CPU, min_bytes=0, hold=1)
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    for packed in [off.pack(t) for t in (a, b, b)]:  # first forward: both offloaded, b once
        off.unpack(packed)
    assert off.offloaded_bytes == a.nbytes + b.nbytes and off.held_bytes == 0
    assert off.pack(a) is not a and off.pack(b) is b and off.pack(b) is b  # a new forward
    assert off.held_bytes == b.nbytes and off.offloaded_bytes == 2 * a.nbytes + b.nbytes


def test_prefetch_window_order_and_bound():
    started = []
    window = PrefetchWindow(lambda host: (started.append(int(host)) or host.clone(), None), limit=2)
    copies = [torch.tensor(i) for i in range(6)]
    for i, c in enumerate(copies):
        assert window.add(c) == i
    window.count_use(3)  # copy 3 is shared by two saved tensors
    assert window.take(5) is None  # nothing prefetched yet: copied on demand
    window.advance(5)
    assert started == [4, 3]  # the next ones below, highest first, two in flight
    assert int(window.take(4)[0]) == 4
    window.advance(4)
    assert started == [4, 3, 2]  # 3 still in flight: one more
    assert int(window.take(3)[0]) == 3 and int(window.take(3)[0]) == 3  # both uses served
    window.advance(3)
    assert started == [4, 3, 2, 1]
    assert window.take(0) is None  # out of order: on demand; the cursor moves below 0
    window.advance(0)
    assert started == [4, 3, 2, 1]
    del copies[2]  # autograd freed copy 2 unused: it leaves the window
    assert 2 not in window._ready
    assert window.stats == {"prefetched": 3, "on_demand": 2, "reused": 0, "max_in_flight": 2}


def test_prefetch_goes_on_past_a_skip_connection_used_out_of_order():
    """A skip connection is packed early (an encoder stage saves it) and again late (a decoder
    block), so backward first unpacks it far out of order. That early use must not stop the
    prefetching of every copy in between: only a copy's last use moves the window on."""
    started = []
    window = PrefetchWindow(lambda host: (started.append(int(host)) or host.clone(), None), limit=1)
    copies = [torch.tensor(i) for i in range(8)]
    for c in copies:
        window.add(c)
    window.count_use(2)  # the skip connection: saved again by a later decoder block
    for index in (7, 2, 6, 5, 4, 3, 2, 1, 0):  # backward: the decoder block's use comes early
        got = window.take(index)
        if got is None:
            window.hold(index, copies[index].clone())
        window.advance(index)
    assert started == [6, 5, 4, 3, 1, 0]
    assert window.stats == {"prefetched": 6, "on_demand": 2, "reused": 1, "max_in_flight": 1}
    assert not window._ready


def test_a_copy_shared_by_several_saved_tensors_comes_back_once():
    """Without prefetch, a host copy that several saved tensors share (each Function of a tile
    region saves the region's inputs) is brought back at its first unpack and serves the rest;
    it leaves the window with its last use."""
    off = Offloader(CPU, CPU, min_bytes=0)
    copies_back = []
    copy_back = off._copy_back
    off._copy_back = lambda *args: copies_back.append(1) or copy_back(*args)
    t = torch.randn(64, 64)
    packed = [off.pack(t) for _ in range(3)]  # one host copy, three uses
    assert packed[0] is packed[1] is packed[2]
    restored = [off.unpack(p) for p in packed]
    assert len(copies_back) == 1 and all(r is restored[0] for r in restored)
    assert torch.equal(restored[0], t)
    assert off.stats["on_demand"] == 1 and off.stats["reused"] == 2 and not off._window._ready
    other = off.pack(torch.randn(64, 64))  # a new forward numbers anew; one use: not held
    off.unpack(other)
    assert not off._window._ready
    # uses far apart: the next copy brought back on demand replaces the waiting one
    first, second = torch.randn(64, 64), torch.randn(64, 64)
    a, b = off.pack(first), off.pack(second)
    off.pack(first), off.pack(second)  # both shared by two saved tensors
    off.unpack(a)
    assert list(off._window._ready) == [0]
    off.unpack(b)
    assert list(off._window._ready) == [1]
    assert torch.equal(off.unpack(a), first) and len(copies_back) == 5
    assert off.restored_bytes == 5 * t.nbytes  # host -> device: the five copies back


def test_with_checkpoint_only_tensors_outside_regions_are_offloaded(model_and_plain_grads):
    try:
        from memstudy.techniques.checkpoint import apply_per_block
    except ImportError:
        pytest.skip("checkpoint technique not available yet")
    model, x, plain, _ = model_and_plain_grads
    full = Offloader(CPU, CPU, min_bytes=64 * 1024)
    hooked_grads(model, x, (full.pack, full.unpack))
    apply_per_block(model, selective=False)  # last use of the module-scoped model
    inner = Offloader(CPU, CPU, min_bytes=64 * 1024)
    grads = hooked_grads(model, x, (inner.pack, inner.unpack))
    assert 0 < inner.offloaded_bytes < 0.5 * full.offloaded_bytes
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(plain, grads))
    # which=boundaries: only the region inputs checkpoint marks (96 px: 1.4 of 3.5 MB; the
    # stem's full-resolution tensors outside regions are the rest)
    marked = Offloader(CPU, CPU, min_bytes=64 * 1024, boundaries_only=True, prefetch=2)
    grads = hooked_grads(model, x, (marked.pack, marked.unpack))
    assert 0.25 * inner.offloaded_bytes < marked.offloaded_bytes < 0.75 * inner.offloaded_bytes
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(plain, grads))


class _FakeStream:
    def __init__(self, name: str, calls: list):
        self.name, self.calls = name, calls

    def wait_stream(self, other):
        self.calls.append(("wait_stream", self.name, other.name))

    def wait_event(self, event):
        self.calls.append(("wait_event", self.name, event))


class _FakeEvent:
    def record(self, stream):
        pass


@pytest.mark.parametrize("release", ["record", "stream"])
def test_a_copied_tensor_is_released_after_its_copy(monkeypatch, release):
    """The copy to the host reads the device tensor on a side stream. record: the tensor is
    marked used by that stream (record_stream); stream: nothing then, but when the tensor is
    freed the compute stream waits for the copy's event before its memory can be reused. CUDA
    streams and events are stood in for (they need a GPU; the gpu tests run the real ones)."""
    import contextlib
    import gc

    calls: list = []
    compute = _FakeStream("compute", calls)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: compute)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Event", lambda **kw: _FakeEvent())
    marked: list = []
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, stream: marked.append(stream.name))
    off = Offloader(CPU, CPU, min_bytes=0, release=release)
    off.stream = _FakeStream("side", calls)
    t = torch.rand(64, 64)
    host = off.pack(t)
    event = host._memstudy_offloaded[1]
    assert isinstance(event, _FakeEvent) and torch.equal(host, t)
    assert ("wait_event", "compute", event) not in calls  # t is alive: nothing to wait for yet
    del t
    gc.collect()
    waited = ("wait_event", "compute", event) in calls
    assert (marked, waited) == ((["side"], False) if release == "record" else ([], True))
    # a copy back on the side stream (a prefetch) writes into compute-pool memory: the same
    off.copy_times = type("Times", (), {"start": staticmethod(lambda stream: _FakeEvent()),
                                        "prefetched": lambda self, started, copied: None})()
    assert off.restored_bytes == 0
    restored, copied = off._start_copy_back(host)
    assert torch.equal(restored, host) and ("wait_event", "compute", copied) not in calls
    assert off.restored_bytes == host.nbytes  # counted as the side stream's copy is issued
    del restored
    gc.collect()
    waited = ("wait_event", "compute", copied) in calls
    assert (marked, waited) == ((["side", "side"], False) if release == "record" else ([], True))
    assert torch.equal(off.unpack(host), host)
    assert off.restored_bytes == 2 * host.nbytes  # and the copy back on demand


def test_early_needs_tile_and_refuses_compress():
    with pytest.raises(ConfigError, match="tile is not in techniques; add tile or drop early"):
        TECH.check(TECH.parse(["early=true"]), _plan("cuda"))
    both = Plan(config=None, device=torch.device("cuda"), n_gpus=1,
                chosen={"tile": None, "compress": None})
    with pytest.raises(ConfigError, match="drop early or compress"):
        TECH.check(TECH.parse(["early=true"]), both)
    tiled = Plan(config=None, device=torch.device("cuda"), n_gpus=1, chosen={"tile": None})
    TECH.check(TECH.parse(["early=true", "which=boundaries"]), tiled)  # accepted


def test_release_must_be_record_or_stream():
    with pytest.raises(ConfigError, match=r"release='later' is not one of \['record', 'stream'\]"):
        TECH.parse(["release=later"])


def test_back_pool_side_needs_copies_back_on_the_side_stream():
    with pytest.raises(ConfigError, match="prefetch=0 and row_chunks=0 there are none"):
        TECH.check(TECH.parse(["back_pool=side", "row_chunks=0"]), _plan("cuda"))
    TECH.check(TECH.parse(["back_pool=side", "row_chunks=0", "prefetch=1"]), _plan("cuda"))
    TECH.check(TECH.parse(["back_pool=side"]), _plan("cuda"))  # row chunks: accepted
    with pytest.raises(ConfigError, match=r"back_pool='host' is not one of \['compute', 'side'\]"):
        TECH.parse(["back_pool=host"])


# -- on a GPU ------------------------------------------------------------------------------
def _forward(record):
    return {name: v for _, phase, name, v in record.metrics if phase == "forward"}


@pytest.mark.gpu
def test_gpu_saved_activations_move_to_host(make_config):
    plain = execute(make_config(256, device="cuda", validate=False, max_steps=3), db=None)
    off = execute(make_config(256, ["offload"], device="cuda", validate=False, max_steps=3),
                  db=None)
    assert plain.status == off.status == "ok", off.error
    p, o = _forward(plain), _forward(off)
    assert o["saved_bytes"] < 0.05 * p["saved_bytes"], (p, o)
    assert o["saved_host_bytes"] > 0.9 * p["saved_bytes"]
    assert o["alloc_held_bytes"] < 0.5 * p["alloc_held_bytes"]


@pytest.mark.gpu
def test_gpu_gradients_match_without_offload():
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    model = build_unet(seed=0).cuda().eval()
    x = torch.rand(2, 1, 256, 256, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    plain = hooked_grads(model, x)
    off = Offloader(torch.device("cuda"), CPU, min_bytes=64 * 1024, pin_memory=True)
    offloaded = hooked_grads(model, x, (off.pack, off.unpack))
    assert off.offloaded_bytes > 0
    assert all(torch.equal(a, b) for a, b in zip(plain, offloaded))


@pytest.mark.gpu
def test_gpu_prefetch_gradients_identical_to_plain_offload():
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    model = build_unet(seed=0).cuda().eval()
    x = torch.rand(2, 1, 256, 256, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    plain = Offloader(torch.device("cuda"), CPU, min_bytes=64 * 1024, pin_memory=True)
    expected = hooked_grads(model, x, (plain.pack, plain.unpack))
    ahead = Offloader(torch.device("cuda"), CPU, min_bytes=64 * 1024, pin_memory=True, prefetch=4)
    for _ in range(2):
        grads = hooked_grads(model, x, (ahead.pack, ahead.unpack))
        assert all(torch.equal(a, b) for a, b in zip(expected, grads))
    assert ahead.stats["prefetched"] > 0.8 * (ahead.stats["prefetched"] + ahead.stats["on_demand"])
    assert ahead.stats["max_in_flight"] == 4


def test_shared_copies_keep_invertible_gradients_identical():
    """momentumnet's backward modifies tensors it unpacked in place; a copy brought back once
    and shared by the saved tensors that share its host copy behaves as autograd without hooks
    (one tensor object): gradients stay identical, with copies reused."""
    from conftest import small_config
    from memstudy.techniques.compose import build_pipeline, make_plan
    model = build_pipeline(make_plan(small_config(techniques=["invertible"]))).model.eval()
    x = torch.rand(1, 1, 96, 96, generator=torch.Generator().manual_seed(0))
    plain = hooked_grads(model, x)
    off = Offloader(CPU, CPU, min_bytes=1024)
    grads = hooked_grads(model, x, (off.pack, off.unpack))
    assert all(torch.equal(a, b) for a, b in zip(plain, grads))
    assert off.stats["reused"] > 0


def test_every_series_offload_records_is_defined_in_metrics_md():
    """Each `offload_*` figure a run records (memstudy/techniques/offload.py: the window's and
    the transfers' run totals, the copy-back times on CUDA) has its definition in
    docs/metrics.md."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "metrics.md").read_text()
    names = [*Offloader(CPU, CPU).stats, *CopyTimes().totals()]
    missing = [f"offload_{name}" for name in names if f"`offload_{name}`" not in text]
    assert not missing, f"docs/metrics.md does not define {missing}"
