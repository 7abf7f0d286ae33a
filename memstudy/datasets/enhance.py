"""Conventional contrast enhancement: the algorithm that makes the reference targets.

The study's references "were obtained using conventional algorithms"; the network learns to
reproduce them. Here that algorithm is CLAHE followed by multiscale unsharp masking, the usual
pair in radiograph post-processing: CLAHE spreads the few grey levels that soft tissue occupies
over the display range tile by tile, unsharp masking then lifts detail at a few scales.

Every parameter is relative to the image, so a target made at 512 px is a downscaled version of
the one made at 4188 px rather than a different image: the CLAHE grid is counted in tiles per
side, the unsharp-mask sigmas are fractions of the image side, and CLAHE histograms always have
`histogram_bins` levels. (OpenCV's 16-bit CLAHE uses 65536 bins and derives its clip from the
mean count per bin; on a small tile that would mean almost every bin holds 0 or 1 pixels, so the
image is quantised to `histogram_bins` levels and the clip limit rescaled accordingly: the
`clip_limit` keeps its familiar meaning, a multiple of the mean count per used bin.)
Large Gaussian blurs run on a reduced copy, which keeps a 4188 px target under a second.
"""
from __future__ import annotations

from dataclasses import dataclass

import cv2
import numpy as np

_DIRECT_SIGMA = 4.0  # blur directly up to this sigma (px); larger ones on a reduced copy
_PERCENTILE_SAMPLES = 1_000_000  # percentiles are estimated on a regular subsample this big


@dataclass(frozen=True)
class EnhanceParams:
    """Parameters of `enhance_contrast`; the defaults make every reference target."""
    clip_limit: float = 2.0  # CLAHE clip, multiple of the mean pixel count per histogram bin
    tiles: int = 8  # CLAHE tiles per image side (8 x 8 grid at any resolution)
    histogram_bins: int = 4096  # grey levels in each CLAHE tile histogram
    sigmas: tuple[float, ...] = (0.002, 0.01, 0.04)  # unsharp-mask Gaussian sigmas / image side
    gains: tuple[float, ...] = (0.6, 0.5, 0.4)  # detail gain at each sigma
    percentiles: tuple[float, float] = (0.5, 99.5)  # output range mapped to [0, 1], then clipped

    def __post_init__(self) -> None:
        low, high = self.percentiles
        checks = [
            (self.clip_limit >= 0, "clip_limit must be >= 0 (0 = no clipping)", self.clip_limit),
            (1 <= self.tiles <= 64, "tiles must be 1..64 tiles per side", self.tiles),
            (16 <= self.histogram_bins <= 65536, "histogram_bins must be 16..65536",
             self.histogram_bins),
            (len(self.sigmas) == len(self.gains), "sigmas and gains must have the same length",
             (self.sigmas, self.gains)),
            (all(0 < s < 1 for s in self.sigmas), "sigmas must be fractions of the side in (0, 1)",
             self.sigmas),
            (0 <= low < high <= 100, "percentiles must satisfy 0 <= low < high <= 100",
             self.percentiles),
        ]
        for ok, rule, value in checks:
            if not ok:
                raise ValueError(f"EnhanceParams.{rule}, got {value}")


def to_unit_float(image: np.ndarray) -> np.ndarray:
    """uint8 / uint16 scaled by their full range, floats checked to lie in [0, 1]; float32 out."""
    image = np.asarray(image)
    if image.ndim != 2:
        raise ValueError(f"expected a 2-D grey image, got an array of shape {image.shape}")
    if image.size == 0:
        raise ValueError(f"expected a non-empty image, got shape {image.shape}")
    if image.dtype == np.uint8:
        return image.astype(np.float32) / np.float32(255)
    if image.dtype == np.uint16:
        return image.astype(np.float32) / np.float32(65535)
    if np.issubdtype(image.dtype, np.floating):
        low, high = float(image.min()), float(image.max())
        if not (np.isfinite(low) and np.isfinite(high)) or low < -1e-6 or high > 1 + 1e-6:
            raise ValueError(f"float images must lie in [0, 1] (got min {low}, max {high})")
        return np.clip(image, 0, 1).astype(np.float32, copy=False)
    raise ValueError(f"unsupported image dtype {image.dtype}; use uint8, uint16 or float in [0, 1]")


def gaussian_blur(image: np.ndarray, sigma: float) -> np.ndarray:
    """Gaussian blur, reflecting borders; large sigmas on a reduced copy (within 3 % of peak)."""
    if sigma <= _DIRECT_SIGMA:
        return cv2.GaussianBlur(image, (0, 0), sigma, borderType=cv2.BORDER_REFLECT)
    h, w = image.shape
    factor = sigma / (_DIRECT_SIGMA - 1)
    small = cv2.resize(image, (max(1, round(w / factor)), max(1, round(h / factor))),
                       interpolation=cv2.INTER_AREA)
    fx, fy = w / small.shape[1], h / small.shape[0]
    # area averaging and linear upsampling blur by about factor / 2 themselves: subtract it
    inner = np.sqrt(max(sigma**2 - (max(fx, fy) / 2) ** 2, 0.25))
    small = cv2.GaussianBlur(small, (0, 0), inner / fx, sigmaY=inner / fy,
                             borderType=cv2.BORDER_REFLECT)
    return cv2.resize(small, (w, h), interpolation=cv2.INTER_LINEAR)


def _clahe(image: np.ndarray, params: EnhanceParams) -> np.ndarray:
    low, high = float(image.min()), float(image.max())
    bins = params.histogram_bins
    levels = np.rint((image - low) * np.float32((bins - 1) / (high - low)))
    quantised = (levels * np.float32(65535 / (bins - 1))).round().astype(np.uint16)
    # OpenCV clips at clipLimit * pixels per tile / 65536 for 16-bit input: rescale to `bins`
    clahe = cv2.createCLAHE(clipLimit=params.clip_limit * 65536 / bins,
                            tileGridSize=(params.tiles, params.tiles))
    return clahe.apply(quantised).astype(np.float32) / np.float32(65535)


def _unsharp(image: np.ndarray, params: EnhanceParams) -> np.ndarray:
    out = image.copy()
    side = max(image.shape)
    for sigma, gain in zip(params.sigmas, params.gains):
        detail = image - gaussian_blur(image, sigma * side)
        out += np.float32(gain) * detail
    return out


def _stretch(image: np.ndarray, percentiles: tuple[float, float]) -> np.ndarray:
    sample = image.ravel()[:: max(1, image.size // _PERCENTILE_SAMPLES)]
    low, high = np.percentile(sample, percentiles)
    if high <= low:
        return np.zeros_like(image)
    out = (image - np.float32(low)) * np.float32(1 / (high - low))
    return np.clip(out, 0, 1, out=out)


def enhance_contrast(image: np.ndarray, params: EnhanceParams | None = None) -> np.ndarray:
    """CLAHE, then multiscale unsharp masking, then percentile stretch: float32 in [0, 1].

    `image`: 2-D uint8, uint16 or float in [0, 1]. A constant image has no contrast to
    enhance and gives zeros.
    """
    params = params or EnhanceParams()
    unit = to_unit_float(image)
    if float(unit.max()) <= float(unit.min()):
        return np.zeros(unit.shape, np.float32)
    return _stretch(_unsharp(_clahe(unit, params), params), params.percentiles)
