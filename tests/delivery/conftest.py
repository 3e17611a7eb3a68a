"""Fixtures for delivery tests: signing keys, tiny real models, and a started in-process device."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.demo.broker import Broker
from agent.demo.modelzoo import write_classifier
from tests.delivery.delivery_stack import Harness, Keys, make_keys

HarnessFactory = Callable[..., Harness]


@pytest.fixture
def keys(tmp_path: Path) -> Keys:
    """A fresh Ed25519 key pair; the device trusts its public key as ``fleet-test``."""
    return make_keys(tmp_path / "keys")


@pytest.fixture
def model_v1(tmp_path: Path) -> Path:
    """A real 64x64 classifier (10 classes), ~26 KB."""
    return write_classifier(tmp_path / "models-src" / "v1.onnx", input_size=64, seed=1)


@pytest.fixture
def model_v2(tmp_path: Path) -> Path:
    return write_classifier(tmp_path / "models-src" / "v2.onnx", input_size=64, seed=2)


@pytest.fixture
def make_device(broker: Broker, tmp_path: Path, keys: Keys) -> Iterator[HarnessFactory]:
    """``make_device(state_dir=None, start=True, **Harness kwargs)``; every device closed at teardown."""
    made: list[Harness] = []

    def make(*, state_dir: Path | None = None, start: bool = True, **kwargs: Any) -> Harness:
        h = Harness(broker, state_dir or tmp_path / f"state-{len(made)}", keys, **kwargs)
        made.append(h)
        return h.start() if start else h

    yield make
    for h in made:
        h.close()


@pytest.fixture
def device(make_device: HarnessFactory) -> Harness:
    """A started device with default delivery settings."""
    return make_device()
