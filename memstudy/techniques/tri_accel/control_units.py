"""The "layers" Tri-Accel controls on the U-Net: 11 units of one or more modules.

A unit is the granularity of precision, curvature and learning rate: the stem (conv1 + bn1 +
relu), the four residual stages of the encoder, the five decoder blocks and the segmentation
head; on a user's own network (model.factory), its top-level modules.
Per-convolution units (~70) would give finer precision control but make the curvature estimate
~6x dearer (one set of Hessian-vector products per unit, each as dear as a double backward)
and the per-layer statistics noisier; per-stage units follow the resolution levels, which is
where activation memory and gradient scale differ most. docs/triaccel.md discusses the choice.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from memstudy.errors import ConfigError
from memstudy.models import top_level_modules


@dataclass
class Unit:
    name: str
    modules: list[nn.Module]  # modules whose forward runs in the unit's precision

    def parameters(self) -> list[nn.Parameter]:
        seen: dict[int, nn.Parameter] = {}
        for m in self.modules:
            for p in m.parameters():
                if p.requires_grad:
                    seen.setdefault(id(p), p)
        return list(seen.values())


def unet_units(model: nn.Module) -> list[Unit]:
    """The control units of a UNet (as built, or after block-level techniques)."""
    needed = ("encoder", "residual_stages", "residual_stage_names", "decoder_blocks", "head")
    if hasattr(model, "module") or hasattr(model, "_orig_mod"):
        raise ConfigError(f"tri_accel needs the network's own modules, but the model is a "
                          f"{type(model).__name__}; drop the technique that wraps the whole model")
    if all(hasattr(model, a) for a in needed):
        units = _unet_units(model)
    else:  # a user's own network (model.factory): its top-level modules
        units = [Unit(name, [child]) for name, child in top_level_modules(model)]
    covered = {id(p) for u in units for p in u.parameters()}
    missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in covered]
    if missing:
        raise ConfigError(f"tri_accel: parameters outside every control unit: {missing[:4]}")
    return units


def _unet_units(model: nn.Module) -> list[Unit]:
    enc = model.encoder
    units = [Unit("stem", [enc.conv1, enc.bn1, enc.relu])]
    units += [Unit(f"encoder.{n}", [s]) for n, s in zip(model.residual_stage_names, model.residual_stages)]
    units += [Unit(f"decoder.{i}", [b]) for i, b in enumerate(model.decoder_blocks)]
    units.append(Unit("head", [model.head]))
    return units
