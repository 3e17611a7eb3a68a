"""docs/fleet.md's ``fleet status`` example is what the table prints for the devices it shows."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from agent.fleet.view.status import DeviceRow, format_table

DOC = Path(__file__).resolve().parents[3] / "docs" / "fleet.md"
NOW = 1_772_370_000.0
DOCK_ERROR = (
    "cannot open camera stream rtsp://***@10.0.4.21:554/main: check that the camera is reachable "
    "and the URL, path and credentials are right"
)
_PLATFORM_NX = {"device_model": "Orin NX", "jetpack": "6.0", "tensorrt_version": "8.6.2", "dla_cores": 2}
_PLATFORM_NANO = {"device_model": "Orin Nano", "jetpack": "6.0", "tensorrt_version": "8.6.2"}


def _slot(version: str, job: str, state: str, runs: dict[str, Any], **more: Any) -> dict[str, Any]:
    return {
        "model_id": "mobilenet",
        "version": version,
        "state": "active",
        "reason": None,
        "last_job": job,
        "last_job_state": state,
        "last_job_error_code": more.get("code"),
        "last_failure": more.get("failure"),
        "runs": runs,
    }


def _camera(state: str, since_s: float, reconnects: int, error: str | None = None) -> dict[str, Any]:
    return {
        "state": state,
        "since": NOW - since_s,
        "frames": 1000,
        "reconnects": reconnects,
        "last_error": error,
        "last_error_at": NOW - since_s if error else None,
    }


REVERTED = "config_reverted: stream cam0 delivered no frame for 30 s (it did before the change)"


def _target(version: str, *, pending: str | None = None, reverted: str | None = None) -> dict[str, Any]:
    return {"version": version, "job_id": None, "pending": pending, "reverted": reverted}


def example_rows() -> list[DeviceRow]:
    """The three devices of the doc's example."""
    fallback = (
        "INT8 accuracy guard: INT8 top-1 agrees with FP32 on 81.2% of 64 held-out frames (mean |score "
        "diff| 0.2113), below the required 97.0%; falling back to FP16/FP32. Recalibrate on frames that "
        "cover the scene, or lower engines.int8_agreement"
    )
    jet1 = DeviceRow(
        "jet-01",
        state="online",
        since=NOW - 181,
        agent_version="0.1.0",
        slots={
            "main": _slot(
                "4",
                "mobilenet-4-20260301T1200Z-a1b2c3",
                "ACTIVE",
                {"requested": "int8", "precision": "fp16", "source": "built", "fallback": fallback},
            )
        },
        platform=_PLATFORM_NX,
        fps=29.8,
        cpu_percent=41.0,
        temp_c=52.0,
        cameras={"cam0": _camera("streaming", 181, 0), "dock": _camera("reconnecting", 130, 14, DOCK_ERROR)},
        cameras_listed=2,
        camera_figures={
            "stream.cam0.capture_fps": 30.0,
            "stream.cam0.source.last_frame_age_s": 0.03,
            "stream.dock.capture_fps": 0.0,
            "stream.dock.source.last_frame_age_s": 132.0,
        },
        cert_not_after=NOW + 24 * 86400,
        targets={"config": _target("cfg-7"), "agent": _target("0.1.0")},
    )
    jet2 = DeviceRow(
        "jet-02",
        state="online",
        since=NOW - 4200,
        agent_version="0.1.0",
        slots={
            "main": _slot(
                "3",
                "mobilenet-4-20260301T1200Z-a1b2c3",
                "REJECTED",
                {"precision": "fp16", "source": "downloaded"},
                code="unknown_key",
                failure={"job_id": "mobilenet-4-20260301T1200Z-a1b2c3", "state": "REJECTED",
                         "error_code": "unknown_key", "ts": NOW - 312},
            )
        },
        platform=_PLATFORM_NANO,
        fps=14.9,
        cpu_percent=88.0,
        temp_c=71.0,
        cameras={"cam0": _camera("streaming", 4200, 0)},
        cameras_listed=1,
        camera_figures={"stream.cam0.capture_fps": 15.0, "stream.cam0.source.last_frame_age_s": 0.07},
        cert_not_after=NOW + 11 * 86400,
        targets={"config": _target("cfg-6", pending="cfg-7"), "agent": _target("0.1.0")},
    )  # fmt: skip
    jet3 = DeviceRow(
        "jet-03",
        state="offline",
        since=NOW - 7260,
        agent_version="0.1.0",
        slots={
            "main": _slot(
                "3", "mobilenet-3-20260214T0900Z-9f8e7d", "ACTIVE", {"precision": "fp16", "source": "built"}
            )
        },
        platform=_PLATFORM_NANO,
        cameras={"cam0": _camera("streaming", 9000, 0)},
        cameras_listed=1,
        targets={"config": _target("cfg-6", reverted=REVERTED), "agent": _target("0.1.0")},
    )
    return [jet1, jet2, jet3]


def _documented() -> str:
    section = DOC.read_text(encoding="utf-8").split("## 4. Watch the fleet", 1)[1]
    block = section.split("```sh\n", 1)[1].split("```", 1)[0]
    lines = block.splitlines()[1:]  # after the command itself
    return "\n".join(re.sub(r"^# ?", "", line) for line in lines)


def test_the_fleet_status_example_is_what_the_table_prints() -> None:
    assert _documented() == format_table(example_rows(), now=NOW)
