"""``edge-agent fleet samples export``: the controller's samples as a dataset labelling tools read.

Two formats, the model's predictions as pre-labels:

* ``coco`` (detectors): ``images/<name>.jpg`` and ``annotations.json`` in COCO JSON: ``images``,
  ``annotations`` (``bbox`` ``[x, y, width, height]`` in the JPEG's pixels, ``score`` kept) and
  ``categories`` (the labels the predictions name, ids from the model's class index + 1);
* ``folders`` (classifiers): ``<top-1 label>/<name>.jpg``, the class-folder tree image
  classification tools import.

A sample of the other kind (a classifier's in ``coco``, a detector's in ``folders``) is left out
and counted. Names are ``<device>-<slot>-<frame>-<seq>``, so they never collide. The store is read
oldest first; a sample the running controller evicts meanwhile is left out.
"""

from __future__ import annotations

import base64
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from agent.fleet.samples.store import SampleStore
from agent.fsutil import atomic_write_bytes, atomic_write_json

ExportFormat = Literal["coco", "folders"]
FORMATS: tuple[ExportFormat, ...] = ("coco", "folders")

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


@dataclass(frozen=True)
class ExportSummary:
    """What an export wrote: images, annotations and the samples of the other kind left out."""

    images: int
    annotations: int
    skipped: int


def _safe(text: str) -> str:
    """``text`` as one file-name level (a label from a device names a folder: no ``/`` or ``..``)."""
    cleaned = _UNSAFE.sub("_", text).strip(".") or "_"
    return cleaned[:100]


def export_samples(store: SampleStore, fmt: ExportFormat, out: Path) -> ExportSummary:
    """Write ``store``'s samples to ``out`` as ``fmt``; every file temp + fsync + rename."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r} (formats: {', '.join(FORMATS)})")
    out.mkdir(parents=True, exist_ok=True)
    return _coco(store, out) if fmt == "coco" else _folders(store, out)


def _coco(store: SampleStore, out: Path) -> ExportSummary:
    images: list[dict[str, Any]] = []
    annotations: list[dict[str, Any]] = []
    categories: dict[int, str] = {}
    skipped = 0
    (out / "images").mkdir(exist_ok=True)
    for stored, sample in store.read_all():
        detections = sample.prediction.detections
        if detections is None:
            skipped += 1
            continue
        name = f"{_safe(stored.device)}-{_safe(sample.slot)}-{sample.frame}-{stored.seq}.jpg"
        atomic_write_bytes(out / "images" / name, base64.b64decode(sample.jpeg_b64))
        image_id = len(images) + 1
        images.append(
            {"id": image_id, "file_name": f"images/{name}", "width": sample.width, "height": sample.height}
        )
        sx = sample.width / sample.source_width
        sy = sample.height / sample.source_height
        for det in detections:
            x1, y1, x2, y2 = det.box
            categories.setdefault(det.index + 1, det.label)
            box = [x1 * sx, y1 * sy, max(0.0, x2 - x1) * sx, max(0.0, y2 - y1) * sy]
            annotations.append(
                {
                    "id": len(annotations) + 1,
                    "image_id": image_id,
                    "category_id": det.index + 1,
                    "bbox": [round(v, 2) for v in box],
                    "area": round(box[2] * box[3], 2),
                    "iscrowd": 0,
                    "score": None if math.isnan(det.score) else det.score,
                }
            )
    atomic_write_json(
        out / "annotations.json",
        {
            "info": {
                "description": "edge-agent samples; annotations are the model's predictions (pre-labels)"
            },
            "images": images,
            "annotations": annotations,
            "categories": [{"id": i, "name": n} for i, n in sorted(categories.items())],
        },
    )
    return ExportSummary(len(images), len(annotations), skipped)


def _folders(store: SampleStore, out: Path) -> ExportSummary:
    written = 0
    skipped = 0
    for stored, sample in store.read_all():
        classes = sample.prediction.classes
        if not classes:
            skipped += 1
            continue
        top = max(classes, key=lambda c: -math.inf if math.isnan(c.score) else c.score)
        folder = out / _safe(top.label)
        folder.mkdir(exist_ok=True)
        name = f"{_safe(stored.device)}-{_safe(sample.slot)}-{sample.frame}-{stored.seq}.jpg"
        atomic_write_bytes(folder / name, base64.b64decode(sample.jpeg_b64))
        written += 1
    return ExportSummary(written, written, skipped)


def summary_json(summary: ExportSummary, fmt: ExportFormat, out: Path) -> str:
    """The export's one-line JSON report for the CLI."""
    return json.dumps(
        {
            "format": fmt,
            "out": str(out),
            "images": summary.images,
            "annotations": summary.annotations,
            "skipped": summary.skipped,
        }
    )
