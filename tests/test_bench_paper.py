"""benchmarks/bench_paper.py: the study's tables beside its published values, with the
seed-spread flag, from a small database built with the store API."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
import bench_paper  # noqa: E402

from memstudy.grid import expand, load_spec  # noqa: E402
from memstudy.store import ResultsDB, RunRecord  # noqa: E402

MB = 1024**2


def paper_run(db, name: str, seed: int, val: float, fwd_mb: float = 500, train: float | None = None,
              trained: bool = True) -> None:
    metrics = [(0, phase, key, value) for phase, inc in (("forward", fwd_mb), ("backward", 100))
               for key, value in (("alloc_peak_bytes", inc * MB), ("alloc_start_bytes", 300 * MB))]
    db.record(RunRecord(
        config={"train": {"image_size": 512, "batch_size": 1, "seed": seed}, "world_size": 1,
                "label": bench_paper.LABEL}, config_hash=f"{name}{seed}", name=name, status="ok",
        env={"device": "cuda:0", "gpu_name": "Test GPU"}, started_at=0.0, label=bench_paper.LABEL,
        trained=trained, metrics=metrics, epochs=[  # the first epoch's time (autotuning) is not the epoch time
            {"epoch": 0, "steps": 1, "train_loss": 0.5, "val_loss": 0.5, "time_s": 90.0},
            {"epoch": 49, "steps": 48, "train_loss": val if train is None else train,
             "val_loss": val, "time_s": 30.0}]))


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
