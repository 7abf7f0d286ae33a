"""benchmarks/bench_stream_traffic.py: its ledger of what tile:stream copies, checked against
what is known without it on a small step."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_stream_traffic as bench  # noqa: E402

from memstudy.models import build_unet  # noqa: E402
from memstudy.tiling.tiled_forward import TiledForward  # noqa: E402


def _args(*extra: str):
    return bench.parse_args(["--height", "256", "--width", "256", "--proxy-width", "256",
                             "--rows", "64", *extra])


def _moved(ledger, kind: str, direction: str) -> float:
    return sum(n for (_r, k, d), n in ledger.moved.items() if k == kind and d == direction)


def test_every_host_boundary_is_written_out_once_and_the_image_only_read():
    """The forward writes each host boundary's rows once, so the bytes to the host of kind
    `boundary` are exactly TiledForward.host_bytes (2 bytes an element); the image is read,
    never written; each host input's gradient goes out at least once whole."""
    args = _args()
    ledger = bench.traffic(args, "conv1", "convs", 64)
    with torch.device("meta"):
        unet = build_unet()
    tiled = TiledForward(unet, 4, 0, 64, "conv1", None, "convs", "torch", stream=True)
    assert _moved(ledger, "boundary", "to host") == tiled.host_bytes(256, 256, 1, 2)
    assert _moved(ledger, "image", "to host") == 0
    assert _moved(ledger, "image", "to device") >= 256 * 256 * 4  # every strip, halos included
    assert _moved(ledger, "gradient", "to host") >= tiled.host_bytes(256, 256, 1, 2)


def test_the_rows_read_back_to_be_added_to_are_gradient_reads_each_written_back():
    """add_rows reads a host input gradient's rows and writes them back: the bytes it reads are
    some of the gradient's bytes to the device (the rest are output-gradient rows fetched),
    and the gradient's bytes to the host are at least as many."""
    ledger = bench.traffic(_args(), "conv1", "convs", 64)
    added = sum(ledger.added.values())
    assert 0 < added < _moved(ledger, "gradient", "to device")
    assert added <= _moved(ledger, "gradient", "to host")
    assert "are a host input gradient's rows read back to be added to" in bench.page(_args())


def test_the_page_scales_the_proxy_by_the_width_and_lists_each_plan():
    narrow = bench.parse_args(["--height", "256", "--width", "512", "--proxy-width", "64",
                               "--rows", "64", "--layer1", "convs", "--variants",
                               "conv1:blocks:64"])
    text = bench.page(narrow)
    assert "| conv1 | convs | 64 |" in text and "| conv1 | blocks | 64 |" in text
    wide = bench.by_region(narrow, bench.traffic(narrow, "conv1", "convs", 64))
    exact = bench.by_region(_args(), bench.traffic(_args(), "conv1", "convs", 64))
    # 512 px scaled from 64 is twice the 256 px step's bytes, region by region
    for region, (to_dev, to_host) in exact.items():
        assert abs(wide[region][0] - 2 * to_dev) <= 1e-9 * to_dev
        assert abs(wide[region][1] - 2 * to_host) <= 1e-9 * max(to_host, 1)
