"""A tiny network run through memstudy's real runner and training loop, for the accumulation and
training-policy tests: the U-Net takes seconds per CPU step, this net milliseconds, and it has
no BatchNorm unless asked (accumulation equals the larger batch only without per-batch BN)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

SIZE = 32  # px; MS-SSIM with one scale (plain SSIM) needs 11


class TinyNet(nn.Module):
    def __init__(self, batchnorm: bool):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, padding=1)
        self.norm = nn.BatchNorm2d(4) if batchnorm else nn.Identity()
        self.conv2 = nn.Conv2d(4, 1, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.conv2(torch.relu(self.norm(self.conv1(x)))))


@dataclass
class Captured:
    grads: list[list[torch.Tensor]] = field(default_factory=list)  # per optimizer step
    lrs: list[float] = field(default_factory=list)  # lr each optimizer step ran with
    # (step, micro-batch index, every .grad flattened) after each micro-batch's backward
    sums: list[tuple[int, int, torch.Tensor]] = field(default_factory=list)


def run_tiny(monkeypatch, techniques: list[str], batch: int, steps: int, batchnorm: bool = False,
             images: int = 8, **train):
    """execute() on the tiny net; returns (record, Captured) with each step's gradients as the
    optimizer sees them (after clipping, if on) and the lr it used."""
    from conftest import small_config
    from memstudy.runner import execute
    from memstudy.techniques import compose

    seen = Captured()
    monkeypatch.setattr(compose, "build_model", lambda config: _seeded(config.train.seed, batchnorm))
    plain = compose.default_optimizer

    def optimizer(config):
        factory = plain(config)

        def make(model):
            opt = factory(model)
            opt.register_step_pre_hook(lambda o, a, k: _capture(o, seen))
            return opt
        return make

    monkeypatch.setattr(compose, "default_optimizer", optimizer)
    install = compose.policy.install

    def install_and_watch(build):
        install(build)
        params = list(build.model.parameters())
        build.runtime.micro_batch_hooks.append(lambda micro: seen.sums.append(
            (micro.step, micro.index, torch.cat([p.grad.reshape(-1) for p in params]).clone())))

    monkeypatch.setattr(compose.policy, "install", install_and_watch)
    cfg = small_config(size=SIZE, techniques=techniques, batch_size=batch, msssim_scales=1,
                       warmup_steps=0, measure_steps=1, max_steps=steps, optimizer="sgd",
                       validate=False)
    cfg.data.train_images = images
    for key, value in train.items():
        setattr(cfg.train, key, value)
    return execute(cfg, None), seen


def _seeded(seed: int, batchnorm: bool) -> TinyNet:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return TinyNet(batchnorm)


def _capture(opt: torch.optim.Optimizer, seen: Captured) -> None:
    params = [p for g in opt.param_groups for p in g["params"]]
    seen.grads.append([p.grad.detach().clone() for p in params])
    seen.lrs.append(opt.param_groups[0]["lr"])


def series(record, name: str) -> dict[int, float]:
    return {step: value for _, step, n, value in record.series if n == name}
