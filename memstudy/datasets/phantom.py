"""Synthetic radiograph phantoms: deterministic, any size, low soft-tissue contrast, fast.

Why a phantom: the study trained on 60 animal radiographs of up to 4188 x 4188 px that are not
public. A memory study needs data that (1) is identical for every grid cell (deterministic from
`(seed, index)`), (2) shows the same anatomy at every resolution, so 512 px and 4188 px runs
compare like with like, (3) keeps soft-tissue contrast low, so contrast enhancement is a real
task at every size, and (4) is cheap: 60 images at 4188 px must not dominate a run.

How: all random choices are drawn first, in normalised body coordinates and independent of the
size (`_sample_anatomy`); only then is the anatomy rasterised. Smooth soft tissue (torso with a
fat layer, lungs, heart, liver, kidneys, gas, limbs) is an analytic sum of projected ellipsoids
and capsules on a grid of at most 1024 px, upsampled; bones and lung vessels are drawn at full
resolution with anti-aliased, sub-pixel (fixed-point) cv2 strokes. The detector turns the line
integral mu into photons, I = I0 * heel * exp(-mu) + scatter, adds signal-dependent quantum
noise whose photon count per pixel scales with the pixel area (as if binned from a 4188 px
detector), and writes the log signal as 16 bits. Output convention: higher value = more
attenuation, as radiographs are displayed (bone bright, air dark).
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

import cv2
import numpy as np

from memstudy.config import PHANTOM_CLASSES

GENERATOR_VERSION = 1  # bump whenever the output changes: it keys the on-disk caches
NATIVE_SIZE = 4188  # the study's largest radiograph side; noise is defined at this pixel size
MIN_SIZE = 32
_SMOOTH_GRID = 1024  # smooth soft tissue is evaluated on at most this many px per side
_SHIFT = 4  # fixed-point bits of cv2 drawing coordinates (1/16 px)
_MARROW = 0.45  # marrow / cortical attenuation: bones show a dense cortical shell
_PHOTONS_NATIVE = 20000.0  # unattenuated photons per native (1/4188 of the side) pixel
_OFFSET, _GAIN = 0.5, 12000.0  # 16-bit value = (line integral + offset) * gain


@dataclass(frozen=True)
class Pose:
    """Body frame -> normalised image frame ([-1, 1], y down): rotate, scale, shift."""
    cx: float
    cy: float
    angle: float  # degrees, clockwise on screen
    scale: float

    def to_image(self, u, v):
        c, s = math.cos(math.radians(self.angle)), math.sin(math.radians(self.angle))
        return self.cx + self.scale * (u * c - v * s), self.cy + self.scale * (u * s + v * c)

    def to_body(self, x, y):  # python-float coefficients keep float32 grids float32
        c, s = math.cos(math.radians(self.angle)), math.sin(math.radians(self.angle))
        dx, dy = x - self.cx, y - self.cy
        return (dx * c + dy * s) / self.scale, (-dx * s + dy * c) / self.scale


@dataclass
class _Anatomy:
    pose: Pose
    torso: tuple  # (cu, cv, a, b, angle, peak) of the projected torso ellipsoid
    clutter: np.ndarray  # 24 x 24 random field: slow soft-tissue texture
    ellipsoids: list = field(default_factory=list)  # (cu, cv, a, b, angle, peak)
    capsules: list = field(default_factory=list)  # (u0, v0, u1, v1, radius, peak): limbs
    bones: list = field(default_factory=list)  # (layer, kind, points, width); kind tube / blob
    vessels: list = field(default_factory=list)  # (points, width)
    lungs: list = field(default_factory=list)  # (cu, cv, a, b, angle) of each lung: masks
    heart: tuple = ()  # (cu, cv, a, b, angle): masks


@dataclass
class PhantomLayers:
    """Noise-free line integrals (float32, size x size); mu = soft + bone + vessels."""
    soft: np.ndarray
    bone: np.ndarray
    vessels: np.ndarray
    torso_peak: float  # largest soft-tissue line integral of the torso (for masks in tests)


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"phantom {name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"phantom {name} must be >= {minimum}, got {value}")
    return int(value)


def _ellipse_points(cu, cv, a, b, power=2.0, n=48):
    """Closed outline of an (super)ellipse in body coordinates; power 4 = rounded rectangle."""
    t = np.linspace(0, 2 * np.pi, n, endpoint=False)
    c, s = np.cos(t), np.sin(t)
    return np.stack([cu + a * np.sign(c) * np.abs(c) ** (2 / power),
                     cv + b * np.sign(s) * np.abs(s) ** (2 / power)], axis=1)


def _sample_anatomy(rng: np.random.Generator) -> _Anatomy:
    """Every random choice of one phantom, in body coordinates (no dependence on size)."""
    pose = Pose(*(float(x) for x in rng.uniform([-0.04, -0.04, -8, 0.92], [0.04, 0.04, 8, 1.02])))
    peak, ax, ay = (float(x) for x in rng.uniform([2.2, 0.50, 0.80], [2.8, 0.60, 0.87]))
    fat = rng.uniform(0.06, 0.12)  # fat layer thickness, fraction of the torso radius
    anat = _Anatomy(pose, (0.0, 0.04, ax, ay, 0.0, 0.88 * peak),
                    rng.standard_normal((24, 24)).astype(np.float32))
    e = anat.ellipsoids  # muscle (12 % denser than fat) inside the fat layer, then organs
    e.append((0.0, 0.04, ax * (1 - fat), ay * (1 - fat), 0.0, 0.12 * peak * (1 - fat)))
    lungs = []
    for side in (-1, 1):
        lung = (side * rng.uniform(0.20, 0.26), rng.uniform(-0.42, -0.32),
                rng.uniform(0.17, 0.22), rng.uniform(0.30, 0.38), side * rng.uniform(4, 14))
        lungs.append(lung)
        e.append(lung + (-rng.uniform(0.40, 0.55) * peak,))
    heart = (rng.uniform(-0.02, 0.08), rng.uniform(-0.18, -0.08), rng.uniform(0.17, 0.23),
             rng.uniform(0.20, 0.26), rng.uniform(15, 35), 0.32 * peak)
    e.append(heart)
    anat.lungs, anat.heart = lungs, heart[:5]
    e.append((rng.uniform(-0.05, 0.05), rng.uniform(0.12, 0.20), rng.uniform(0.38, 0.45),
              rng.uniform(0.14, 0.20), rng.uniform(-10, 10), 0.07 * peak))  # liver
    for side in (-1, 1):  # kidneys
        e.append((side * rng.uniform(0.16, 0.22), rng.uniform(0.38, 0.48), rng.uniform(0.06, 0.08),
                  rng.uniform(0.09, 0.11), side * rng.uniform(0, 20), 0.05 * peak))
    for _ in range(rng.integers(4, 10)):  # intestinal gas
        a = rng.uniform(0.02, 0.06)
        e.append((rng.uniform(-0.3, 0.3), rng.uniform(0.30, 0.72), a, a * rng.uniform(0.6, 1.4),
                  rng.uniform(0, 180), -0.12 * peak * a / 0.04))
    _add_skeleton(anat, rng, ax, ay)
    for lung in lungs:
        _add_vessels(anat, rng, lung)
    return anat


def _add_skeleton(anat: _Anatomy, rng: np.random.Generator, ax: float, ay: float) -> None:
    bones, n_vert = anat.bones, int(rng.integers(13, 19))
    half_w, curve, phase = rng.uniform(0.035, 0.045), rng.uniform(0, 0.025), rng.uniform(0, 6.3)
    spacing = 1.96 / n_vert
    for v in -0.98 + spacing * (np.arange(n_vert) + 0.5):  # vertebrae: body, processes
        u = curve * np.sin(2.2 * v + phase)
        bones.append((0, "blob", _ellipse_points(u, v, half_w, 0.4 * spacing, power=4), 0))
        bones.append((0, "blob", _ellipse_points(u, v, 0.3 * half_w, 0.3 * half_w), 0))
        for side in (-1, 1):
            pts = np.array([[u + side * half_w, v], [u + side * 1.9 * half_w, v - 0.1 * spacing]])
            bones.append((0, "tube", pts, 0.25 * spacing))
    rib_spacing, rise, width = rng.uniform([0.07, 0.45, 0.018], [0.085, 0.7, 0.024])
    t = np.radians(np.linspace(200, 400, 40))
    for i in range(int(rng.integers(9, 14))):  # ribs: arcs from the spine out and down the wall
        v0 = -0.74 + i * rib_spacing
        a = 0.5 * (0.88 * ax * np.sqrt(max(1 - ((v0 - 0.04) / ay) ** 2, 0.05)) - 0.03)
        b = a * rise * rng.uniform(0.9, 1.1)
        for side in (-1, 1):
            pts = np.stack([side * (0.03 + a + a * np.cos(t)), v0 + 0.34 * b + b * np.sin(t)], 1)
            bones.append((1, "tube", pts, width))
    tissue = anat.torso[5]  # neck and tail: soft tissue around the spine outside the torso
    anat.capsules.append((0.0, -0.7, 0.0, -1.2, rng.uniform(0.12, 0.16), 0.55 * tissue))
    anat.capsules.append((0.0, 0.8, 0.0, 1.2, rng.uniform(0.05, 0.07), 0.3 * tissue))
    for side in (-1, 1):  # pelvis, fore and hind limbs (soft tissue capsule + long bone)
        bones.append((1, "tube", np.array([[side * 0.05, 0.62], [side * 0.28, 0.80]]), 0.05))
        for start, end in (((0.32, -0.6), (rng.uniform(0.8, 0.95), rng.uniform(-1.15, -0.95))),
                           ((0.28, 0.80), (rng.uniform(0.5, 0.65), rng.uniform(1.05, 1.2)))):
            p0, p1 = np.array([side * start[0], start[1]]), np.array([side * end[0], end[1]])
            radius, depth = rng.uniform(0.08, 0.11), rng.uniform(0.5, 0.7)
            anat.capsules.append((*p0, *p1, radius, depth * tissue))
            w = rng.uniform(0.04, 0.05)
            shaft = np.stack([p0 + 0.05 * (p1 - p0), p1])
            bones.append((0, "tube", shaft, w))
            for end_pt in shaft:  # epiphyses: wider ends of the long bone
                bones.append((0, "blob", _ellipse_points(*end_pt, 0.7 * w, 0.7 * w), 0))


def _add_vessels(anat: _Anatomy, rng: np.random.Generator, lung: tuple) -> None:
    """Branching vessel trees rooted at the hilum, kept inside the lung ellipse."""
    cu, cv, a, b, angle = lung
    ca, sa = np.cos(np.radians(angle)), np.sin(np.radians(angle))

    def inside(p):
        du, dv = p[0] - cu, p[1] - cv
        return ((du * ca + dv * sa) / a) ** 2 + ((-du * sa + dv * ca) / b) ** 2 < 0.9

    def grow(p, direction, length, width, depth):
        end = p + length * np.array([np.cos(direction), np.sin(direction)])
        if depth == 0 or not inside(end):
            return
        anat.vessels.append((np.stack([p, end]), width))
        for turn in (-1, 1):
            grow(end, direction + turn * rng.uniform(0.25, 0.6), length * rng.uniform(0.65, 0.8),
                 width * 0.7, depth - 1)

    hilum = np.array([cu - np.sign(cu) * 0.55 * a, cv + 0.3 * b])
    for _ in range(rng.integers(3, 6)):
        target = np.array([cu + rng.uniform(-0.6, 0.6) * a, cv + rng.uniform(-0.8, 0.8) * b])
        d = target - hilum
        grow(hilum, np.arctan2(d[1], d[0]), 0.35 * max(a, b), 0.012, 5)


def _body_grid(n: int, pose: Pose, rows: slice, cols: slice):
    centres = (np.arange(n, dtype=np.float32) + 0.5) * (2.0 / n) - 1.0
    return pose.to_body(centres[None, cols], centres[rows, None])


def _box(n: int, pose: Pose, cu: float, cv: float, radius: float) -> tuple[slice, slice]:
    """Pixel rows/cols of an n x n grid that can hold a shape of this body-frame radius."""
    centre, r = np.array(pose.to_image(cu, cv)), radius * pose.scale
    lo = np.clip(np.floor((centre - r + 1) * n / 2) - 1, 0, n).astype(int)
    hi = np.clip(np.ceil((centre + r + 1) * n / 2) + 1, 0, n).astype(int)
    return slice(lo[1], hi[1]), slice(lo[0], hi[0])


def _add_ellipsoid(out: np.ndarray, pose: Pose, cu, cv, a, b, angle, peak) -> None:
    cu, cv, a, b, peak = float(cu), float(cv), float(a), float(b), float(peak)
    rows, cols = _box(out.shape[0], pose, cu, cv, max(a, b))
    u, v = _body_grid(out.shape[0], pose, rows, cols)
    ca, sa = math.cos(math.radians(angle)), math.sin(math.radians(angle))
    du, dv = u - cu, v - cv
    r2 = ((du * ca + dv * sa) / a) ** 2 + ((-du * sa + dv * ca) / b) ** 2
    out[rows, cols] += peak * np.sqrt(np.maximum(1 - r2, 0))  # path length through an ellipsoid


def _add_capsule(out: np.ndarray, pose: Pose, u0, v0, u1, v1, radius, peak) -> None:
    u0, v0, u1, v1, radius, peak = (float(x) for x in (u0, v0, u1, v1, radius, peak))
    mid, half = ((u0 + u1) / 2, (v0 + v1) / 2), np.hypot(u1 - u0, v1 - v0) / 2
    rows, cols = _box(out.shape[0], pose, *mid, half + radius)
    u, v = _body_grid(out.shape[0], pose, rows, cols)
    du, dv = u1 - u0, v1 - v0
    t = np.clip(((u - u0) * du + (v - v0) * dv) / (du * du + dv * dv), 0, 1)
    d2 = ((u - u0 - t * du) ** 2 + (v - v0 - t * dv) ** 2) / radius**2
    out[rows, cols] += peak * np.sqrt(np.maximum(1 - d2, 0))  # path length through a cylinder


def _soft_tissue(anat: _Anatomy, size: int) -> np.ndarray:
    n = min(size, _SMOOTH_GRID)
    torso = np.zeros((n, n), np.float32)
    _add_ellipsoid(torso, anat.pose, *anat.torso)
    clutter = cv2.resize(anat.clutter, (n, n), interpolation=cv2.INTER_CUBIC)
    soft = torso * (1 + 0.02 * clutter)  # slow texture, proportional to the tissue traversed
    for ell in anat.ellipsoids:
        _add_ellipsoid(soft, anat.pose, *ell)
    for cap in anat.capsules:
        _add_capsule(soft, anat.pose, *cap)
    np.maximum(soft, 0, out=soft)
    return soft if n == size else cv2.resize(soft, (size, size), interpolation=cv2.INTER_LINEAR)


def _stroke(pose: Pose, size: int, points: np.ndarray, width: float):
    """Fixed-point pixel points, integer thickness and an intensity factor for sub-pixel widths."""
    x, y = pose.to_image(points[:, 0], points[:, 1])
    px = np.stack([(x + 1) * size / 2 - 0.5, (y + 1) * size / 2 - 0.5], axis=1)
    thick = width * pose.scale * size / 2
    return np.rint(px * (1 << _SHIFT)).astype(np.int32), max(1, round(thick)), min(1.0, thick)


def _draw(canvas: np.ndarray, pose: Pose, kind: str, points, width: float, level: float,
          line: int = cv2.LINE_AA) -> None:
    """One bone or vessel; `line` cv2.LINE_8 with level 1 draws it whole (a mask)."""
    pts, thick, factor = _stroke(pose, canvas.shape[0], points, width)
    if line != cv2.LINE_AA:
        factor = 1.0  # a mask marks a thin stroke's pixel whole, not in proportion
    if kind == "blob":
        cv2.fillPoly(canvas, [pts], round(level * 255), line, _SHIFT)
    else:
        cv2.polylines(canvas, [pts], False, round(level * factor * 255), thick, line, _SHIFT)


def _bones(anat: _Anatomy, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Two bone layers (spine+limbs, ribs+pelvis) that add where they overlap, and vessels."""
    layers = [np.zeros((size, size), np.uint8) for _ in range(3)]
    for layer, kind, points, width in anat.bones:  # cortical shell, then marrow inside it
        _draw(layers[layer], anat.pose, kind, points, width, 1.0)
        centre = points.mean(axis=0)
        inner = centre + 0.6 * (points - centre) if kind == "blob" else points
        _draw(layers[layer], anat.pose, kind, inner, 0.45 * width, _MARROW)
    for points, width in anat.vessels:
        _draw(layers[2], anat.pose, "tube", points, width, width / 0.012)
    bone = cv2.addWeighted(layers[0], 0.9 / 255, layers[1], 0.7 / 255, 0, dtype=cv2.CV_32F)
    vessels = layers[2].astype(np.float32) * np.float32(0.12 / 255)
    sigma = 0.0004 * size  # detector unsharpness, resolution-independent; < 0.5 px: skip
    if sigma >= 0.5:
        bone = cv2.GaussianBlur(bone, (0, 0), sigma)
        vessels = cv2.GaussianBlur(vessels, (0, 0), sigma)
    return bone, vessels


def _detect(mu: np.ndarray, rng: np.random.Generator, size: int) -> np.ndarray:
    """Heel effect, scatter, quantum noise, log conversion to 16 bits."""
    grid = (np.arange(64, dtype=np.float32) + 0.5) / 32 - 1
    x, y = np.meshgrid(grid, grid)
    phi, heel_amp = rng.uniform(0, 2 * np.pi), rng.uniform(0.08, 0.15)
    heel = (1 + heel_amp * (x * np.cos(phi) + y * np.sin(phi)) / np.sqrt(2)) \
        * (1 - rng.uniform(0.03, 0.08) * (x * x + y * y) / 2)
    primary = np.exp(-cv2.resize(mu, (64, 64), interpolation=cv2.INTER_AREA))
    scatter = heel * rng.uniform(0.03, 0.08) * cv2.GaussianBlur(primary, (0, 0), 5.0)
    signal = np.exp(-mu)
    signal *= cv2.resize(heel.astype(np.float32), (size, size), interpolation=cv2.INTER_LINEAR)
    signal += cv2.resize(scatter.astype(np.float32), (size, size), interpolation=cv2.INTER_LINEAR)
    photons = _PHOTONS_NATIVE * (NATIVE_SIZE / size) ** 2  # binned native pixels
    noise = rng.standard_normal((size, size), dtype=np.float32)
    noise *= np.sqrt(signal * np.float32(1 / photons))
    signal += noise
    np.maximum(signal, 1e-5, out=signal)
    out = np.log(signal)
    out *= -_GAIN
    out += _OFFSET * _GAIN
    return np.clip(out, 0, 65535, out=out).round(out=out).astype(np.uint16)


def _layers(size: int, seed: int, index: int) -> tuple[PhantomLayers, np.random.Generator]:
    size = _check_int("size", size, MIN_SIZE)
    rng = np.random.default_rng((_check_int("seed", seed, 0), _check_int("index", index, 0)))
    anat = _sample_anatomy(rng)  # all anatomy draws first: the same at every size
    bone, vessels = _bones(anat, size)
    return PhantomLayers(_soft_tissue(anat, size), bone, vessels, anat.torso[5]), rng


def _height_width(size) -> tuple[int, int]:
    """An int side (square) or a (height, width) pair, each side >= MIN_SIZE."""
    if isinstance(size, tuple) and len(size) == 2:
        return _check_int("height", size[0], MIN_SIZE), _check_int("width", size[1], MIN_SIZE)
    side = _check_int("size", size, MIN_SIZE)
    return side, side


def _centre_crop(image: np.ndarray, height: int, width: int) -> np.ndarray:
    top, left = (image.shape[0] - height) // 2, (image.shape[1] - width) // 2
    return np.ascontiguousarray(image[top:top + height, left:left + width])


def phantom_layers(size, seed: int, index: int = 0) -> PhantomLayers:
    """The noise-free line-integral layers of `make_phantom(size, seed, index)`."""
    height, width = _height_width(size)
    layers = _layers(max(height, width), seed, index)[0]
    if height == width:
        return layers
    crop = lambda a: _centre_crop(a, height, width)  # noqa: E731
    return PhantomLayers(crop(layers.soft), crop(layers.bone), crop(layers.vessels),
                         layers.torso_peak)


def make_phantom(size, seed: int, index: int = 0) -> np.ndarray:
    """A synthetic radiograph, uint16; higher value = more attenuation.

    `size` is a side (square) or (height, width). A rectangle is the centre of the square
    phantom whose side is the longer one: the same anatomy at the same pixel scale and the
    same detector noise per pixel as that square, cropped like a collimated exposure (so
    squares are unchanged and GENERATOR_VERSION stays)."""
    height, width = _height_width(size)
    side = max(height, width)
    layers, rng = _layers(side, seed, index)
    mu = layers.soft
    mu += layers.bone
    mu += layers.vessels
    image = _detect(mu, rng, side)
    return image if height == width else _centre_crop(image, height, width)


def _ellipse_inside(n: int, pose: Pose, cu, cv, a, b, angle) -> tuple[slice, slice, np.ndarray]:
    """The pixels of an n x n grid inside an ellipse of the body frame: (rows, cols, inside)."""
    cu, cv, a, b = float(cu), float(cv), float(a), float(b)
    rows, cols = _box(n, pose, cu, cv, max(a, b))
    u, v = _body_grid(n, pose, rows, cols)
    ca, sa = math.cos(math.radians(angle)), math.sin(math.radians(angle))
    du, dv = u - cu, v - cv
    return rows, cols, ((du * ca + dv * sa) / a) ** 2 + ((-du * sa + dv * ca) / b) ** 2 < 1


def _mark(mask: np.ndarray, pose: Pose, ellipse: tuple, value: int) -> None:
    rows, cols, inside = _ellipse_inside(mask.shape[0], pose, *ellipse)
    mask[rows, cols][inside] = value


def _bone_pixels(anat: _Anatomy, size: int) -> np.ndarray:
    """Every bone's outline filled (cortex and marrow), drawn as the image draws it."""
    canvas = np.zeros((size, size), np.uint8)
    for _layer, kind, points, width in anat.bones:
        _draw(canvas, anat.pose, kind, points, width, 1.0, cv2.LINE_8)
    return canvas > 0


def make_mask(size, seed: int, index: int = 0, classes: int = len(PHANTOM_CLASSES)) -> np.ndarray:
    """The mask of the structures `make_phantom(size, seed, index)` draws, uint8 class indices.

    classes = len(PHANTOM_CLASSES): 0 background, 1 lung, 2 heart, 3 bone (spine, ribs,
    pelvis, limb bones); where they overlap in the projection, bone is marked over heart and
    heart over lung. classes = 1: the lung fields (1) against the rest (0), ribs included.
    The same geometry as the image, at every size (the anatomy is drawn before rasterising);
    rectangles are the centre crop, as the image's."""
    if classes not in (1, len(PHANTOM_CLASSES)):
        raise ValueError(f"phantom masks have 1 class (lung fields) or {len(PHANTOM_CLASSES)} "
                         f"({', '.join(PHANTOM_CLASSES)}); got {classes}")
    height, width = _height_width(size)
    side = max(height, width)
    rng = np.random.default_rng((_check_int("seed", seed, 0), _check_int("index", index, 0)))
    anat = _sample_anatomy(rng)
    mask = np.zeros((side, side), np.uint8)
    for lung in anat.lungs:
        _mark(mask, anat.pose, lung, PHANTOM_CLASSES.index("lung"))
    if classes > 1:
        _mark(mask, anat.pose, anat.heart, PHANTOM_CLASSES.index("heart"))
        mask[_bone_pixels(anat, side)] = PHANTOM_CLASSES.index("bone")
    return mask if height == width else _centre_crop(mask, height, width)
