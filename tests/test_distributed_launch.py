"""`memstudy run` with world_size 2: spawns two gloo processes, stores ONE run with every
rank's phases plus their mean and maximum. GPU variants (NCCL DDP, in-process mp) are
marked multigpu and run on the lead's 2-GPU host."""
from __future__ import annotations

import pytest
import torch

from memstudy.cli import main
from memstudy.distributed import RANK_MAX, RANK_MEAN
from memstudy.store import ResultsDB

COMMON = ["--size", "192", "--batch-size", "2", "--steps", "3", "--set", "world_size=2",
          "--set", "train.warmup_steps=2", "--set", "train.measure_steps=1",
          "--set", "data.train_images=6",
          "--set", "data.val_images=1", "-q"]


def _run(tmp_path, techniques: str, device: str) -> tuple[int, ResultsDB]:
    db = tmp_path / "runs.sqlite"
    rc = main(["--db", str(db), "run", "-t", techniques, "--device", device, *COMMON])
    return rc, ResultsDB(db)


def _check_one_distributed_run(db: ResultsDB) -> dict:
    runs = db.runs()
    assert len(runs) == 1 and runs[0]["status"] == "ok", runs
    assert runs[0]["world_size"] == 2
    metrics = db.metrics(runs[0]["id"])
    for phase in ("forward", "backward", "step"):
        for rank in (0, 1, RANK_MEAN, RANK_MAX):
            assert (rank, phase) in metrics, (rank, phase)
        t = [metrics[(r, phase)]["time_s"] for r in (0, 1)]
        assert metrics[(RANK_MAX, phase)]["time_s"] == max(t)
    epochs = db.epochs(runs[0]["id"])
    assert sorted(e["rank"] for e in epochs) == [0, 1]
    assert all(e["steps"] == 3 and e["val_loss"] is not None for e in epochs)
    return metrics


def test_run_launches_world_size_processes_and_stores_one_run(tmp_path, capsys):
    rc, db = _run(tmp_path, "dp,zero", "cpu")
    assert rc == 0
    metrics = _check_one_distributed_run(db)
    # ZeRO: each rank holds its own shard of the optimizer state (the shards differ in size)
    opt = [metrics[(r, "step")]["cat_optimizer_bytes"] for r in (0, 1)]
    params = metrics[(0, "step")]["cat_params_bytes"]
    assert all(0.3 * 2 * params < b < 0.7 * 2 * params for b in opt), (opt, params)
    assert "per-rank maximum over 2 ranks" in capsys.readouterr().out


def test_run_refuses_a_batch_the_world_size_does_not_divide(tmp_path, capsys):
    db = tmp_path / "runs.sqlite"
    rc = main(["--db", str(db), "run", "-t", "dp", "--device", "cpu", *COMMON,
               "--batch-size", "3"])
    assert rc == 2
    assert "train.batch_size 3" in capsys.readouterr().err
    assert ResultsDB(db).runs() == []  # refused before any process started


def test_spawned_run_refuses_a_progress_callback_it_cannot_send(tmp_path, monkeypatch):
    """spawn pickles the progress callback; a lambda (bench_daso_ab's, 2 x H200, 2026-11-23)
    is refused by name before any process starts."""
    from memstudy.config import RunConfig
    from memstudy.launch_ranks import run_distributed

    cfg = RunConfig(techniques=["dp"], world_size=2)
    cfg.train.device, cfg.train.batch_size = "cpu", 2
    monkeypatch.setattr(torch.multiprocessing, "spawn", lambda *a, **k: pytest.fail("spawned"))
    with pytest.raises(TypeError, match="module-level function"):
        run_distributed(cfg, str(tmp_path / "r.sqlite"), lambda message: None)


@pytest.mark.multigpu
def test_nccl_ddp_on_two_gpus(tmp_path):
    rc, db = _run(tmp_path, "dp:backend=nccl,amp:bf16", "cuda")
    assert rc == 0
    metrics = _check_one_distributed_run(db)
    assert metrics[(RANK_MAX, "forward")]["alloc_peak_bytes"] > 0
    run = db.runs()[0]
    assert run["device"] == "cuda:0"


@pytest.fixture
def full_float32():
    """cuDNN convolutions default to TF32: two devices picking different algorithms then differ
    by TF32's ~1e-3, order-dependently (an earlier amp run in the process turns TF32 off)."""
    from memstudy.techniques.amp import set_tf32

    before = torch.backends.cudnn.allow_tf32, torch.get_float32_matmul_precision()
    set_tf32(False)
    yield
    set_tf32(before[0])
    torch.set_float32_matmul_precision(before[1])


@pytest.mark.multigpu
def test_in_process_model_parallel_on_two_gpus_equals_unsplit(full_float32):
    from memstudy.techniques.mp.split import LocalSplitUNet
    from memstudy.models import build_unet

    ref, split = build_unet(seed=0).cuda(0), build_unet(seed=0)
    split = LocalSplitUNet(split, torch.device("cuda", 0), torch.device("cuda", 1))
    x = torch.rand(2, 1, 192, 192, device="cuda:0")
    out_ref, out = ref(x), split(x)
    assert out.device == torch.device("cuda", 1)
    torch.testing.assert_close(out.to("cuda:0"), out_ref, rtol=1e-4, atol=1e-5)
    out_ref.mean().backward()
    out.mean().backward()
    for (n, p), (_, q) in zip(ref.named_parameters(), split.named_parameters()):
        torch.testing.assert_close(q.grad.to("cuda:0"), p.grad, rtol=1e-3, atol=1e-6, msg=n)
    assert split.encoder.conv1.weight.device == torch.device("cuda", 0)
    assert split.head[0].weight.device == torch.device("cuda", 1)


@pytest.mark.multigpu
def test_in_process_model_parallel_run_on_two_gpus(tmp_path):
    db = tmp_path / "runs.sqlite"
    rc = main(["--db", str(db), "run", "-t", "mp:mode=local,amp:bf16", "--device", "cuda",
               "--size", "192", "--batch-size", "2", "--steps", "3",
               "--set", "train.warmup_steps=1", "-q"])
    assert rc == 0
    (run,) = ResultsDB(db).runs()
    assert run["status"] == "ok"
    assert (0, "forward") in ResultsDB(db).metrics(run["id"])  # steps 2 and 3 were measured


@pytest.mark.multigpu
@pytest.mark.parametrize("techniques", ["mp,amp:fp16", "pipeline,amp:fp16", "fsdp,amp:fp16",
                                        "dp,zero,amp:fp16,checkpoint"])
def test_split_and_sharded_runs_on_two_gpus_with_fp16_loss_scaling(tmp_path, techniques):
    rc, db = _run(tmp_path, techniques, "cuda")
    assert rc == 0, db.runs()
    runs = db.runs()
    assert runs[0]["status"] == "ok" and runs[0]["world_size"] == 2
