"""A user's own network: `model.factory = "package.module:function"` with `model.kwargs`.

Any `nn.Module` that maps N x C x H x W images to N x classes x H x W. memstudy knows nothing
of its structure, so the techniques that act per block of the U-Net (tile, mp, invertible,
pipeline, ...) refuse it (`Technique.needs_unet`), and those that act on modules, tensors or
the step compose with it. `check_factory` imports it and runs it on the meta device (no
memory, no compute) at the run's image size, so an import error, a non-module or a wrong
output shape is one line before anything is built.
"""
from __future__ import annotations

import importlib
from typing import Callable

import torch
from torch import nn

from memstudy.errors import ConfigError
from memstudy.network import ModelConfig


def load_factory(network: ModelConfig) -> Callable[..., nn.Module]:
    module_name, _, function = network.factory.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any failure to import is the same user error
        raise ConfigError(f"model.factory = {network.factory!r}: cannot import {module_name!r} "
                          f"({type(exc).__name__}: {exc}); check the module is on PYTHONPATH"
                          ) from None
    factory = getattr(module, function, None)
    if not callable(factory):
        raise ConfigError(f"model.factory = {network.factory!r}: {module_name} has no function "
                          f"{function!r}")
    return factory


def call_factory(network: ModelConfig) -> nn.Module:
    factory = load_factory(network)
    try:
        model = factory(**network.kwargs)
    except Exception as exc:  # noqa: BLE001 - the user's code: its error, named, in one line
        raise ConfigError(f"model.factory = {network.factory!r} failed with model.kwargs = "
                          f"{network.kwargs}: {type(exc).__name__}: {exc}") from None
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model.factory = {network.factory!r} returned a "
                          f"{type(model).__name__}, not a torch.nn.Module")
    return model


def check_factory(network: ModelConfig, batch: int, height: int, width: int) -> None:
    """Build the user's network on the meta device and run it once at the run's shape."""
    with torch.device("meta"):
        model = call_factory(network)
        x = torch.empty(batch, network.in_channels, height, width)
        try:
            out = model(x)
        except Exception as exc:  # noqa: BLE001 - the user's forward, named in one line
            raise ConfigError(f"model.factory = {network.factory!r}: its forward fails on a "
                              f"{tuple(x.shape)} input: {type(exc).__name__}: {exc}") from None
    expected = (batch, network.classes, height, width)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != expected:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ConfigError(f"model.factory = {network.factory!r} returns {got} for a "
                          f"{tuple(x.shape)} input; memstudy needs N x model.classes x H x W = "
                          f"{expected}")


def build_factory_model(network: ModelConfig, seed: int) -> nn.Module:
    """The user's network, initialised from `seed` like the U-Net."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return call_factory(network)


def top_level_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The network's direct children that hold parameters, by name: the units that techniques
    acting per module (checkpoint:placement=modules, fsdp, tri_accel) use on a network whose
    structure memstudy does not know."""
    return [(name, child) for name, child in model.named_children()
            if any(True for _ in child.parameters())]
