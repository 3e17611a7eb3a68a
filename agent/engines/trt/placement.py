"""Where a TensorRT engine's layers run: the build log's placement block and the engine inspector's JSON.

Where the layers run is reported, never assumed: DLA's GPU fallback is silent, so the build log's
"Layers Running on DLA / on GPU" block (captured by :class:`~agent.engines.trt.log.BuildLog`) and
the engine inspector's JSON are parsed into a :class:`Placement`. Pure text parsing, unit-tested
without TensorRT.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

#: Placement of one layer: on a DLA core, on the GPU, or neither (DLA <-> GPU transfer nodes).
Device = Literal["dla", "gpu", "other"]


@dataclass(frozen=True)
class LayerPlacement:
    """Where one (possibly fused) layer runs."""

    name: str
    device: Device
    kind: str = ""


@dataclass(frozen=True)
class Placement:
    """Layers on DLA vs GPU, as TensorRT reported them (``source`` says where from)."""

    dla_layers: int = 0
    gpu_layers: int = 0
    layers: tuple[LayerPlacement, ...] = ()
    source: str = "none"

    def as_dict(self) -> dict[str, Any]:
        return {
            "dla_layers": self.dla_layers,
            "gpu_layers": self.gpu_layers,
            "layers": [{"name": lp.name, "device": lp.device, "kind": lp.kind} for lp in self.layers],
            "source": self.source,
        }


# TensorRT 8.x-10.x: "---------- Layers Running on DLA ----------"; 7.x and some samples:
# "--------------- Layers running on DLA:".
PLACEMENT_HEADER = re.compile(r"Layers\s+[Rr]unning\s+on\s+(DLA|GPU)\b")
PLACEMENT_TAGGED = re.compile(r"\[(Dla|Gpu)Layer\]\s*(.*)$")
NO_LAYER = re.compile(r"No layer is running on (DLA|GPU)", re.IGNORECASE)
# Prefixes that trtexec, TensorRT's own loggers and DeepStream put before a message.
_PREFIX = re.compile(
    r"^(?:\s*(?:\[\d{2}/\d{2}/\d{4}-\d{2}:\d{2}:\d{2}\]|\[[IVWEF]\]|\[TRT\]:?|\[TensorRT\]|"
    r"(?:INTERNAL_ERROR|ERROR|WARNING|INFO|VERBOSE):))+\s*"
)
_GPU_KIND = re.compile(r"^([A-Z][A-Z0-9_]*):\s+(.*)$")


def _strip_prefix(line: str) -> str:
    return _PREFIX.sub("", line).strip()


def _split_top_level(text: str) -> list[str]:
    """Split a comma list, ignoring commas inside (), [] and {} (fused names contain them)."""
    parts: list[str] = []
    depth = 0
    current: list[str] = []
    for ch in text:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth = max(depth - 1, 0)
        if ch == "," and depth == 0:
            parts.append("".join(current).strip())
            current = []
        else:
            current.append(ch)
    parts.append("".join(current).strip())
    return [p for p in parts if p]


def _entry(device: Device, text: str) -> LayerPlacement:
    text = text.strip().rstrip(",").strip()
    if device == "gpu":
        m = _GPU_KIND.match(text)
        if m:
            return LayerPlacement(m.group(2).strip(), "gpu", m.group(1))
        return LayerPlacement(text, "gpu")
    kind = "ForeignNode" if text.startswith("{ForeignNode[") else ""
    return LayerPlacement(text, "dla", kind)


def parse_placement_log(text: str) -> Placement | None:
    """Parse the "Layers Running on DLA / on GPU" block of a TensorRT build log.

    Understands the 8.x-10.x form (``[DlaLayer] {ForeignNode[...]}`` / ``[GpuLayer] TYPE: name``
    lines under dashed headers) and the 7.x form (one comma-separated line per header), with or
    without trtexec/TensorRT logger prefixes. Each DLA entry is one DLA subgraph (loadable);
    each GPU entry one GPU layer. Returns None when the log has no such block (GPU-only builds).
    """
    section: Device | None = None
    freeform_used = False
    seen = False
    layers: list[LayerPlacement] = []
    for raw in text.splitlines():
        line = _strip_prefix(raw)
        header = PLACEMENT_HEADER.search(line)
        if header:
            section = "dla" if header.group(1) == "DLA" else "gpu"
            seen, freeform_used = True, False
            continue
        if section is None:
            continue
        tagged = PLACEMENT_TAGGED.search(line)
        if tagged:
            tag_device: Device = "dla" if tagged.group(1) == "Dla" else "gpu"
            layers.append(_entry(tag_device, tagged.group(2)))
            freeform_used = True
            continue
        if NO_LAYER.search(line):
            freeform_used = True
            continue
        if line and not freeform_used:
            # 7.x: the whole section on one line, "{a,b}, {c}" for DLA, "x, y" for GPU.
            items = re.findall(r"\{[^{}]*\}", line) if section == "dla" else _split_top_level(line)
            layers.extend(_entry(section, item) for item in items)
            freeform_used = True
            continue
        section = None
    if not seen:
        return None
    return Placement(
        dla_layers=sum(1 for lp in layers if lp.device == "dla"),
        gpu_layers=sum(1 for lp in layers if lp.device == "gpu"),
        layers=tuple(layers),
        source="log",
    )


def classify_inspector_layer(name: str, kind: str, dla_requested: bool) -> Device:
    """Device of one engine-inspector layer (a heuristic; the build-log block is authoritative).

    A ``LayerType`` naming DLA is DLA. DLA subgraphs are otherwise recognisable only as
    ``{ForeignNode[...]}`` layers, a name GPU Myelin regions share, so a foreign node counts as
    DLA only when DLA was requested and its type is not Myelin. The ``... to nvm`` / ``... from
    nvm`` / ``... copy finish`` nodes move data between GPU and DLA memory: ``other``.
    """
    lowered_kind = kind.lower()
    lowered_name = name.lower()
    if "dla" in lowered_kind:
        return "dla"
    if lowered_name.endswith((" to nvm", " from nvm", " copy finish")):
        return "other"
    if name.startswith("{ForeignNode[") and dla_requested and "myelin" not in lowered_kind:
        return "dla"
    return "gpu"


def parse_inspector_json(text: str, *, dla_requested: bool) -> Placement | None:
    """Parse ``EngineInspector.get_engine_information(LayerInformationFormat.JSON)``.

    With ``ProfilingVerbosity.DETAILED`` each layer is an object with ``Name`` and ``LayerType``;
    with ``LAYER_NAMES_ONLY`` (the default) each is a bare name string. Returns None when the text
    is not that JSON.
    """
    try:
        data = json.loads(text)
    except ValueError:
        return None
    raw_layers = data.get("Layers") if isinstance(data, dict) else None
    if not isinstance(raw_layers, list):
        return None
    layers: list[LayerPlacement] = []
    for item in raw_layers:
        if isinstance(item, str):
            name, kind = item, ""
        elif isinstance(item, dict):
            name = str(item.get("Name", ""))
            kind = str(item.get("LayerType") or item.get("ParameterType") or "")
        else:
            continue
        # TensorRT 8.6+/10 separate metadata with ASCII unit/record separators.
        name = name.replace("\x1e", "+").replace("\x1f", "+")
        layers.append(LayerPlacement(name, classify_inspector_layer(name, kind, dla_requested), kind))
    return Placement(
        dla_layers=sum(1 for lp in layers if lp.device == "dla"),
        gpu_layers=sum(1 for lp in layers if lp.device == "gpu"),
        layers=tuple(layers),
        source="inspector",
    )


def combine_placement(from_log: Placement | None, from_inspector: Placement | None) -> Placement:
    """Counts from the build log when it has the block (authoritative for DLA), else from the
    inspector; the layer list from the inspector when present (it lists the final engine layers)."""
    if from_log is not None and from_inspector is not None:
        return Placement(
            dla_layers=from_log.dla_layers,
            gpu_layers=from_log.gpu_layers,
            layers=from_inspector.layers,
            source="log+inspector",
        )
    if from_log is not None:
        return from_log
    if from_inspector is not None:
        return from_inspector
    return Placement()
