"""Procedurally generated images of shapes, deterministic from a seed.

Each image is one filled shape (:data:`CLASSES`) of random size, position, rotation and colour on a
cluttered background (gradient, thin lines, specks) with sensor-like Gaussian noise. The same
``(n, seed, size)`` always gives the same bytes, so a training set, a calibration set and a held-out
test set are just three seeds, and a test can regenerate exactly what a model was measured on.

Images are ``uint8`` BGR ``H x W x 3``, what OpenCV decodes from a camera, so they go through the
agent's own preprocessing (:func:`agent.camera.preprocess.preprocess`) like live frames.

Ships with the package because ``edge-agent demo`` draws its video from it, and the bundled
shapes model was trained and is calibrated on it (``tools/train_shapes.py``, the INT8 tests).
"""

from __future__ import annotations

import math
from pathlib import Path

import cv2
import numpy as np
import numpy.typing as npt

#: Class names in label order: label ``i`` is ``CLASSES[i]``.
CLASSES: tuple[str, ...] = ("circle", "square", "triangle", "star", "cross")

#: The classifier trained on these images by ``tools/train_shapes.py`` (input ``images``
#: [batch, 3, 64, 64] RGB / 255, i.e. ``PreprocessSpec(width=64, height=64)``; output ``scores``
#: [batch, len(CLASSES)]), and its labels file, one class name per line.
MODEL_PATH = Path(__file__).resolve().parent.parent / "assets" / "shapes_classifier.onnx"
LABELS_PATH = MODEL_PATH.with_name("shapes_labels.txt")

#: Fixed-point bits of the polygon vertices handed to OpenCV (sub-pixel accurate, anti-aliased edges).
_SHIFT = 4
_ONE = 1 << _SHIFT

#: Minimum squared BGR distance between a shape and the background under it, so every shape is visible.
_MIN_CONTRAST_SQ = 90.0**2


def _unit_outline(label: int) -> npt.NDArray[np.float64]:
    """Vertices of class ``label`` around the origin with circumradius 1 (circle: a fine polygon)."""
    name = CLASSES[label]
    if name == "circle":
        angles = np.linspace(0.0, 2.0 * math.pi, 48, endpoint=False)
        return np.stack([np.cos(angles), np.sin(angles)], axis=1)
    if name == "square":
        angles = np.array([0.25, 0.75, 1.25, 1.75]) * math.pi
        return np.stack([np.cos(angles), np.sin(angles)], axis=1)
    if name == "triangle":
        angles = -0.5 * math.pi + np.array([0.0, 2.0, 4.0]) * math.pi / 3.0
        return np.stack([np.cos(angles), np.sin(angles)], axis=1)
    if name == "star":
        angles = -0.5 * math.pi + np.arange(10, dtype=np.float64) * math.pi / 5.0
        radii = np.where(np.arange(10) % 2 == 0, 1.0, 0.42)
        return np.stack([radii * np.cos(angles), radii * np.sin(angles)], axis=1)
    if name == "cross":
        a = 0.3  # half the bar width, relative to the circumradius of the arm ends
        b = math.sqrt(1.0 - a * a)
        return np.array(
            [
                [-a, -b],
                [a, -b],
                [a, -a],
                [b, -a],
                [b, a],
                [a, a],
                [a, b],
                [-a, b],
                [-a, a],
                [-b, a],
                [-b, -a],
                [-a, -a],
            ]
        )
    raise ValueError(f"no outline for class {name!r}")  # pragma: no cover - CLASSES and outlines agree


_OUTLINES = tuple(_unit_outline(i) for i in range(len(CLASSES)))


def _colour(rng: np.random.Generator) -> npt.NDArray[np.float64]:
    return rng.uniform(0.0, 255.0, size=3)


def _contrasting(rng: np.random.Generator, background: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """A colour far enough from ``background`` to be seen; the farthest of a few tries otherwise."""
    best, best_d = _colour(rng), -1.0
    for _ in range(8):
        colour = _colour(rng)
        d = float(np.sum((colour - background) ** 2))
        if d >= _MIN_CONTRAST_SQ:
            return colour
        if d > best_d:
            best, best_d = colour, d
    return best


def _background(rng: np.random.Generator, size: int) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.float64]]:
    """A linear colour gradient with a few thin lines and specks; also returns its mean colour."""
    c0, c1 = _colour(rng), _colour(rng)
    # Gradients stay gentle (blend at most 60 % across the image) so the shape keeps its contrast.
    c1 = c0 + (c1 - c0) * rng.uniform(0.0, 0.6)
    angle = rng.uniform(0.0, 2.0 * math.pi)
    ramp = np.linspace(0.0, 1.0, size)
    t = np.clip(0.5 + (ramp[None, :] - 0.5) * math.cos(angle) + (ramp[:, None] - 0.5) * math.sin(angle), 0, 1)
    image = (c0[None, None, :] * (1.0 - t[..., None]) + c1[None, None, :] * t[..., None]).astype(np.uint8)
    for _ in range(int(rng.integers(0, 5))):
        p1 = tuple(int(v) for v in rng.integers(0, size, size=2))
        p2 = tuple(int(v) for v in rng.integers(0, size, size=2))
        cv2.line(image, p1, p2, tuple(float(v) for v in _colour(rng)), 1, cv2.LINE_AA)
    for _ in range(int(rng.integers(0, 8))):
        centre = tuple(int(v) for v in rng.integers(0, size, size=2))
        cv2.circle(image, centre, 1, tuple(float(v) for v in _colour(rng)), -1, cv2.LINE_AA)
    return image, (c0 + c1) / 2.0


def _draw_shape(image: npt.NDArray[np.uint8], label: int, rng: np.random.Generator) -> None:
    size = image.shape[0]
    radius = rng.uniform(0.2, 0.42) * size
    # Keep the centre where most of the shape stays in the frame (at most ~20 % of the radius out).
    margin = radius * 0.8
    cx, cy = rng.uniform(margin, size - margin, size=2)
    theta = rng.uniform(0.0, 2.0 * math.pi)
    aspect = rng.uniform(0.85, 1.15)  # slight anisotropy: perspective, lens, a non-square pixel
    rot = np.array([[math.cos(theta), -math.sin(theta)], [math.sin(theta), math.cos(theta)]])
    pts = (_OUTLINES[label] * [radius * aspect, radius / aspect]) @ rot.T + [cx, cy]
    fixed = np.round(pts * _ONE).astype(np.int32).reshape(-1, 1, 2)
    colour = _contrasting(rng, image[int(cy) % size, int(cx) % size].astype(np.float64))
    cv2.fillPoly(image, [fixed], tuple(float(v) for v in colour), cv2.LINE_AA, _SHIFT)


def generate(n: int, *, seed: int, size: int = 64) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.int64]]:
    """Generate ``n`` shape images of ``size x size`` pixels, deterministically from ``seed``.

    Returns ``(images, labels)``: ``images`` is ``uint8`` ``n x size x size x 3`` in BGR order,
    ``labels`` ``int64`` indices into :data:`CLASSES`. Classes are balanced (counts differ by at most
    one) and shuffled.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if size < 16:
        raise ValueError(f"size must be >= 16 pixels for shapes to be recognisable, got {size}")
    rng = np.random.default_rng(seed)
    labels = rng.permutation(np.arange(n, dtype=np.int64) % len(CLASSES))
    images = np.empty((n, size, size, 3), dtype=np.uint8)
    for i in range(n):
        image, _ = _background(rng, size)
        _draw_shape(image, int(labels[i]), rng)
        if rng.random() < 0.5:
            # A little defocus, as a cheap camera gives.
            images[i] = cv2.GaussianBlur(image, (3, 3), rng.uniform(0.3, 0.9))
        else:
            images[i] = image
    # Noise for the whole batch at once: per-image strength, per-pixel Gaussian.
    sigma = rng.uniform(0.0, 10.0, size=(n, 1, 1, 1)).astype(np.float32)
    noise = rng.standard_normal(images.shape, dtype=np.float32) * sigma
    np.clip(images.astype(np.float32) + noise, 0.0, 255.0, out=noise)
    return noise.astype(np.uint8), labels
