"""Data for the study: synthetic radiograph phantoms (and masks of what they draw), a folder /
DICOM loader (image / target or image / mask pairs), and the conventional contrast enhancement
that makes reference targets. See docs/data.md and docs/segmentation.md."""
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
    MASK_SUFFIXES,
    SUPPORTED_SUFFIXES,
    ImageError,
    ImagePair,
    list_images,
    list_mask_pairs,
    list_pairs,
    load_image,
    load_mask,
)
from memstudy.datasets.phantom import (GENERATOR_VERSION, PhantomLayers, make_mask, make_phantom,
                                       phantom_layers)

__all__ = [
    "GENERATOR_VERSION",
    "MASK_SUFFIXES",
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
    "list_mask_pairs",
    "list_pairs",
    "load_image",
    "load_mask",
    "make_mask",
    "make_phantom",
    "phantom_layers",
    "resize_square",
    "resize_to",
]
