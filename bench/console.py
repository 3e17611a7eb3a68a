"""Fleet console benchmark, as JSON: a 1,000-device fleet rendered in headless Chromium.

The devices are simulated: each one's ``up/status``, ``up/info`` and ``up/telemetry`` (real protocol
messages, encoded as an agent encodes them) are handed to a :class:`FleetView` directly, as the
controller's MQTT client would. The console runs on uvicorn on a loopback port; Chromium
(``/usr/bin/chromium``, driven by Playwright) opens it.

Measured:

- ``render_s``: from the navigation's start to the devices table holding every row (the page
  loads, fetches ``/api/devices`` to check the filter, opens ``/events`` and renders the first frame);
- ``update_*_s``: from one device's status changing in the view to its row showing it: on a quiet
  fleet (the change comes 1.5 s after the last, so it meets an idle stream), and while every device
  sends telemetry once a second (every row changes every second; the feed sends at most one frame
  a second, so up to a second of this is the pacing, by design);
- the size of the first frame (everything) and of a frame with one device changed.

    .venv/bin/python bench/console.py [--devices 1000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from playwright.sync_api import Page, sync_playwright

from agent.fleet.console import make_console_app, serve_console
from agent.fleet.console.feed import Feed, Stream
from agent.fleet.console.summary import DeviceFilter
from agent.fleet.rollout.store import RolloutStore
from agent.fleet.view.live import FleetView
from agent.mqtt.inbound import InboundMessage
from agent.protocol.messages import (
    InfoMessage,
    ModelRef,
    SlotInfo,
    StatusMessage,
    TelemetryMessage,
    encode,
)
from agent.protocol.topics import Topics

PREFIX = "fleet/v1"


class _Refused:
    """Actions are not benchmarked: every one is refused."""

    def pause(self, rollout_id: str) -> str:
        raise NotImplementedError

    def resume(self, rollout_id: str) -> str:
        raise NotImplementedError

    def abort(self, rollout_id: str, rollback: bool) -> str:
        raise NotImplementedError

    def decommission(self, device_id: str) -> str:
        raise NotImplementedError

    def snapshot(self, device_id: str, stream: str | None) -> dict[str, Any]:
        raise NotImplementedError

    def evidence(self, device_id: str, job_id: str) -> dict[str, Any]:
        raise NotImplementedError


def _apply(view: FleetView, topic: str, payload: bytes, retain: bool = False) -> None:
    view.apply(InboundMessage(topic, payload, qos=1, retain=retain))


def _status(view: FleetView, device: str, state: str, session: int) -> None:
    message = StatusMessage(state=state, session=session, agent_version="0.3.1")
    _apply(view, Topics(PREFIX, device).status, encode(message), retain=True)


def _telemetry(view: FleetView, device: str, fps: float) -> None:
    message = TelemetryMessage(
        **{
            "stream.cam0.fps": fps,
            "stream.cam0.latency.total.p50_ms": 21.0,
            "stream.cam0.latency.total.p99_ms": 44.0,
            "cpu.percent": 35.0,
            "temp.cpu_therm_c": 50.0,
        }
    )
    _apply(view, Topics(PREFIX, device).telemetry, encode(message))


def fleet(devices: int) -> tuple[FleetView, list[str]]:
    """A FleetView holding ``devices`` online devices with info and one telemetry message each."""
    view = FleetView(PREFIX)
    names = [f"jet-{i:05d}" for i in range(devices)]
    for i, name in enumerate(names):
        _status(view, name, "online", 1)
        info = InfoMessage(
            device_id=name,
            agent_version="0.3.1",
            platform={"device_model": "Jetson Orin NX", "jetpack": "6.0", "dla_cores": 2},
            labels={"site": f"site-{i % 20}"},
            backends={},
            slots={
                "main": SlotInfo(
                    model=ModelRef(slot="main", model_id="mobilenet", version="4", sha256="ab" * 32),
                    state="active",
                )
            },
            streams=["cam0"],
        )
        _apply(view, Topics(PREFIX, name).info, encode(info), retain=True)
        _telemetry(view, name, 25.0 + i % 5)
    return view, names


def _update_latency(
    page: Page, view: FleetView, device: str, state: str, session: int, pause_s: float = 0.0
) -> float:
    time.sleep(pause_s)  # > the feed's interval: the change meets an idle stream, not its pacing
    started = time.perf_counter()
    _status(view, device, state, session)
    page.wait_for_selector(f'#devices tr[data-device="{device}"][data-state="{state}"]', timeout=10_000)
    return time.perf_counter() - started


def _summary(values: list[float]) -> dict[str, float]:
    return {
        "median": round(statistics.median(values), 3),
        "max": round(max(values), 3),
        "min": round(min(values), 3),
    }


def run(devices: int, repeats: int, chromium: str) -> dict[str, object]:
    """Render and update the devices page of a ``devices``-device fleet; return the figures."""
    view, names = fleet(devices)
    with tempfile.TemporaryDirectory() as tmp:
        store = RolloutStore(Path(tmp) / "rollouts.sqlite")
        stream = Stream(Feed(view, store, interval_s=0.0), DeviceFilter())
        full_frame = len(stream.frame().encode())
        _status(view, names[1], "offline", 1)
        one_change = len(stream.frame().encode())
        _status(view, names[1], "online", 2)

        server = serve_console(make_console_app(view, store, _Refused(), token=None), "127.0.0.1", 0)
        stop = threading.Event()
        try:
            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path=chromium, headless=True)
                page = browser.new_page(viewport={"width": 1280, "height": 800})
                render: list[float] = []
                for _ in range(repeats):
                    started = time.perf_counter()
                    page.goto(server.url + "/")
                    page.wait_for_selector(f"#devices tbody tr >> nth={devices - 1}", timeout=30_000)
                    render.append(time.perf_counter() - started)
                quiet = [
                    _update_latency(page, view, names[i * 7 % devices], "offline", 2, pause_s=1.5)
                    for i in range(repeats)
                ]

                def busy_fleet() -> None:
                    # Every device reports once a second, as a fleet at telemetry.interval_s=1 does.
                    while not stop.is_set():
                        second = time.monotonic()
                        for i, name in enumerate(names):
                            _telemetry(view, name, 20.0 + (i + second) % 9)
                        stop.wait(max(0.0, 1.0 - (time.monotonic() - second)))

                load = threading.Thread(target=busy_fleet, daemon=True)
                load.start()
                time.sleep(2.0)
                busy = [
                    _update_latency(page, view, names[i * 11 % devices + 1], "offline", 3)
                    for i in range(repeats)
                ]
                stop.set()
                load.join()
                browser.close()
        finally:
            stop.set()
            server.stop()
            store.close()
    return {
        "devices": devices,
        "repeats": repeats,
        "render_s": _summary(render),
        "update_quiet_s": _summary(quiet),
        "update_busy_s": _summary(busy),
        "first_frame_bytes": full_frame,
        "one_change_frame_bytes": one_change,
        "feed_interval_s": 1.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--devices", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    args = parser.parse_args()
    print(json.dumps(run(args.devices, args.repeats, args.chromium), indent=2))


if __name__ == "__main__":
    main()
