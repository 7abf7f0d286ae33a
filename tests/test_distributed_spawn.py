"""Two gloo processes on the CPU: DDP, ZeRO, FSDP, the model-parallel split and the pipeline
against the unsplit, single-process model. One spawn runs every scenario (process start-up
dominates on CI); each rank writes its findings, the tests below assert on them."""
from __future__ import annotations

import datetime
import os
import pickle
import socket

import pytest
import torch
import torch.distributed as dist

from conftest import small_config

SIZE, BATCH, WORLD = 96, 2, 2
# 96 px with one MS-SSIM scale (five need 161 px or more): a quarter of 192 px's pixels,
# and the rank-split gradients still equal the unsplit ones to ~1e-6 (at 64 px DDP's differ by
# ~6e-5 from the single process's, past the 1e-5 the tests allow)
SCALES = 1


def _batch(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(BATCH, 1, SIZE, SIZE, generator=g)
    return x, (x * 0.8 + 0.1).clamp(0, 1)


def _build(techniques, encoder="resnet34", **train):
    from memstudy.runner import seed_everything
    from memstudy.techniques.compose import build_pipeline, make_plan

    cfg = small_config(SIZE, techniques, batch_size=BATCH, msssim_scales=SCALES,
                       **{"warmup_steps": 2, **train})
    cfg.world_size = WORLD
    cfg.model.encoder = encoder
    seed_everything(cfg.train.seed)
    return build_pipeline(make_plan(cfg))


def _reference(eval_mode=False, micro=1, encoder="resnet34"):
    """Unsplit model on one process, the global batch, optionally micro-batch accumulation."""
    from memstudy.models import build_unet
    from memstudy.network import ModelConfig
    from memstudy.quality import MSSSIMLoss

    model = build_unet(seed=0, network=ModelConfig(encoder=encoder))
    loss_fn = MSSSIMLoss(SCALES)
    model.train(not eval_mode)
    x, y = _batch()
    outs = []
    for xs, ys in zip(x.chunk(micro), y.chunk(micro)):
        out = model(xs)
        (loss_fn(out, ys) / micro).backward()
        outs.append(out.detach())
    return model, torch.cat(outs)


def _grads(named_params):
    return {n: p.grad.detach().clone() for n, p in named_params if p.grad is not None}


def _close(got: dict, ref: dict, prefix_map=lambda n: n, atol=1e-5):
    """Largest abs difference over parameters present in `got` (matched by name in `ref`)."""
    diffs = [(g - ref[prefix_map(n)]).abs().max().item() for n, g in got.items()]
    return len(diffs), max(diffs)


def _unet_name(name: str) -> str:
    """A half's parameter name -> the unsplit UNet's."""
    return "net." + (name.replace("head.", "segmentation_head.", 1) if name.startswith("head.")
                     else name)


def scenario_ddp(r):
    build = _build(["dp"])
    build.model.eval()  # BN on running statistics: samples independent, so the split is exact
    x, y = _batch()
    build.runtime.loss_fn(build.model(x[r::WORLD]), y[r::WORLD]).backward()
    ref, _ = _reference(eval_mode=True)
    got = {n.removeprefix("module."): g for n, g in _grads(build.model.named_parameters()).items()}
    return {"n": len(got), "diff": _close(got, _grads(ref.named_parameters()))[1],
            "per_rank_batch": build.runtime.batch_size, "shard": build.runtime.shard}


def _state_bytes(opt) -> int:
    from memstudy.meters.tensor import local_tensor

    return sum(local_tensor(v).numel() * local_tensor(v).element_size()
               for s in opt.state.values() for v in s.values()
               if isinstance(v, torch.Tensor) and v.dim() > 0)


def _one_step(build):
    x, y = _batch()
    r, n = build.runtime.shard
    opt = build.runtime.optimizer_factory(build.model)
    build.runtime.loss_fn(build.model(x[r::n]), y[r::n]).backward()
    opt.step()
    return opt


def scenario_sharded(r):
    from memstudy.models import build_unet

    full = sum(p.numel() * 4 for p in build_unet(seed=0).parameters()) * 2  # Adam: two moments
    out = {"full": full}
    for name in ("dp,zero", "fsdp:full", "fsdp:grad_op"):
        opt = _one_step(_build(name.split(",")))
        out[name] = _state_bytes(opt)
    return out


def scenario_mp(r, encoder="resnet34"):
    build = _build(["mp"], encoder)
    x, y = _batch()
    loss = build.runtime.forward(build.model, x, y)
    build.runtime.backward(loss)
    ref, ref_out = _reference(encoder=encoder)
    ref_grads = _grads(ref.named_parameters())
    part = "encoder" if r == 0 else "decoder"
    got = {n: g for n, g in _grads(build.model.part.named_parameters()).items()}
    count, diff = _close(got, ref_grads, _unet_name)
    from memstudy.quality import MSSSIMLoss

    return {"part": part, "n": count, "diff": diff, "loss": loss.item(),
            "ref_loss": MSSSIMLoss(SCALES)(ref_out, y).item()}


def scenario_mp_bottleneck(r):
    """The same split of a ResNet-50 U-Net (Bottlenecks, 2048 deepest channels)."""
    return scenario_mp(r, "resnet50")


def scenario_pipeline(r):
    build = _build(["pipeline:micro_batches=2:schedule=gpipe"])
    x, y = _batch()
    loss = build.runtime.forward_backward(build.model, x, y)
    ref, ref_out = _reference(micro=2)
    ref_grads = _grads(ref.named_parameters())
    got = _grads(build.model.part.named_parameters())
    count, diff = _close(got, ref_grads, _unet_name)
    from memstudy.quality import MSSSIMLoss

    ref_loss = sum(MSSSIMLoss(SCALES)(o, t) for o, t in zip(ref_out.chunk(2), y.chunk(2))) / 2
    return {"n": count, "diff": diff, "loss": loss.item(), "ref_loss": ref_loss.item()}


def scenario_mp_training(r):
    """The real loop (train + validate) under mp with a cosine schedule, through execute()."""
    from memstudy.runner import execute

    cfg = small_config(SIZE, ["mp:scheduler=cosine"], batch_size=BATCH, max_steps=3,
                       warmup_steps=1, measure_steps=1, msssim_scales=SCALES)
    cfg.data.train_images = 6
    cfg.world_size = WORLD
    rec = execute(cfg, None)
    return {"status": rec.status, "error": rec.error, "epochs": rec.epochs,
            "series": rec.series, "metrics": rec.metrics if r == 0 else None}


COMPOSITIONS = ["dp,zero,invertible", "mp,invertible,checkpoint", "pipeline,checkpoint",
                "fsdp,checkpoint"]


def scenario_compositions(r):
    """Study combinations (and fsdp) run a measured step through execute() on both ranks."""
    from memstudy.runner import execute

    out = {}
    for techniques in COMPOSITIONS:
        warm = 2 if "dp" in techniques else 0  # dp refuses to measure before step 3
        # fsdp validates: the tiled validation walk would bypass its per-block gathering
        # (2 x H200, 2026-11-23: "got mixed torch.Tensor and DTensor")
        cfg = small_config(SIZE, techniques.split(","), batch_size=BATCH, max_steps=warm + 1,
                           warmup_steps=warm, measure_steps=1, validate="fsdp" in techniques,
                           msssim_scales=SCALES)
        cfg.world_size = WORLD
        cfg.data.train_images = BATCH * (warm + 1)  # enough for the warm-up and one measured step
        rec = execute(cfg, None)
        measured = any(phase in ("forward", "forward_backward") for _, phase, *_ in rec.metrics)
        out[techniques] = (rec.status, rec.error, measured)
    return out


# compile with the distributed techniques it composes with: the same run with and without it
# (aot_eager: the captured graphs without kernel generation, which would take minutes here),
# each for the fewest steps that show its behaviour. fsdp: the warm-up step compiles, then a
# measured and an unmeasured step (a recompilation in either stops the run). daso: one warm-up
# (blocking) step, cycling steps with a global send and its merge, and one cool-down.
COMPILED = {"fsdp": 3, "daso:node_size=1:warmup=1:cooldown=1:B=2": 5}
# On the ResNet-18 U-Net: the same stages, FSDP units and graphs (15 with fsdp, 1 with daso) as
# the study's ResNet-34 one, with 8 residual blocks instead of 16 for Dynamo to trace and 14.3M
# parameters instead of 24.4M for gloo to move.
COMPILED_ENCODER = "resnet18"


def scenario_compiled(r):
    """Per-step losses of each set in COMPILED, eager and compiled, through execute()."""
    from memstudy.runner import execute
    from memstudy.techniques.compile import compiled_graphs

    out = {}
    for techniques, steps in COMPILED.items():
        for extra in ([], ["compile:backend=aot_eager"]):
            cfg = small_config(SIZE, [*techniques.split(","), *extra], batch_size=BATCH,
                               max_steps=steps, warmup_steps=1, measure_steps=1,
                               validate=False, msssim_scales=SCALES)
            cfg.world_size, cfg.meter.tensor = WORLD, "off"  # compile refuses the tensor meter
            cfg.model.encoder = COMPILED_ENCODER
            cfg.data.train_images = BATCH * steps
            graphs = compiled_graphs()
            rec = execute(cfg, None)
            losses = [v for rank, _, n, v in rec.series if n == "loss" and rank == r]
            out[(techniques, bool(extra))] = (rec.status, rec.error, losses,
                                              compiled_graphs() - graphs)
    return out


SCENARIOS = [scenario_ddp, scenario_sharded, scenario_mp, scenario_mp_bottleneck, scenario_pipeline,
             scenario_mp_training,
             scenario_compositions, scenario_compiled]
if os.environ.get("DIST_SCENARIOS"):  # development: run a subset
    SCENARIOS = [s for s in SCENARIOS if s.__name__ in os.environ["DIST_SCENARIOS"].split(",")]


def _worker(r, port, out_dir):
    from memstudy.distributed.records import set_object_group

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r),
                      WORLD_SIZE=str(WORLD), LOCAL_RANK=str(r))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=int(os.environ.get("DIST_TEST_TIMEOUT", "120"))))
    set_object_group(dist.new_group(backend="gloo"))
    # Every run through execute() ends in a gc.collect(), which would walk the ~400k objects of
    # the imports each time (0.27 s a run): imported and frozen out of the collector here.
    import gc

    import memstudy.runner  # noqa: F401

    gc.freeze()
    results = {}
    for scenario in SCENARIOS:
        try:
            results[scenario.__name__] = scenario(r)
        except Exception:  # reported by the test that reads it
            import traceback
            results[scenario.__name__] = {"exception": traceback.format_exc()}
            print(f"rank {r} {scenario.__name__}: {results[scenario.__name__]}", flush=True)
        dist.barrier()
    with open(os.path.join(out_dir, f"rank{r}.pkl"), "wb") as fh:
        pickle.dump(results, fh)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(_worker, args=(port, str(out)), nprocs=WORLD, join=True)
    results = []
    for r in range(WORLD):
        with open(out / f"rank{r}.pkl", "rb") as fh:
            results.append(pickle.load(fh))
    return results


def _get(ranks, name):
    for res in ranks:
        assert "exception" not in res[name], res[name].get("exception")
    return [res[name] for res in ranks]


def test_ddp_gradients_equal_single_process(ranks):
    for r, res in enumerate(_get(ranks, "scenario_ddp")):
        assert res["per_rank_batch"] == BATCH // WORLD and res["shard"] == (r, WORLD)
        assert res["n"] > 100 and res["diff"] < 1e-5, res


def test_zero_and_fsdp_hold_half_the_optimizer_state(ranks):
    found = _get(ranks, "scenario_sharded")
    full = found[0]["full"]
    for name in ("dp,zero", "fsdp:full", "fsdp:grad_op"):
        per_rank = [f[name] for f in found]
        assert all(0.35 * full < b < 0.65 * full for b in per_rank), (name, per_rank, full)
        assert sum(per_rank) == pytest.approx(full, rel=0.02), (name, per_rank, full)


@pytest.mark.parametrize("scenario", ["scenario_mp", "scenario_mp_bottleneck"])
def test_model_parallel_split_equals_unsplit(ranks, scenario):
    found = _get(ranks, scenario)
    assert [f["part"] for f in found] == ["encoder", "decoder"]
    for f in found:
        assert f["n"] > 20 and f["diff"] < 1e-5, f
        assert f["loss"] == pytest.approx(f["ref_loss"], abs=1e-6)


def test_pipeline_equals_unsplit_micro_batched(ranks):
    found = _get(ranks, "scenario_pipeline")
    for f in found:
        assert f["n"] > 20 and f["diff"] < 1e-5, f
    assert found[0]["loss"] == found[1]["loss"]
    assert found[1]["loss"] == pytest.approx(found[1]["ref_loss"], abs=1e-6)


def test_mp_trains_with_a_scheduler_and_records_every_rank(ranks):
    from memstudy.distributed import RANK_MAX, RANK_MEAN

    found = _get(ranks, "scenario_mp_training")
    rec = found[0]
    assert rec["status"] == "ok", rec["error"]
    assert {e["rank"] for e in rec["epochs"]} == {0, 1}
    assert all(e["val_loss"] is not None for e in rec["epochs"])
    lrs = {r: [v for rr, s, n, v in rec["series"] if n == "lr" and rr == r] for r in (0, 1)}
    assert len(lrs[0]) == 3 and lrs[0] == lrs[1] and lrs[0][0] > lrs[0][1] > lrs[0][2] >= 0
    losses = {r: [v for rr, s, n, v in rec["series"] if n == "loss" and rr == r] for r in (0, 1)}
    assert losses[0] == losses[1]  # both ranks log the loss rank 1 computed
    rows = {(rank, phase, name): v for rank, phase, name, v in rec["metrics"]}
    for phase in ("forward", "backward", "step"):
        t0, t1 = rows[(0, phase, "time_s")], rows[(1, phase, "time_s")]
        assert rows[(RANK_MEAN, phase, "time_s")] == pytest.approx((t0 + t1) / 2)
        assert rows[(RANK_MAX, phase, "time_s")] == max(t0, t1)


def test_study_combinations_train_on_two_ranks(ranks):
    for found in _get(ranks, "scenario_compositions"):
        for techniques in COMPOSITIONS:
            assert found[techniques] == ("ok", None, True), (techniques, found[techniques])


@pytest.mark.parametrize("techniques", COMPILED)
def test_compile_trains_with_distributed_techniques_as_eager_does(ranks, techniques):
    """fsdp: one graph per FSDP unit (its hooks stay eager); daso: its averaging is outside
    the graph. Same losses at every step, on both ranks, as the eager run."""
    for found in _get(ranks, "scenario_compiled"):
        (status, error, eager, _), (c_status, c_error, compiled, graphs) = (
            found[(techniques, False)], found[(techniques, True)])
        assert status == c_status == "ok", (error, c_error)
        assert len(eager) == COMPILED[techniques] and graphs > 0, (eager, graphs)
        assert compiled == pytest.approx(eager, rel=1e-5)
