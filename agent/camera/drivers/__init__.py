"""Camera drivers, one module per source type, chosen by the spec's ``type`` through :data:`DRIVERS`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from agent.camera.drivers.base import Driver, Image, missing_frames, read_timeout_s
from agent.camera.drivers.file import FileDriver
from agent.camera.drivers.gstreamer import GStreamerDriver
from agent.camera.drivers.synthetic import SyntheticDriver
from agent.camera.drivers.url import UrlDriver
from agent.camera.drivers.v4l2 import V4L2Driver
from agent.camera.source_spec import SourceSpec
from agent.errors import SourceError

#: The registry: spec ``type`` -> driver class. A new source type adds one line here.
DRIVERS: Mapping[str, type[Driver[Any]]] = {
    FileDriver.kind: FileDriver,
    V4L2Driver.kind: V4L2Driver,
    UrlDriver.kind: UrlDriver,
    GStreamerDriver.kind: GStreamerDriver,
    SyntheticDriver.kind: SyntheticDriver,
}


def driver_for(spec: SourceSpec) -> Driver[Any]:
    """A new, unopened driver for ``spec``."""
    cls = DRIVERS.get(spec.type)
    if cls is None:
        raise SourceError(f"no camera driver for source type {spec.type!r}; known: {sorted(DRIVERS)}")
    return cls(spec)


__all__ = ["DRIVERS", "Driver", "Image", "driver_for", "missing_frames", "read_timeout_s"]
