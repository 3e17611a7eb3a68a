"""Camera pipelines the agent builds: hardware decode and VIC scaling when the Jetson elements exist.

The pipeline strings are pure functions of the camera, the slot's input and the elements found;
they are checked here word for word. No Jetson here: ``available`` is what ``gst-inspect-1.0``
would report on one (the driver's own probe, run for real below, finds none on this machine).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from agent.camera.drivers.gstreamer import GStreamerDriver, probe_elements
from agent.camera.gst_pipelines import build_pipeline, choose_hardware, delivered_size, framerate, scaled_for
from agent.camera.source_spec import FileSourceSpec, GStreamerSourceSpec
from agent.errors import SourceError
from agent.specs.preprocess import PreprocessSpec
from tests.camera.specs import make

JETSON = frozenset({"nvarguscamerasrc", "nvv4l2decoder", "nvvidconv"})
LETTERBOX_640 = PreprocessSpec.model_validate({"width": 640, "height": 640, "resize": "letterbox"})
STRETCH_224 = PreprocessSpec.model_validate({"width": 224, "height": 224})


def _spec(camera: dict[str, Any], **fields: Any) -> GStreamerSourceSpec:
    return make(GStreamerSourceSpec, camera=camera, **fields)


RTSP = {"kind": "rtsp", "url": "rtsp://10.0.0.7:554/main?profile=1&x=2", "width": 1920, "height": 1080}
CSI = {"kind": "csi", "sensor_id": 1, "width": 1920, "height": 1080, "fps": 30}


def test_rtsp_h264_on_a_jetson_decodes_on_nvdec_and_scales_on_the_vic_keeping_the_aspect() -> None:
    built = build_pipeline(_spec(RTSP, scale_to=LETTERBOX_640), JETSON)
    assert built.pipeline == (
        "rtspsrc location='rtsp://10.0.0.7:554/main?profile=1&x=2' latency=200 ! rtph264depay ! h264parse"
        " ! nvv4l2decoder ! nvvidconv ! video/x-raw,format=BGRx,width=640,height=360 ! videoconvert"
        " ! video/x-raw,format=BGR,width=640,height=360"
    )
    assert (built.width, built.height, built.native) == (640, 360, (1920, 1080))
    assert built.hardware
    assert built.reason == "hardware: nvv4l2decoder and nvvidconv found; scaled from 1920x1080 to 640x360"


def test_csi_camera_through_argus_and_the_vic_to_a_stretched_input() -> None:
    built = build_pipeline(_spec(CSI, scale_to=STRETCH_224), JETSON)
    assert built.pipeline == (
        "nvarguscamerasrc sensor-id=1 ! video/x-raw(memory:NVMM),width=1920,height=1080,framerate=30/1"
        " ! nvvidconv ! video/x-raw,format=BGRx,width=224,height=224 ! videoconvert"
        " ! video/x-raw,format=BGR,width=224,height=224"
    )
    assert (built.width, built.height) == (224, 224)


def test_h265_file_in_mkv_on_a_jetson_and_a_fractional_rate_camera() -> None:
    spec = _spec(
        {"kind": "file", "path": "/data/yard cam.mkv", "codec": "h265", "width": 1280, "height": 720}
    )
    built = build_pipeline(spec, JETSON)
    assert built.pipeline == (
        "filesrc location='/data/yard cam.mkv' ! matroskademux ! h265parse ! nvv4l2decoder ! nvvidconv"
        " ! video/x-raw,format=BGRx,width=1280,height=720 ! videoconvert"
        " ! video/x-raw,format=BGR,width=1280,height=720"
    )
    assert built.reason == "hardware: nvv4l2decoder and nvvidconv found", "no scale_to: native size"
    ntsc = build_pipeline(_spec({**CSI, "fps": 29.97}), JETSON)
    assert "framerate=30000/1001" in ntsc.pipeline
    assert [framerate(fps) for fps in (30.0, 59.94, 12.5, 23.976)] == [
        "30/1",
        "60000/1001",
        "25/2",
        "24000/1001",
    ]


def test_without_the_jetson_elements_the_same_camera_gets_a_software_pipeline_of_the_same_size() -> None:
    built = build_pipeline(_spec(RTSP, scale_to=LETTERBOX_640), {"nvvidconv"})
    assert built.pipeline == (
        "rtspsrc location='rtsp://10.0.0.7:554/main?profile=1&x=2' latency=200 ! rtph264depay ! h264parse"
        " ! avdec_h264 ! videoscale ! video/x-raw,width=640,height=360 ! videoconvert"
        " ! video/x-raw,format=BGR,width=640,height=360"
    )
    assert not built.hardware
    assert built.reason.startswith("software: GStreamer has no nvv4l2decoder here")
    raw = _spec({"kind": "file", "path": "/v/a.h264", "width": 640, "height": 480}, hardware="off")
    assert build_pipeline(raw, JETSON).pipeline.startswith(
        "filesrc location=/v/a.h264 ! h264parse ! avdec_h264 ! "
    )


def test_hardware_on_without_the_elements_and_csi_without_argus_fail_with_the_reason() -> None:
    with pytest.raises(SourceError, match="hardware: on, but GStreamer has no nvv4l2decoder, nvvidconv here"):
        choose_hardware("on", _spec(RTSP).camera, ())  # type: ignore[arg-type]
    with pytest.raises(SourceError, match=r"only through nvarguscamerasrc.*not installed here"):
        build_pipeline(_spec(CSI), {"nvvidconv"})
    with pytest.raises(SourceError, match="set hardware: auto or on"):
        build_pipeline(_spec(CSI, hardware="off"), JETSON)


@pytest.mark.parametrize(
    ("path", "codec", "error"),
    [
        ("/v/a.avi", "h264", r"no demuxer for \.avi; known suffixes: \.264, "),
        ("/v/noext", "h264", "no demuxer for a file without a suffix"),
        ("/v/a.h265", "h264", "is a raw h265 stream but codec says h264"),
    ],
)
def test_files_the_builder_cannot_demux_are_refused_by_name(path: str, codec: str, error: str) -> None:
    spec = _spec({"kind": "file", "path": path, "codec": codec, "width": 640, "height": 480})
    with pytest.raises(SourceError, match=error):
        build_pipeline(spec, JETSON)


def test_delivered_size_follows_the_preprocess_spec() -> None:
    assert delivered_size(1920, 1080, None) == (1920, 1080)
    assert delivered_size(1920, 1080, STRETCH_224) == (224, 224)
    assert delivered_size(1920, 1080, LETTERBOX_640) == (640, 360)
    assert delivered_size(1080, 1920, LETTERBOX_640) == (360, 640)


def test_scaled_for_fills_the_slot_input_only_where_it_applies() -> None:
    camera = _spec(RTSP)
    assert scaled_for(camera, LETTERBOX_640) == camera.model_copy(update={"scale_to": LETTERBOX_640})
    off = _spec(RTSP, scale="off")
    assert scaled_for(off, LETTERBOX_640) is off
    pinned = _spec(RTSP, scale_to=STRETCH_224)
    assert scaled_for(pinned, LETTERBOX_640) is pinned
    written = make(GStreamerSourceSpec, pipeline="videotestsrc", width=64, height=48)
    assert scaled_for(written, LETTERBOX_640) is written
    other = make(FileSourceSpec, path="/v/a.mp4")
    assert scaled_for(other, LETTERBOX_640) is other


def test_a_source_is_a_pipeline_or_a_camera() -> None:
    with pytest.raises(ValidationError, match="set either pipeline"):
        make(GStreamerSourceSpec, pipeline="videotestsrc", width=64, height=48, camera=RTSP)
    with pytest.raises(ValidationError, match="set either pipeline"):
        make(GStreamerSourceSpec)
    with pytest.raises(ValidationError, match="needs width and height"):
        make(GStreamerSourceSpec, pipeline="videotestsrc")
    with pytest.raises(ValidationError, match="String should match pattern"):
        _spec({**RTSP, "url": "http://cam/stream"})


def test_the_driver_builds_the_pipeline_for_what_this_machine_has() -> None:
    """The real probe (no GStreamer NVIDIA plugins here) and the real driver's command line."""
    spec = scaled_for(_spec(RTSP), LETTERBOX_640)
    driver = GStreamerDriver(spec)  # type: ignore[arg-type]
    found = probe_elements(("nvv4l2decoder", "nvvidconv"))
    command = driver.command()
    assert driver.built is not None
    assert driver.built.hardware == (found == {"nvv4l2decoder", "nvvidconv"})
    assert command[:3] == ["gst-launch-1.0", "-q", "rtspsrc"]
    assert "location=rtsp://10.0.0.7:554/main?profile=1&x=2" in command, "one argument, unquoted"
    assert command[-2:] == ["fdsink", "fd=1"]
    assert (driver.width, driver.height, driver.frame_bytes) == (640, 360, 640 * 360 * 3)
    assert driver.native_size == (1920, 1080)


def test_the_documented_camera_example_builds_the_documented_pipeline() -> None:
    """docs/cameras.md: the YAML is accepted as is and gives the pipeline printed below it."""
    text = (Path(__file__).parents[2] / "docs" / "cameras.md").read_text()
    section = text[text.index("### A camera the agent builds the pipeline for") :]
    (kind, written), (_, printed) = re.findall(r"```(\w*)\n(.*?)```", section, re.DOTALL)[:2]
    assert kind == "yaml"
    example = yaml.safe_load(written)["source"]
    spec = scaled_for(GStreamerSourceSpec.model_validate(example), LETTERBOX_640)
    assert build_pipeline(spec, JETSON).pipeline == printed.strip()  # type: ignore[arg-type]
