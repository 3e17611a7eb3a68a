"""The controller's ``/metrics`` at fleet scale, as JSON: scrape time and series count.

The devices are simulated (no agent processes, no broker): each one's ``up/status``, ``up/info``
and ``up/telemetry`` (real protocol messages, encoded as an agent encodes them: the fleet of
bench/console.py, one slot, one label, five figures) are handed to a :class:`FleetView` directly, as
the controller's MQTT client would. ``/metrics`` is served by
:func:`agent.fleet.metrics.serving.serve_metrics` on a loopback port and fetched with ``urllib`` as
Prometheus would fetch it, plain and gzipped.

A real rollout store (SQLite in a temporary directory) holds ``--rollouts`` rollouts (default 10),
each over every device in two waves, as the controller's store does after as many fleet-wide
rollouts; the controller exports the newest 50.

Per fleet size (``--devices``, default 1,000 and 10,000), each a series of ``--scrapes`` scrapes:

- ``idle``: nothing changes between scrapes;
- ``one_change``: one device's status changes before each scrape;
- ``all_telemetry``: every device sends one telemetry message before each scrape (the cost of a
  scrape after a whole telemetry interval of a fleet);
- ``rollout_change``: one device of a rollout moves (the store changed) before each scrape;
- ``flood``: a thread hands the view ``--flood-rate`` telemetry messages a second (round robin over
  the devices) while the scrapes run, one second apart; ``flood_messages_per_s`` is the rate it
  reached (the same Python process does both, as in the controller).

``first_s`` is the first scrape after the server started (every device rendered). Each scenario
prints ``s`` (min/median/max seconds per scrape, from the request to the last byte),
``series`` (sample lines of the last scrape) and ``bytes``. Only the public API is used
(``serve_metrics``), so the same file measures an older tree that has it at agent/fleet/metrics/serving.py:
``PYTHONPATH=<old tree> python bench/metrics.py``.

    .venv/bin/python bench/metrics.py [--devices 1000 10000] [--scrapes 5] [--rollouts 10]
        [--flood-rate 5000]
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import tempfile
import threading
import time
import urllib.request
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent.fleet.metrics.serving import MetricsServer, serve_metrics
from agent.fleet.rollout.records import RolloutPlan
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


def _apply(view: FleetView, topic: str, payload: bytes, retain: bool = False) -> None:
    view.apply(InboundMessage(topic, payload, qos=1, retain=retain))


def _status(view: FleetView, device: str, state: str, session: int) -> None:
    message = StatusMessage(state=state, session=session, agent_version="0.3.1")
    _apply(view, Topics(PREFIX, device).status, encode(message), retain=True)


def _telemetry_payload(fps: float) -> bytes:
    return encode(
        TelemetryMessage(
            **{
                "stream.cam0.fps": fps,
                "stream.cam0.latency.total.p50_ms": 21.0,
                "stream.cam0.latency.total.p99_ms": 44.0,
                "cpu.percent": 35.0,
                "temp.cpu_therm_c": 50.0,
            }
        )
    )


def fleet(devices: int) -> tuple[FleetView, list[str]]:
    """A FleetView holding ``devices`` online devices with info and one telemetry message each."""
    # No device turns stale while the bench runs (a slow scrape series would otherwise drop series).
    view = FleetView(PREFIX, max_devices=max(devices, 10_000), stale_after_s=86_400.0)
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
        _apply(view, Topics(PREFIX, name).telemetry, _telemetry_payload(25.0 + i % 5))
    return view, names


def _scrape(url: str, gzip: bool) -> tuple[float, bytes]:
    request = urllib.request.Request(url, headers={"Accept-Encoding": "gzip"} if gzip else {})
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=120) as reply:
        body = reply.read()
        encoded = reply.headers.get("Content-Encoding") == "gzip"
    elapsed = time.perf_counter() - started
    return elapsed, zlib.decompress(body, 16 + zlib.MAX_WBITS) if encoded else body


def _summary(values: list[float]) -> dict[str, float]:
    return {
        "min": round(min(values), 3),
        "median": round(statistics.median(values), 3),
        "max": round(max(values), 3),
    }


def _series(url: str, scrapes: int, before: Callable[[int], None], gzip: bool = False) -> dict[str, object]:
    times: list[float] = []
    body = b""
    for n in range(scrapes):
        before(n)
        elapsed, body = _scrape(url, gzip)
        times.append(elapsed)
    lines = body.decode().splitlines()
    return {
        "s": _summary(times),
        "series": sum(1 for line in lines if line and not line.startswith("#")),
        "bytes": len(body),
    }


def _serve(view: FleetView, store: RolloutStore) -> MetricsServer:
    """``serve_metrics`` with the rollout store, as the controller wires it (an older tree counted
    each rollout's devices from ``store.devices``; this one asks the store for counts and a mark)."""
    kwargs: dict[str, Any] = {"rollouts": lambda: store.rollouts(limit=50)}
    if "rollout_counts" in inspect.signature(serve_metrics).parameters:
        kwargs.update(rollout_counts=store.device_counts, rollouts_mark=store.change_mark)
    else:
        kwargs.update(rollout_devices=store.devices)
    return serve_metrics(view, **kwargs)


def run(devices: int, scrapes: int, rollouts: int, flood_rate: float, workdir: Path) -> dict[str, object]:
    """Scrape a ``devices``-device fleet's ``/metrics`` in each situation; return the figures."""
    started = time.perf_counter()
    view, names = fleet(devices)
    store = RolloutStore(workdir / f"rollouts-{devices}.sqlite")
    half = max(1, devices // 20)
    for r in range(rollouts):
        store.create(RolloutPlan(f"r{r}", f"slot{r}", f"job-r{r}", "5", waves=[names[:half], names[half:]]))
    built_s = time.perf_counter() - started
    server = _serve(view, store)
    url = f"http://127.0.0.1:{server.port}/metrics"
    payloads = [_telemetry_payload(20.0 + k) for k in range(9)]

    def nothing(_: int) -> None:
        pass

    def one_change(n: int) -> None:
        _status(view, names[n * 7 % devices], "offline" if n % 2 == 0 else "online", 2 + n)

    def all_telemetry(n: int) -> None:
        for name in names:
            _apply(view, Topics(PREFIX, name).telemetry, payloads[n % len(payloads)])

    def rollout_change(n: int) -> None:
        store.mark_sending("r0", names[n % half])

    out: dict[str, object] = {
        "devices": devices,
        "rollouts": rollouts,
        "scrapes": scrapes,
        "fleet_built_s": round(built_s, 1),
    }
    try:
        first, _ = _scrape(url, gzip=False)
        out["first_s"] = round(first, 3)
        out["idle"] = _series(url, scrapes, nothing)
        out["idle_gzip"] = _series(url, scrapes, nothing, gzip=True)
        out["one_change"] = _series(url, scrapes, one_change)
        out["all_telemetry"] = _series(url, scrapes, all_telemetry)
        if rollouts:
            out["rollout_change"] = _series(url, scrapes, rollout_change)
        stop = threading.Event()
        sent = [0]

        def flood() -> None:
            # Paced in slices of 10 ms, so the messages spread over the second as a fleet's do.
            topics = [Topics(PREFIX, name).telemetry for name in names]
            per_slice = max(1, round(flood_rate / 100))
            while not stop.is_set():
                started = time.monotonic()
                for k in range(per_slice):
                    _apply(view, topics[sent[0] % devices], payloads[k % len(payloads)])
                    sent[0] += 1
                stop.wait(max(0.0, 0.01 - (time.monotonic() - started)))

        def a_second_of_flood(_: int) -> None:
            stop.wait(1.0)  # ~flood_rate messages between two scrapes

        thread = threading.Thread(target=flood, daemon=True)
        flood_started = time.monotonic()
        thread.start()
        out["flood"] = _series(url, scrapes, a_second_of_flood)
        stop.set()
        thread.join()
        out["flood_messages_per_s"] = round(sent[0] / (time.monotonic() - flood_started))
    finally:
        server.stop()
        store.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--devices", type=int, nargs="+", default=[1000, 10_000])
    parser.add_argument("--scrapes", type=int, default=5)
    parser.add_argument("--rollouts", type=int, default=10)
    parser.add_argument("--flood-rate", type=float, default=5000.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        figures = [run(n, args.scrapes, args.rollouts, args.flood_rate, Path(tmp)) for n in args.devices]
    print(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
