"""The procedural shapes dataset: deterministic, balanced, varied, and what the agent's preprocessing eats."""

from __future__ import annotations

import numpy as np
import pytest

from agent.camera.preprocess import preprocess
from agent.datasets.shapes import CLASSES, generate
from agent.specs.preprocess import PreprocessSpec


def test_same_seed_same_bytes_other_seed_other_images() -> None:
    images_a, labels_a = generate(50, seed=7)
    images_b, labels_b = generate(50, seed=7)
    images_c, labels_c = generate(50, seed=8)
    assert np.array_equal(images_a, images_b)
    assert np.array_equal(labels_a, labels_b)
    assert not np.array_equal(images_a, images_c)
    assert not np.array_equal(labels_a, labels_c)


def test_shape_dtype_and_label_range() -> None:
    images, labels = generate(23, seed=1, size=48)
    assert images.shape == (23, 48, 48, 3)
    assert images.dtype == np.uint8
    assert labels.dtype == np.int64
    assert labels.min() >= 0
    assert labels.max() < len(CLASSES)


def test_classes_are_balanced_and_shuffled() -> None:
    _, labels = generate(1003, seed=3)
    counts = np.bincount(labels, minlength=len(CLASSES))
    assert len(CLASSES) >= 5
    assert counts.max() - counts.min() <= 1
    # Shuffled: not simply 0, 1, 2, 3, 4, 0, ...
    assert not np.array_equal(labels[:20], np.arange(20) % len(CLASSES))


def test_images_vary_and_shapes_stand_out() -> None:
    images, _ = generate(200, seed=4)
    # Different images, not a repeated template.
    assert len({image.tobytes() for image in images}) == 200
    # Every image has real contrast (a visible shape on its background), none is flat.
    spread = images.reshape(200, -1).astype(np.int16)
    assert (spread.max(axis=1) - spread.min(axis=1)).min() > 60


def test_generated_images_preprocess_like_camera_frames() -> None:
    images, _ = generate(2, seed=5)
    tensor, _ = preprocess(images[0], PreprocessSpec(width=64, height=64))
    assert tensor.shape == (3, 64, 64)
    assert tensor.dtype == np.float32
    # RGB order: channel 0 of the tensor is the image's last (red) channel, scaled by 1/255.
    np.testing.assert_allclose(tensor[0], images[0][:, :, 2] / 255.0, atol=1e-6)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="n must be"):
        generate(-1, seed=0)
    with pytest.raises(ValueError, match="size must be"):
        generate(1, seed=0, size=8)
    images, labels = generate(0, seed=0)
    assert images.shape == (0, 64, 64, 3)
    assert labels.shape == (0,)
