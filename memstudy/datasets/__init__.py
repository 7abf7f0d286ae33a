"""Data for the study: synthetic radiograph phantoms, a folder / DICOM loader, and the
conventional contrast enhancement that makes reference targets. See docs/data.md."""
from memstudy.datasets.dataset import (
    DataConfig,
    FileSource,
    PhantomSource,
    RadiographDataset,
    as_hw,
    build_datasets,
    describe_datasets,
    resize_square,
    resize_to,
)
from memstudy.datasets.enhance import EnhanceParams, enhance_contrast
from memstudy.datasets.folder import (
    SUPPORTED_SUFFIXES,
    ImageError,
    ImagePair,
    list_images,
    list_pairs,
    load_image,
)
from memstudy.datasets.phantom import GENERATOR_VERSION, PhantomLayers, make_phantom, phantom_layers

__all__ = [
    "GENERATOR_VERSION",
    "SUPPORTED_SUFFIXES",
    "DataConfig",
    "EnhanceParams",
    "FileSource",
    "ImageError",
    "ImagePair",
    "PhantomLayers",
    "PhantomSource",
    "RadiographDataset",
    "as_hw",
    "build_datasets",
    "describe_datasets",
    "enhance_contrast",
    "list_images",
    "list_pairs",
    "load_image",
    "make_phantom",
    "phantom_layers",
    "resize_square",
    "resize_to",
]
