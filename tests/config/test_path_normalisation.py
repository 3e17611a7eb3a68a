"""Relative paths of a config are normalised when made absolute (issue 22.11: logs and state.json
showed ``configs/../agent/assets/...``)."""

from __future__ import annotations

from pathlib import Path

from agent.config import load_config

REPO = Path(__file__).resolve().parents[2]


def test_the_local_configs_model_path_has_no_dot_dot_and_names_the_same_file() -> None:
    config = load_config(REPO / "configs" / "local.yaml", environ={})

    model = Path(config.slots["shapes"].model)

    assert ".." not in model.parts
    assert model == REPO / "agent" / "assets" / "shapes_classifier.onnx"
    assert model.is_file()
