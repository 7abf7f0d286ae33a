"""Networks of the study. Models contain no technique code."""
from __future__ import annotations

from torch import nn

from memstudy.models.factory import build_factory_model, check_factory, top_level_modules
from memstudy.models.unet import UNet, build_unet, load_encoder_weights

__all__ = ["UNet", "build_model", "build_unet", "check_factory", "load_encoder_weights",
           "top_level_modules"]


def build_model(config, weights: bool = True) -> nn.Module:
    """The run's network (`config.model`, for `config.train.task`), initialised from the seed;
    `weights=False` leaves out the encoder's weights file (sizes only)."""
    network, seed = config.model, config.train.seed
    if network.factory:
        return build_factory_model(network, seed)
    return build_unet(config.encoder_weights if weights else None, seed=seed, network=network,
                      task=config.train.task)
