"""benchmarks/bench_paper.py: the study's tables beside its published values, with the
seed-spread flag, from a small database built with the store API."""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
import bench_paper  # noqa: E402

from memstudy.distributed.records import merge  # noqa: E402
from memstudy.grid import expand, load_spec  # noqa: E402
from memstudy.store import ResultsDB, RunRecord  # noqa: E402
from memstudy.techniques.compose import make_plan  # noqa: E402

MB = 1024**2
SLOTS = iter(range(10**6))  # each record its own time window: no two overlap unless asked


def paper_record(name: str, seed: int, val: float, fwd_mb: float = 500, train: float | None = None,
                 trained: bool = True, label: str = bench_paper.LABEL, world: int = 1,
                 epoch_s: float = 30.0, others: int | None = None,
                 span: tuple[float, float] | None = None) -> RunRecord:
    metrics = [(0, phase, key, value) for phase, inc in (("forward", fwd_mb), ("backward", 100))
               for key, value in (("alloc_peak_bytes", inc * MB), ("alloc_start_bytes", 300 * MB))]
    if others is not None:  # processes it saw on its GPU (gpu_other_processes)
        metrics.append((0, "run", "gpu_other_processes", others))
    if span is None:
        slot = next(SLOTS) * 1000.0
        span = (slot, slot + 500.0)
    return RunRecord(
        config={"train": {"image_size": 512, "batch_size": 1, "seed": seed}, "world_size": world,
                "label": label}, config_hash=f"{name}{seed}", name=name, status="ok",
        env={"device": "cuda:0", "gpu_name": "Test GPU", "host": "h"}, started_at=span[0],
        finished_at=span[1], label=label,
        trained=trained, metrics=metrics, epochs=[  # the first epoch's time (autotuning) is not the epoch time
            {"epoch": 0, "steps": 1, "train_loss": 0.5, "val_loss": 0.5, "time_s": 90.0},
            {"epoch": 49, "steps": 48, "train_loss": val if train is None else train,
             "val_loss": val, "time_s": epoch_s}])


def paper_run(db, name: str, seed: int, val: float, fwd_mb: float = 500, train: float | None = None,
              trained: bool = True) -> None:
    db.record(paper_record(name, seed, val, fwd_mb, train, trained))


def two_gpu_run(db, name: str, seed: int, val: float, train: float, fwd_mb=(500, 500),
                epoch_s=(20.0, 26.0), label: str = bench_paper.LABEL_2GPU,
                span: tuple[float, float] | None = None) -> None:
    """A run of the two-GPU protocol as rank 0 stores it (records.merge): each rank's metrics
    and epochs, and the mean and maximum over the ranks."""
    if span is None:
        slot = next(SLOTS) * 1000.0
        span = (slot, slot + 500.0)
    ranks = [paper_record(name, seed, val, fwd, train, label=label, world=2, epoch_s=t,
                          span=span) for fwd, t in zip(fwd_mb, epoch_s)]
    db.record(merge(ranks))


def test_the_spec_is_the_papers_protocol():
    cells = expand(load_spec(bench_paper.SPEC))
    cfg = cells[0].config
    assert (cfg.train.image_size, cfg.train.epochs, cfg.data.train_images, cfg.data.val_images) == (512, 50, 48, 12)
    published = bench_paper.tomllib.loads(bench_paper.PUBLISHED.read_text())
    names = {c.name for c in cells}
    # four seeds of each set, seed 1 (never trains: docs/paper.md) last, so that three train
    assert len(cells) == 4 * len(names)
    assert [c.config.train.seed for c in cells[:4]] == [0, 2, 3, 1]
    for table in ("table1a", "table1b", "table2"):
        assert set(published[table]) <= names, table  # every published set is run


def test_tables_beside_the_paper_with_the_seed_spread_flag(tmp_path, capsys):
    db = ResultsDB(tmp_path / "paper.sqlite")
    for seed, noise in enumerate((-0.001, 0.0, 0.001)):
        paper_run(db, "original", seed, 0.060 + noise)
        paper_run(db, "amp:fp16", seed, 0.063 + noise)      # 3 std apart: beyond the spread
        paper_run(db, "invertible", seed, 0.0605 + noise)   # within it
        paper_run(db, "checkpoint:block", seed, 0.0615 + noise)  # 1.5 std: intervals overlap
    paper_run(db, "original", 3, 1.0, train=1.0, trained=False)  # flagged: named, not averaged
    paper_run(db, "quantization", 0, 0.07)                   # one seed: against original's spread
    paper_run(db, "amp:fp16+checkpoint:block", 0, 0.0601)
    assert bench_paper.main([str(db.path), "--format", "md"]) == 0
    out = capsys.readouterr().out
    table1a = out.split("Table 1A")[1].split("Table 1B")[0]
    line = {row.split("|")[2].strip(): row for row in table1a.splitlines() if row.startswith("| ")}
    assert "| 6.3000 ± 0.1000 (n=3) | 6.2515 | yes |" in line["amp:fp16"]
    assert "| no |" in line["invertible"] and "| outside original's spread (one seed) |" in line["quantization"]
    assert "| 6.0000 ± 0.1000 (n=3) | 4.0504 |" in line["original"] and "| 3 | ok |" in line["original"]
    assert "| no |" in line["checkpoint:block"]
    table1b = out.split("Table 1B")[1].split("Table 2")[0]
    assert "| inside original's spread (one seed) |" in table1b
    table2 = out.split("Table 2")[1].split("Figure 2")[0]
    assert "| 500.00 ± 0.00 | 757.76 |" in table2  # our forward MB beside the paper's
    assert "| 30.00 ± 0.00 | 35.63 |" in table2   # epochs after the first only


def test_table2_times_only_runs_that_had_the_gpu_alone(tmp_path, capsys):
    """Cells run side by side on one GPU keep their losses and memory in the tables; their
    epoch times are left out, and the cell says how many."""
    db = ResultsDB(tmp_path / "paper.sqlite")
    db.record(paper_record("original", 0, 0.060, epoch_s=30.0, others=0))
    db.record(paper_record("original", 2, 0.061, epoch_s=31.0))  # recorded before the count
    db.record(paper_record("original", 3, 0.062, fwd_mb=510, epoch_s=80.0, others=3))
    assert bench_paper.main([str(db.path), "--format", "md"]) == 0
    out = capsys.readouterr().out
    original = next(r for r in out.split("Table 2")[1].split("Figure 2")[0].splitlines()
                    if "| original |" in r)
    assert "| 30.50 ± 0.71 (1 on a shared GPU left out) | 35.63 |" in original
    assert "| 503.33 ± 5.77 |" in original  # its memory counts
    assert "(n=3)" in out.split("Table 1A")[1].split("Table 1B")[0]  # and its loss


def test_the_recorded_flag_decides_which_seeds_did_not_train(tmp_path, capsys):
    """A last epoch at loss 1 is not taken as proof: only runs.trained = 0 leaves a seed out."""
    db = ResultsDB(tmp_path / "paper.sqlite")
    paper_run(db, "original", 0, 0.5, train=1.0)                 # trained (flag 1): averaged
    paper_run(db, "original", 1, 0.7, train=1.0, trained=False)  # did not train: named
    assert bench_paper.main([str(db.path), "--format", "md"]) == 0
    original = next(row for row in capsys.readouterr().out.split("Table 1B")[0].splitlines()
                    if "| original |" in row)
    assert "| 100.0000 (n=1) |" in original and "| 50.0000 (n=1) |" in original
    assert original.rstrip().endswith("| 1 | ok |")


def test_figure2_is_memory_over_originals(tmp_path, capsys):
    db = ResultsDB(tmp_path / "paper.sqlite")
    paper_run(db, "original", 0, 0.06, fwd_mb=400)
    paper_run(db, "amp:fp16", 0, 0.06, fwd_mb=100)
    assert bench_paper.main([str(db.path)]) == 0
    figure = capsys.readouterr().out.split("Figure 2")[1]
    amp = next(row for row in figure.splitlines() if "amp:fp16 " in row)
    assert amp.split()[2:6] == ["0.25", "0.64", "1.00", "0.23"]  # ours, paper's (481.28 / 757.76)
    assert "- " in next(row for row in figure.splitlines() if "invertible " in row)


def test_a_file_that_is_no_database_is_said_in_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.sqlite"
    bad.write_text("garbage")
    assert bench_paper.cli([str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("bench_paper: error: ") and "is not an SQLite database" in err
    assert err.count("\n") == 1


def test_figure2_drawn_holds_the_tables_ratios(tmp_path):
    db = ResultsDB(tmp_path / "paper.sqlite")
    paper_run(db, "original", 0, 0.06, fwd_mb=400)
    paper_run(db, "amp:fp16", 0, 0.06, fwd_mb=100)
    published = bench_paper.tomllib.loads(bench_paper.PUBLISHED.read_text())
    ratios = {name: r for _label, name, r in
              bench_paper.figure2_ratios(published["table2"], bench_paper.runs_by_set(str(db.path), None))}
    assert ratios["amp:fp16"]["forward"] == pytest.approx((0.25, 481.28 / 757.76))
    assert ratios["invertible"]["forward"][0] is None  # not measured: no bar of ours
    fig = bench_paper.figure2_chart(list(bench_paper.figure2_ratios(
        published["table2"], bench_paper.runs_by_set(str(db.path), None))), "Test GPU")
    ours = fig.axes[0].containers[0]  # forward panel, our bars in the published order
    names = list(published["table2"])
    assert ours[names.index("amp:fp16")].get_height() == pytest.approx(0.25)
    out = tmp_path / "f2.png"
    assert bench_paper.main([str(db.path), "--figure", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_2gpu_specs_are_the_papers_protocol_on_two_gpus():
    """Tables 3-6's sets, at Tables 1-2's protocol and [base] (but the label), and every cell
    valid as planned on a host with two GPUs."""
    one_gpu = bench_paper.tomllib.loads(bench_paper.SPEC.read_text())
    published = bench_paper.tomllib.loads(bench_paper.PUBLISHED.read_text())
    names = set()
    for path, batch in zip(bench_paper.SPECS_2GPU, (2, 1)):  # dp: one image per GPU
        raw = bench_paper.tomllib.loads(path.read_text())
        assert raw["base"]["train"] == one_gpu["base"]["train"]
        assert raw["base"]["data"] == one_gpu["base"]["data"]
        cells = expand(load_spec(path))
        assert [c.config.train.seed for c in cells[:4]] == one_gpu["seeds"]
        for cell in cells:
            cfg = cell.config
            assert (cfg.train.image_size, cfg.train.epochs, cfg.train.batch_size) == (512, 50, batch)
            assert (cfg.world_size, cfg.label) == (2, bench_paper.LABEL_2GPU)
            plan = make_plan(copy.deepcopy(cfg), device=torch.device("cuda"), n_gpus=2)
            assert plan.gpus_needed() == 2, cell.name
        names |= {c.name for c in cells}
    assert len(names) == 14
    for table in ("table3", "table4", "table5", "table6"):
        assert set(published[table]) - {"original"} <= names, table  # every published set is run


def _rows(out: str, title: str, end: str | None) -> dict[str, str]:
    """The markdown rows of one printed table, by their techniques column."""
    part = out.split(title)[1]
    part = part.split(end)[0] if end else part
    return {row.split("|")[2].strip(): row for row in part.splitlines()
            if row.startswith("| ") and not row.startswith("| paper |")}  # not the header


def test_tables_3_to_6_beside_the_paper(tmp_path, capsys):
    db = ResultsDB(tmp_path / "paper.sqlite")
    for seed, noise in enumerate((-0.001, 0.0, 0.001)):
        paper_run(db, "original", seed, 0.060 + noise)
        two_gpu_run(db, "dp", seed, 0.063 + noise, train=0.020 + noise)   # beyond the spread
    two_gpu_run(db, "dp+zero", 0, 0.0605, train=0.02)                      # one seed
    for seed, val in enumerate((0.059, 0.061)):  # the ranks' mean is the paper's "average"
        two_gpu_run(db, "mp", seed, val, train=0.045, fwd_mb=(300, 500))
    assert bench_paper.main([str(db.path), "--format", "md"]) == 0
    out = capsys.readouterr().out
    table3 = _rows(out, "Table 3", "Table 4")
    assert "| 2.0000 ± 0.1000 (n=3) | 2.1602 | 6.3000 ± 0.1000 (n=3) | 6.1418 | yes |" in table3["dp"]
    assert "| 6.0500 (n=1) | 6.1418 | inside original's spread (one seed) |" in table3["dp+zero"]
    assert "| 6.0000 ± 0.1000 (n=3) | 6.0083 | - |" in table3["original"]
    assert table3["dp+amp:fp16"].endswith("| - | 2.4507 | - | 6.2196 | - | - | - | not measured |")
    assert table3["dp"].endswith("| Test GPU | ok |")  # the GPU of each row's runs
    table4 = _rows(out, "Table 4", "Table 5")
    assert table4["dp"].endswith("| 500.00 ± 0.00 | 757.76 | 100.00 ± 0.00 | 532.48 | "
                                 "600.00 ± 0.00 | 1290.24 | 20.00 ± 0.00 (n=3) | 14.44 | Test GPU | ok |")
    assert table4["original"].endswith("| 600.00 ± 0.00 | 1198.09 | 30.00 ± 0.00 (n=3) | 35.63 | "
                                       "Test GPU | ok |")
    assert table4["dp+zero+amp:fp16+checkpoint:block"].endswith(
        "| - | 276.48 | - | 153.6 | - | 430.08 | - | 12.98 | - | not measured |")
    table5 = _rows(out, "Table 5", "Table 6")
    assert "| 4.5000 ± 0.0000 (n=2) | 4.5295 | 6.0000 ± 0.1414 (n=2) | 5.9778 | no |" in table5["mp"]
    assert table5["mp+invertible"].endswith("| - | 4.6009 | - | 5.9407 | - | - | - | not measured |")
    table6 = _rows(out, "Table 6", None)
    assert table6["mp"].endswith("| 400.00 ± 0.00 | 424.96 | 100.00 ± 0.00 | 307.2 | "
                                 "500.00 ± 0.00 | 732.16 | 20.00 ± 0.00 (n=2) | 53.29 | Test GPU | ok |")
    assert len(table6) == 8 and sum("not measured" in row for row in table6.values()) == 6


def test_original_from_another_database(tmp_path, capsys):
    """--original: Original's losses, memory and epoch time come from that database, even
    where its run ids are the two-GPU database's too."""
    one, two = ResultsDB(tmp_path / "one.sqlite"), ResultsDB(tmp_path / "two.sqlite")
    paper_run(one, "original", 0, 0.06, fwd_mb=700)  # run id 1 in both files
    two_gpu_run(two, "dp", 0, 0.08, train=0.02)
    assert bench_paper.main([str(two.path), "--format", "md"]) == 0
    assert "| Original | original | - |" in capsys.readouterr().out  # not in the two-GPU file
    assert bench_paper.main([str(two.path), "--original", str(one.path), "--format", "md"]) == 0
    out = capsys.readouterr().out
    assert "| outside original's spread (one seed) |" not in out  # original has one seed here
    assert "| n/a (one seed) |" in _rows(out, "Table 3", "Table 4")["dp"]
    assert _rows(out, "Table 4", "Table 5")["original"].endswith(
        "| 700.00 | 757.76 | 100.00 | 440.32 | 800.00 | 1198.09 | 30.00 (n=1) | 35.63 | Test GPU | ok |")


def test_epoch_times_only_from_runs_with_no_neighbour(tmp_path, capsys):
    """Two two-GPU cells that ran at the same time on one host (4 GPUs, two lanes) keep their
    losses and memory in Tables 3-6, not their epoch times; the short timing specs' runs, one
    at a time, give those (and their losses enter no table)."""
    db = ResultsDB(tmp_path / "paper.sqlite")
    two_gpu_run(db, "dp", 0, 0.063, train=0.02, epoch_s=(40.0, 40.0), span=(0.0, 100.0))
    two_gpu_run(db, "mp", 0, 0.059, train=0.045, epoch_s=(50.0, 50.0), span=(50.0, 150.0))
    two_gpu_run(db, "dp", 0, 0.5, train=0.5, epoch_s=(12.0, 12.0), span=(200.0, 210.0),
                label=bench_paper.LABEL_TIMING)
    assert bench_paper.main([str(db.path), "--format", "md"]) == 0
    out = capsys.readouterr().out
    table4, table6 = _rows(out, "Table 4", "Table 5"), _rows(out, "Table 6", None)
    assert "| 12.00 (n=1) (1 beside another cell left out) | 14.44 |" in table4["dp"]
    assert "| - (1 beside another cell left out) | 53.29 |" in table6["mp"]
    assert "| 6.3000 (n=1) |" in _rows(out, "Table 3", "Table 4")["dp"]  # the 50-epoch run's loss
