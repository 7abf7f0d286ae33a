"""Networks of the study. Models contain no technique code."""
from memstudy.models.unet import ContrastUNet, build_unet, load_encoder_weights

__all__ = ["ContrastUNet", "build_unet", "load_encoder_weights"]
