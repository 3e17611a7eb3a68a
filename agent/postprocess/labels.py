"""Class names of a postprocess spec: inline, or one per line in a file next to the config."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from agent.errors import ConfigError


def load_labels(labels: Sequence[str] | None, labels_file: Path | None, base_dir: Path | None) -> list[str]:
    """Return the class names by index; ``labels_file`` is read relative to ``base_dir``.

    Raises :class:`ConfigError` when both are given or the file cannot be read.
    """
    if labels is not None and labels_file is not None:
        raise ConfigError(
            "postprocess: set either labels or labels_file, not both",
            ["postprocess.labels_file: remove it or postprocess.labels; both name the classes"],
        )
    if labels_file is None:
        return list(labels or [])
    path = labels_file if labels_file.is_absolute() or base_dir is None else base_dir / labels_file
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        problem = (
            f"postprocess.labels_file: cannot read {path} ({exc}); "
            "point it at a UTF-8 text file with one class name per line"
        )
        raise ConfigError(problem, [problem]) from exc
    # Line i names class i, so blank lines inside the file are kept; trailing ones are not classes.
    names = [line.strip() for line in text.splitlines()]
    while names and not names[-1]:
        names.pop()
    return names


def label_of(labels: Sequence[str], index: int) -> str:
    """Name of class ``index``, or ``class_<index>`` when the labels do not cover it."""
    if 0 <= index < len(labels) and labels[index]:
        return labels[index]
    return f"class_{index}"
