"""What the engine builder hands back: an :class:`EngineArtifact`, made from a cache entry.

The artifact says what was requested and what was effectively built (precision, device, DLA core,
providers, layer placement, every change with its reason) and carries the load options the runtime
needs. It is made the same way for a cache hit and a fresh build, from the entry's sidecar and the
build report cached with it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from agent.backends.base import LoadOptions, ProviderRequest
from agent.engines.building.ort import (
    EP_CONTEXT_FILE,
    REPORT_FILE,
    TRT_CACHE_FILE,
    TRT_ENGINE_DIR,
    OrtPaths,
    provider_names,
    provider_options,
)
from agent.engines.cache.store import CacheEntry
from agent.engines.sharing.cache import FLEET_BUILT_BY
from agent.machine.platform import Platform
from agent.specs.build import BuildPlan, BuildSpec


@dataclass(frozen=True)
class EngineArtifact:
    """A built (or cached) engine, what it effectively is, and how to load it."""

    engine_path: Path
    backend: str
    plan: BuildPlan
    effective: dict[str, Any]
    cache_hit: bool
    build_seconds: float
    key: str
    load_extra: dict[str, Any] = field(default_factory=dict)
    providers: tuple[ProviderRequest, ...] = ("CPUExecutionProvider",)

    def load_options(self, intra_op_threads: int = 0) -> LoadOptions:
        """:class:`LoadOptions` for loading :attr:`engine_path` with backend :attr:`backend`."""
        return LoadOptions(providers=self.providers, intra_op_threads=intra_op_threads, extra=self.load_extra)


def artifact_of(
    entry: CacheEntry,
    plan: BuildPlan,
    requested: BuildSpec,
    platform: Platform,
    *,
    timing_dir: Path,
    cache_hit: bool,
    seconds: float,
) -> EngineArtifact:
    """The artifact of a cache entry: requested vs effective, placement or providers, load options.

    ``timing_dir`` is where ONNX Runtime's TensorRT provider keeps its timing cache on this device.
    """
    meta = entry.meta
    report = read_report(entry.file(REPORT_FILE))
    effective: dict[str, Any] = {
        "backend": plan.backend,
        "precision": plan.precision,
        "device": plan.device,
        "dla_core": plan.dla_core,
        "gpu_fallback": plan.gpu_fallback,
        "int8_mode": plan.int8_mode,
        "requested": {"precision": requested.precision, "device": requested.device},
        "changes": [change.model_dump(mode="json") for change in plan.changes],
        "built_seconds": meta.build_seconds,
        "engine_bytes": meta.engine_bytes,
    }
    if "slim" in report:
        effective["slim"] = report["slim"]
    load_extra: dict[str, Any] = {"precision": plan.precision}
    engine_path = entry.engine_path
    providers: tuple[ProviderRequest, ...] = ("CPUExecutionProvider",)
    if plan.backend == "tensorrt":
        placement = report.get("placement")
        effective["placement"] = placement
        load_extra.update(dla_core=plan.dla_core if plan.device == "dla" else None, placement=placement)
    else:
        table = TRT_CACHE_FILE if entry.file(TRT_CACHE_FILE).is_file() else None
        paths = OrtPaths(
            engine_cache_dir=entry.file(TRT_ENGINE_DIR),
            timing_cache_dir=timing_dir,
            calibration_table=table if plan.int8_mode == "calibrator" else None,
        )
        # Loading: the paths carry no dump target, so the provider never dumps again.
        requests = provider_options(plan, paths, platform.ort_providers or None)
        ep_context = entry.file(EP_CONTEXT_FILE)
        if ep_context.is_file():
            engine_path = ep_context
            effective["ep_context"] = {"path": str(ep_context), "mode": plan.ep_context}
        providers = tuple(requests)
        effective["providers"] = report.get("providers", provider_names(requests))
        effective["placement"] = {"providers": effective["providers"]}
        if "calibration" in report:
            effective["calibration"] = {
                **report["calibration"],
                "table": str(entry.file(str(report["calibration"].get("table", "")))),
                "trt_cache": str(entry.file(TRT_CACHE_FILE)),
            }
        load_extra["providers"] = list(providers)
    return EngineArtifact(
        engine_path=engine_path,
        backend=plan.backend,
        plan=plan,
        effective=effective,
        cache_hit=cache_hit,
        build_seconds=seconds,
        key=entry.key,
        load_extra=load_extra,
        providers=providers,
    )


def read_report(path: Path) -> dict[str, Any]:
    """The build report the child wrote into a cache entry; empty when missing or unreadable."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def with_source(
    artifact: EngineArtifact, origin: str, entry: CacheEntry, *, seconds: float | None = None
) -> EngineArtifact:
    """``artifact`` whose ``effective.engine_source`` (job status) says where the engine came from:
    ``built`` here, ``downloaded`` from the fleet, or ``cache`` (this device's), and how long that took."""
    source: dict[str, object] = {
        "origin": origin,
        "seconds": round(seconds if seconds is not None else artifact.build_seconds, 3),
        "key": entry.key[:12],
    }
    built_by = entry.meta.extra.get(FLEET_BUILT_BY)
    if built_by is not None:
        source["built_by"] = built_by
    return replace(artifact, effective={**artifact.effective, "engine_source": source})
