"""tile:auto (memstudy/tiling/auto.py): its memory model against the GPU peaks it was fitted to
and against streamed runs it was not, its picks, and its refusals."""
from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
import torch
from conftest import small_config

from memstudy.errors import ConfigError
from memstudy.network import DEFAULT_DECODER_CHANNELS, ModelConfig
from memstudy.techniques.compose import make_plan
from memstudy.tiling import auto

GiB, MiB = 1 << 30, 1 << 20
RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "h200"
RESNET34 = ("resnet34", (256, 128, 64, 32, 16), 1, 1, "enhance")
SET = "amp:bf16,checkpoint,offload:which=boundaries:prefetch=1,tile:auto"


@pytest.fixture(autouse=True)
def fresh_caches():
    """Every test computes its picks: none is served from an earlier test's cache (a forked
    mutation run would otherwise keep the parent's picks)."""
    for cached in (auto._pick, auto._fitted, auto._Shapes.of):
        cached.cache_clear()


def predicted_mib(plan: str, side: int, rows: int, state_per_parameter: int = 16) -> float:
    levels, keep, layer1, _ = auto.PLANS[plan]
    halo = auto.min_tile_rows(levels, keep, layer1, "resnet34")
    shapes = auto._Shapes.of(RESNET34)
    return (shapes.parameters * state_per_parameter
            + auto._activations(plan, shapes, levels, side, side, rows + halo, 2)) / MiB


def backward_peak_mib(database: Path) -> float:
    """The first run's backward: its absolute allocator peak (start + peak above it)."""
    with sqlite3.connect(database) as db:
        start, above = (db.execute(
            "select value from metrics where run_id = 1 and rank = 0 and phase = 'backward' "
            "and name = ?", (name,)).fetchone()[0] for name in ("alloc_start_bytes",
                                                               "alloc_peak_bytes"))
    return (start + above) / MiB


def test_the_model_fits_its_calibration_within_three_percent():
    """Four points, three constants per plan: the worst residual is the streamed plan's at
    2048 px, 256 rows (2.5%)."""
    for plan, side, rows, measured in auto.CALIBRATION:
        assert predicted_mib(plan, side, rows) == pytest.approx(measured, rel=0.03), (plan, side)


@pytest.mark.parametrize("side, rows", [(8192, 512), (12288, 768), (16384, 1024)])
def test_streamed_peaks_it_was_not_fitted_to_are_predicted_on_the_safe_side(side, rows):
    """The streaming set (levels=4, 16 strips) measured under 8 GiB on an H200: the model
    fitted at 2048 and 4096 px predicts its backward at 8192-16384 px from above, by at most
    15% (measured: 6.5, 8.6 and 9.4%)."""
    measured = backward_peak_mib(RESULTS / "stream" / f"stream-{side}" / "native.sqlite")
    predicted = predicted_mib("levels4-stream", side, rows)
    assert measured <= predicted <= 1.15 * measured


AUTO_RUNS = sorted((RESULTS / "auto-blocks").glob("auto-*/native.sqlite"))


@pytest.mark.parametrize("database", AUTO_RUNS, ids=[db.parent.name for db in AUTO_RUNS])
def test_the_default_sets_runs_were_picked_as_now_and_predicted_on_the_safe_side(database):
    """tile:auto's runs with plan set 2 on an H200 (4188 px under 2 GiB, 8192, 12288 and 16384
    px under 8 GiB): the model picks today what they ran, and its prediction is at or above
    every phase's measured allocator peak (the forward's too) and at most 20% above the
    backward's it models (measured: 0.4 to 16.8%)."""
    from memstudy.byte_sizes import parse_bytes

    with sqlite3.connect(database) as db:
        config, notes = (json.loads(v) for v in db.execute(
            "select config_json, env_json from runs where id = 1").fetchone())
        peaks = {phase: (start + above) / MiB for phase, start, above in db.execute(
            "select a.phase, a.value, b.value from metrics a join metrics b on a.run_id = "
            "b.run_id and a.phase = b.phase where a.run_id = 1 and a.name = "
            "'alloc_start_bytes' and b.name = 'alloc_peak_bytes'")}
    recorded = notes["notes"]["tile"]["auto"]
    side = -(-config["train"]["image_size"] // 32) * 32
    offloaded = any(t.startswith("offload_optim") for t in config["techniques"])
    chosen = pick(side, parse_bytes(config["budget"]) / GiB, optim_on_device=not offloaded)
    assert (chosen.plan, chosen.rows) == (recorded["plan"], recorded["rows"])
    predicted = chosen.predicted_bytes / MiB
    assert max(peaks.values()) <= predicted <= 1.2 * peaks["backward"], (predicted, peaks)


NETWORKS = sorted([*(RESULTS / "networks-auto").glob("resnet*-*-*GiB"),
                   *(RESULTS / "networks-auto-hold").glob("resnet*-*-*GiB*")])


@pytest.mark.parametrize("run", NETWORKS, ids=[f"{run.parent.name}/{run.name}" for run in NETWORKS])
def test_other_networks_peaks_are_predicted_within_3_percent_or_above(run):
    """The ResNet-18, -34 and -50 U-Nets trained under tile:auto on an H200 (enhancement and
    segmentation, 4 and 8 GiB): the model, fitted to ResNet-34 alone, predicts each backward
    peak for the plan and strips picked at most 3% low and at most 50% high (measured: ResNet-18
    and -34 -2 to +3%, ResNet-50 +20 to +22% with levels2, +45% with levels4-stream's 1056-row
    strips: its strip term sums the Bottlenecks' expanded outputs, which no region holds at
    once, so the safe side costs ResNet-50 taller strips). With the sum of every leaf output below the tiled levels
    in place of their largest block, ResNet-18's was 19% low (1400-row strips, 20 allocator
    retries a run; 3 with the strips picked now)."""
    encoder, task = run.name.split("-")[:2]
    with sqlite3.connect(run / "native.sqlite") as db:
        notes = db.execute("select env_json from runs where id = 1").fetchone()[0]
    picked = json.loads(notes)["notes"]["tile"]["auto"]
    levels, keep, layer1, _ = auto.PLANS[picked["plan"]]
    shapes = auto._Shapes.of((encoder, (256, 128, 64, 32, 16), 1, 1, task))
    halo = auto.min_tile_rows(levels, keep, layer1, encoder)
    predicted = (shapes.parameters * 16 + auto._activations(
        picked["plan"], shapes, levels, 4192, 4192, picked["rows"] + halo, 2)) / MiB
    measured = backward_peak_mib(run / "native.sqlite")
    assert 0.97 * measured <= predicted <= 1.5 * measured, (predicted, measured)


def pick(side: int, budget_gib: float, encoder: str = "resnet34", optim_on_device=True,
         batch: int = 1, ahead: bool = True, plans: int = 2):  # tile:ahead's and tile:plans'
    return auto.pick(side, side, batch, int(budget_gib * GiB), ModelConfig(encoder=encoder),
                     "enhance", True, optim_on_device, ahead, plans)  # defaults with auto


def test_the_fastest_plan_that_fits_with_its_tallest_strips():
    at_4gib, at_8gib = pick(4192, 4), pick(16384, 8)
    assert (at_4gib.plan, at_4gib.stream) == ("levels2", False)
    assert (at_8gib.plan, at_8gib.stream) == ("levels4-stream-blocks", True)
    for chosen in (at_4gib, at_8gib):
        assert chosen.predicted_bytes <= chosen.available_bytes
        assert chosen.rows % 2 ** chosen.levels == 0
    assert at_8gib.record() == {"plan": "levels4-stream-blocks", "rows": at_8gib.rows,
                                "predicted_peak_bytes": at_8gib.predicted_bytes,
                                "available_bytes": at_8gib.available_bytes}
    assert at_8gib.says() == (
        f"tile:auto picked levels4-stream-blocks: levels=4, {at_8gib.rows}-row strips, "
        "stream=True "
        f"(predicted peak {at_8gib.predicted_bytes / MiB:.0f} MiB of "
        f"{at_8gib.available_bytes / MiB:.0f} MiB planned beside the CUDA context)")
    taller = pick(16384, 8.5)  # more memory: no narrower strips, no slower plan
    order = auto.PLAN_SETS[2]
    assert order.index(taller.plan) <= order.index(at_8gib.plan)
    assert taller.plan != at_8gib.plan or taller.rows >= at_8gib.rows
    assert pick(4192, 16).rows == 4192  # room for the whole image in one strip
    one, two = pick(4192, 4), pick(4192, 4, batch=2)  # two images: each term but the constant
    assert (two.plan, two.rows) != (one.plan, one.rows)
    assert two.predicted_bytes <= two.available_bytes


@pytest.mark.parametrize("side, budget, optim_on_device, plans, plan, rows", [
    (4192, 4, True, 2, "levels2", 1400),                 # 4188 px padded: 3 strips
    (4192, 2, False, 2, "levels4-stream-blocks", 704),   # with offload_optim: 6 strips
    (4192, 8, True, 2, "levels2", 4192),                 # the whole image in one strip
    (8192, 8, True, 2, "levels3", 1640),   # 5 strips (levels2's would be under MIN_ROWS)
    (12288, 8, True, 2, "levels4-stream-blocks", 1376),  # 9 strips
    (16384, 8, True, 2, "levels4-stream-blocks", 784),   # 21 strips
    (4192, 2, False, 1, "levels4-stream", 704),   # plan set 1: layer1 cut at its convolutions
    (12288, 8, True, 1, "levels4-stream", 1376),
    (16384, 8, True, 1, "levels4-stream", 752),   # 22 strips
    (8192, 8, True, 1, "levels3", 1640),
])
def test_the_picks_for_the_studys_sizes_and_budgets_are_pinned(side, budget, optim_on_device,
                                                                plans, plan, rows):
    """The picks measured (docs/techniques/tile.md, "tile:auto") and those still to measure: a
    change of the model, its calibration or its margin shows here first."""
    chosen = pick(side, budget, optim_on_device=optim_on_device, plans=plans)
    assert (chosen.plan, chosen.rows) == (plan, rows)


def test_a_streamed_plan_counts_what_its_copies_a_tile_ahead_hold():
    """With tile:ahead=true a streamed sweep holds, beside the computing tile, the next tile's host
    strips, its rows of a host output gradient, and the tile before's input gradient rows still
    being written back (memstudy/streaming.py). The most of any region, for ResNet-34 at
    levels=4 each layer1 block's second region: inputs a<j> and p<j> (64 channels at 1/4 res,
    bf16: 64 / 16 * 2 = 8 bytes per strip row and image column each, twice: strip and
    gradient) and output p<j+1> (8): 40 bytes. The pick adds it for every strip row, so its
    strips are lower than with tile:ahead=false, which adds nothing: 752 rows at 16384 px
    against 864, 1376 at 12288 against 1536, 704 at 4188 px under 2 GiB against 848 (plan set
    1; cut at the blocks, set 2, no p<j>: 36 bytes)."""
    from memstudy.models import build_unet
    from memstudy.tiling.tiled_forward import TiledForward

    with torch.device("meta"):
        unet = build_unet()

    def tiled(stream: bool, ahead: bool = True) -> TiledForward:  # ahead as tile:ahead=true
        return TiledForward(unet, 4, 0, 0, "conv1", None, "convs", "torch", stream, ahead)

    assert tiled(True).fetched_ahead_bytes(1, 1, 2) == 2 * 8 + 2 * 8 + 8
    assert tiled(True).fetched_ahead_bytes(16384, 2, 2) == 2 * 16384 * 40
    assert tiled(False).fetched_ahead_bytes(16384, 1, 2) == 0
    assert tiled(True, ahead=False).fetched_ahead_bytes(16384, 1, 2) == 0
    assert TiledForward(unet, 4, 0, 0, "conv1", None, "blocks", "torch", True,
                        True).fetched_ahead_bytes(1, 1, 2) == 2 * 8 + 2 * 8 + 4
    for ahead, rows in ((True, [752, 1376, 704]), (False, [864, 1536, 848])):
        assert [pick(16384, 8, ahead=ahead, plans=1).rows,
                pick(12288, 8, ahead=ahead, plans=1).rows,
                pick(4192, 2, optim_on_device=False, ahead=ahead, plans=1).rows] == rows
    chosen = pick(16384, 8, plans=1)
    halo = auto.min_tile_rows(4, "conv1", "convs", "resnet34")
    shapes = auto._Shapes.of(("resnet34", tuple(DEFAULT_DECODER_CHANNELS), 1, 1, "enhance"))

    def predicted(rows: int, ahead: bool) -> float:
        return shapes.parameters * 16 + auto._activations(
            "levels4-stream", shapes, 4, 16384, 16384, rows + halo, 2) \
            + ahead * 40 * 16384 * (rows + halo)

    assert chosen.predicted_bytes == int(predicted(chosen.rows, True))
    # 864-row strips (19), the pick with the copies on the compute stream, fit only without
    assert predicted(864, False) <= chosen.available_bytes < predicted(864, True)
    unhurried = pick(16384, 8, ahead=False, plans=1)
    assert (unhurried.rows, unhurried.predicted_bytes) == (864, int(predicted(864, False)))


def test_a_larger_encoder_gets_no_taller_strips():
    """ResNet-50's activations per pixel are larger than ResNet-34's: under the same budget its
    pick is the same plan with strips no taller, or a more frugal plan."""
    small, large = pick(4192, 4), pick(4192, 4, "resnet50")
    order = auto.PLAN_SETS[2]
    assert order.index(large.plan) > order.index(small.plan) or large.rows <= small.rows
    assert (small.plan, small.rows) != (large.plan, large.rows)


def test_no_plan_is_one_line_naming_what_to_change():
    with pytest.raises(ConfigError, match=r"tile:auto finds no plan for 16384 x 16384 px \(padded\), "
                                          r"batch 1, under 1\.5GiB.*raise the budget"):
        pick(16384, 1.5)


def cuda_plan(techniques: str, size=4188, budget="4GiB"):
    cfg = small_config(size, techniques=techniques.split(","))
    cfg.train.device, cfg.budget = "cuda", budget
    if size == "native":  # native sizes are folder data's
        cfg.data.source, cfg.data.path = "folder", str(Path(__file__).parent)
    return make_plan(cfg, device=torch.device("cuda"), n_gpus=1)


@pytest.mark.parametrize("size, budget", [(4188, 4), (16384, 8)])  # levels2; streamed
def test_the_run_tiles_with_the_pick_spelled_out(size, budget, monkeypatch):
    from memstudy import image_sizes
    from memstudy.techniques.tile import concrete

    monkeypatch.setattr(image_sizes, "host_memory_bytes", lambda: 128 * GiB)  # 16384 streams

    plan = cuda_plan(SET, size, f"{budget}GiB")
    tiled = concrete(plan.chosen["tile"], plan)
    chosen = pick(-(-size // 32) * 32, budget)
    assert (tiled.levels, tiled.rows, tiled.keep, tiled.layer1, tiled.stream, tiled.tiles) == (
        chosen.levels, chosen.rows, chosen.keep, chosen.layer1, chosen.stream, 0)
    assert any(t.startswith("tile:tiles=auto:") for t in plan.applied())  # auto's own hash


@pytest.mark.parametrize("spec, layer1, rows", [("auto", "blocks", 784),
                                                ("auto:plans=1", "convs", 752)])
def test_the_plan_set_decides_how_a_streamed_run_cuts_its_residual_stages(spec, layer1, rows,
                                                                          monkeypatch):
    """At 16384 px under 8 GiB the default set streams with layer1 and layer2 cut at their
    blocks; tile:plans=1 picks as runs recorded before it did (their convolutions)."""
    from memstudy import image_sizes
    from memstudy.techniques.tile import concrete

    monkeypatch.setattr(image_sizes, "host_memory_bytes", lambda: 128 * GiB)
    plan = cuda_plan(SET.replace("auto", spec), 16384, "8GiB")
    tiled = concrete(plan.chosen["tile"], plan)
    assert (tiled.levels, tiled.layer1, tiled.stream, tiled.rows) == (4, layer1, True, rows)


@pytest.mark.parametrize("size, budget, streams", [(8192, 8, False), (16384, 8, True)])
def test_auto_runs_a_tile_ahead_only_where_its_pick_streams(size, budget, streams,
                                                            monkeypatch):
    """tile:auto:ahead=true at a size whose pick streams nothing (8192 px under 8 GiB: levels=3
    on the device) plans and runs without ahead, not refused as tile:ahead without stream is;
    where the pick streams, with it, at the lower strips that count what it holds."""
    from memstudy import image_sizes
    from memstudy.techniques.tile import concrete

    monkeypatch.setattr(image_sizes, "host_memory_bytes", lambda: 128 * GiB)
    plan = cuda_plan(SET.replace("auto", "auto:ahead=true"), size, f"{budget}GiB")
    tiled = concrete(plan.chosen["tile"], plan)
    assert (tiled.stream, tiled.ahead) == (streams, streams)
    assert tiled.rows == pick(size, budget).rows


def test_holding_the_last_boundary_plans_as_without_it():
    """offload:hold=1 keeps the tensor the backward brings back first: tile:auto plans the same
    strips with it, and keeps it in the run's offload options (measured peak no higher:
    benchmarks/results/h200/hold-4188-4gib/)."""
    from memstudy.techniques.tile import concrete

    held = cuda_plan(SET.replace("prefetch=1", "prefetch=1:hold=1"))
    plain = cuda_plan(SET)
    assert held.chosen["offload"].hold == 1
    assert concrete(held.chosen["tile"], held) == concrete(plain.chosen["tile"], plain)


@pytest.mark.parametrize("techniques, budget, size, refusal", [
    (SET, None, 4188, "tile:auto plans the strips for a memory budget"),
    ("amp:bf16,offload:which=all,tile:auto", "4GiB", 4188, "add checkpoint, or"),
    (SET, "4GiB", "native", "tile:auto plans for one image size"),
    (SET.replace("auto", "auto:levels=3"), "4GiB", 4188, "drop levels=3"),
    (SET.replace("auto", "auto:graphs=true"), "4GiB", 4188, "drop graphs=true"),
    (SET, "1.5GiB", 16384, "tile:auto finds no plan"),
    (SET.replace("auto", "auto:plans=3"), "4GiB", 4188, "tile:plans=3 is not a plan set; "
                                                          "give one of 1, 2"),
    (SET.replace("auto", "4:plans=2"), "4GiB", 4188, "tile:plans=2 without tile:auto"),
    (SET.replace("checkpoint", "checkpoint:selective"), "4GiB", 4188,
     "checkpoint:selective keeps more on the device"),
    (SET.replace("prefetch=1", "prefetch=2:hold=2"), "4GiB", 4188,
     "offload:prefetch=2, offload:hold=2 keeps more on the device"),
])
def test_what_auto_cannot_plan_is_refused_before_anything_runs(techniques, budget, size,
                                                                refusal):
    with pytest.raises(ConfigError, match=refusal):
        cuda_plan(techniques, size, budget)


def test_a_run_records_its_techniques_notes():
    """The run's record keeps the techniques' notes (env "notes"): how tile ran, which is
    where tile:auto's pick is read back (a CPU run of tile itself: auto needs offload)."""
    from memstudy.runner import execute

    rec = execute(small_config(192, techniques=["tile:2"]), None)
    assert rec.status == "ok", rec.error
    assert rec.env["notes"]["tile"]["tiles"] == 2 and rec.env["notes"]["tile"]["levels"] == 2
    assert "auto" not in rec.env["notes"]["tile"]


@pytest.mark.parametrize("spec, ahead", [("tile:2:stream=true", True),
                                         ("tile:2:stream=true:ahead=false", False),
                                         ("tile:2", False)])
def test_a_streamed_run_copies_a_tile_ahead_unless_told_not_to(spec, ahead):
    """tile:ahead's default is true where boundaries stream: the run's notes say what its
    copies did (on the CPU too, where the look-ahead still orders the strips)."""
    from memstudy.runner import execute

    rec = execute(small_config(192, techniques=[spec]), None)
    assert rec.status == "ok", rec.error
    assert rec.env["notes"]["tile"]["ahead"] is ahead


def test_memstudy_run_says_what_auto_picked():
    from memstudy.cli import summarize
    from memstudy.store import RunRecord

    chosen = pick(16384, 8)
    notes = {"tile": {"levels": chosen.levels, "auto": chosen.record(), "says": chosen.says()},
             "val_tiling": "tiled: levels=4"}
    rec = RunRecord(config={"train": {"image_size": 16384, "batch_size": 1}, "world_size": 1},
                    config_hash="h", name="tile:auto", status="ok",
                    env={"device": "cuda:0", "notes": notes}, started_at=0.0)
    assert (f"\ntile:auto picked levels4-stream-blocks: levels=4, {chosen.rows}-row strips, "
            "stream=True (predicted peak") in summarize(rec)


def test_a_dry_run_says_the_pick_and_records_nothing(tmp_path, capsys):
    """memstudy run --dry-run plans a GPU run on this CPU machine: the pick and its predicted
    peak for a ResNet-50 U-Net, no database written."""
    from memstudy.cli import main

    db = tmp_path / "runs.sqlite"
    code = main(["--db", str(db), "run", "--dry-run", "-t", SET, "--device", "cuda",
                 "--size", "4188", "--budget", "4GiB", "--set", "model.encoder=resnet50"])
    said = capsys.readouterr().out
    chosen = pick(4192, 4, "resnet50")
    assert code == 0 and not db.exists()
    assert "resnet50 U-Net" in said and chosen.says() in said
    assert said.rstrip().endswith("nothing trained or recorded (--dry-run)")


def test_a_stream_auto_picked_that_the_host_cannot_hold_names_the_budget(monkeypatch):
    from memstudy import image_sizes

    monkeypatch.setattr(image_sizes, "host_memory_bytes", lambda: 8 * GiB)
    with pytest.raises(ConfigError, match=r"or a larger budget \(tile:auto streamed"):
        cuda_plan(SET, 16384, "8GiB")


def test_strip_heights_are_each_strip_counts_rows_on_the_grid_down_to_the_floor():
    """One height per strip count, tallest first, each the count's share rounded up to the
    grid, repeats left out, the floor itself included."""
    assert list(auto._strip_heights(64, 16, 16)) == [64, 32, 16]  # 3 strips: 32 again
    heights = list(auto._strip_heights(4192, 16, 1000))
    assert heights == [4192, 2096, 1408, 1056] and all(type(h) is int for h in heights)


def test_the_network_is_split_at_the_tiled_levels():
    """ResNet-34 U-Net's leaf outputs per full-resolution pixel by down-sampling (1: decoder
    block 4 and the head, 2: the stem and block 3, ... 32: layer4), split below / inside the
    tiled levels: levels=2 tiles downs 1 and 2, 3 also 4, 4 also 8."""
    shapes = auto._Shapes.of(RESNET34)
    assert shapes.per_pixel == ((1, 83.0), (2, 104.0), (4, 84.0), (8, 52.0), (16, 34.0),
                                (32, 7.5))
    # below: the largest block's working set (decoder block 2 at levels=2: its up-sampled
    # input, the concatenation, two convolutions and BatchNorms: 38 at 1/4 resolution)
    assert [shapes.split(levels) for levels in (2, 3, 4)] == [
        (38.0, 187.0), (19.0, 271.0), (9.5, 323.0)]
