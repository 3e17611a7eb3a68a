"""A long broker outage at full frame rate with durable results: bounded memory, bounded spool, no loss;
and a full disk that costs nothing but the results it cannot store.

Issue 8: the real daemon, a real mosquitto stopped and started again, RSS read from /proc, a real tmpfs.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from agent.demo.broker import Broker
from agent.protocol.messages import CommandReply, CommandRequest, ResultMessage, StatusMessage, decode, encode
from tests.e2e.daemon import AgentFiles, Daemon
from tests.mqtt_probe import Probe
from tests.small_disk import small_disk
from tests.waiting import patient

pytestmark = pytest.mark.slow

#: How long the outage goes on once the spool is at its cap (a few seconds into it at full rate):
#: all that time the device evicts at full rate, where an unbounded queue would grow by tens of MB
#: a second.
AT_CAP_S = 20.0
#: The daemon's RSS may never exceed this. It idles at ~130 MB here (Python, numpy, OpenCV, ONNX
#: Runtime); the outbox (64 results), the inbox (4 frames) and paho's queue are what may add to it.
#: Before the fix the outbox alone grew by tens of MB a second (a test run was stopped at this bound).
RSS_BOUND_MB = 300.0
MAX_ROWS = 3000


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024.0
    raise AssertionError(f"no VmRSS for {pid}")


def test_a_long_outage_at_full_rate_keeps_memory_and_spool_bounded_and_loses_only_what_policy_drops(
    tmp_path: Path, broker_factory: Callable[[Sequence[str]], Broker]
) -> None:
    device = f"outage-{uuid.uuid4().hex[:8]}"
    persist = tmp_path / "mosquitto-db"
    persist.mkdir()
    # Persistence and no per-client queue limit: the probe's subscription and everything queued for
    # it survive the broker's own restart, so what the probe misses is what the device never sent.
    broker = broker_factory(
        [
            "persistence true",
            f"persistence_location {persist}/",
            "autosave_interval 1",
            "max_queued_messages 0",
        ]
    )
    files = AgentFiles(tmp_path / "agent", broker.port, device, frames=60)
    stream = {"source": {"type": "file", "path": str(files.video), "loop": True, "realtime": False}}
    config = files.write_config(
        stream={**stream, "durable_results": True},
        spool={"max_rows": MAX_ROWS, "results_ttl_s": 3600.0},
        mqtt={"reconnect_min_s": 0.2, "reconnect_max_s": 1.0},
    )
    results_topic = f"fleet/v1/{device}/up/results/cam"
    telemetry_topic = f"fleet/v1/{device}/up/telemetry"
    probe = Probe(broker.host, broker.port, client_id=f"probe-{device}", session_expiry_s=600)
    probe.subscribe(f"fleet/v1/{device}/up/#")
    daemon = Daemon(config, tmp_path / "agent.log")
    rss: list[float] = []
    spool_rows: list[int] = []
    spool_path = files.root / "state" / "spool.sqlite"
    try:
        probe.wait_for_count(results_topic, 50, timeout=60)
        broker.stop()
        started = time.monotonic()
        at_cap: float | None = None
        while at_cap is None or time.monotonic() - at_cap < AT_CAP_S:
            rss.append(_rss_mb(daemon.proc.pid))
            # Fail fast (and spare the machine) instead of sampling a process on its way to gigabytes.
            assert rss[-1] < RSS_BOUND_MB, f"RSS {rss[-1]:.0f} MB after {len(rss) * 0.5:.1f} s of outage"
            if len(rss) % 10 == 0:  # the spool as another reader sees it (WAL: no lock taken from the writer)
                with contextlib.closing(sqlite3.connect(spool_path, timeout=5.0)) as db:
                    spool_rows.append(db.execute("SELECT COUNT(*) FROM outbox").fetchone()[0])
                if at_cap is None and spool_rows[-1] >= 0.9 * MAX_ROWS:
                    at_cap = time.monotonic()
            assert at_cap is not None or time.monotonic() - started < patient(60), (
                f"the spool never reached its cap: {spool_rows}"
            )
            time.sleep(0.5)
        outage_s = time.monotonic() - started
        broker.start()
        # Back online: the spool drains while frames keep coming at full rate.
        probe.wait_for(
            lambda ms: any(
                m.topic == telemetry_topic and json.loads(m.payload)["spool.rows"] < 200 for m in ms
            ),
            timeout=40,
        )
        rss.append(_rss_mb(daemon.proc.pid))
    finally:
        code = daemon.stop()
    probe.settle(1.0)
    probe.close()
    assert code == 0, daemon.log()[-3000:]
    assert max(rss) < RSS_BOUND_MB

    closed = next(e for e in daemon.events() if e.get("event") == "spool.closed")
    # The cap holds during the outage (the rows in flight when the broker went away come on top).
    assert max(spool_rows) <= MAX_ROWS + 20, spool_rows
    assert spool_rows[-1] >= 0.9 * MAX_ROWS  # and the spool really was at the cap
    # What the device produced: frames 0..last without a gap (a file source is never dropped from).
    received: dict[int, set[str]] = {}
    for m in probe.on_topic(results_topic):
        r = decode(ResultMessage, m.payload)
        received.setdefault(r.frame_index, set()).add(r.msg_id)
    assert all(len(ids) == 1 for ids in received.values())  # one msg_id per frame: published once
    db = sqlite3.connect(files.root / "state" / "spool.sqlite")
    left = {decode(ResultMessage, bytes(p)).frame_index for (p,) in db.execute("SELECT payload FROM outbox")}
    db.close()
    produced = range(max(received.keys() | left) + 1)
    missing = sorted(set(produced) - received.keys() - left)
    # Every result not dropped by policy arrived (or waits in the spool for the next start), and the
    # drops are exactly the counted ones: the oldest results of the outage, in one run.
    assert closed["evicted"] > 0, "the outage never reached the cap: lower MAX_ROWS"
    assert len(missing) == closed["evicted"]
    assert missing == list(range(missing[0], missing[0] + len(missing)))
    assert closed["dropped_write_failed"] == 0
    warnings = [e["event"] for e in daemon.events() if e.get("event", "").startswith("spool.cap")]
    assert warnings[0] == "spool.cap.reached"
    assert warnings.count("spool.cap.reached") <= 2  # once per episode, not per frame
    print(
        f"\noutage {outage_s:.0f}s: frames {len(produced)}, received {len(received)}, evicted "
        f"{closed['evicted']}, left in spool {len(left)}, RSS max {max(rss):.0f} MB "
        f"(first {rss[0]:.0f} MB), spool rows during the outage {spool_rows}"
    )


def test_a_full_disk_with_the_broker_stopped_and_started_costs_only_the_results_it_cannot_store(
    tmp_path: Path, broker_factory: Callable[[Sequence[str]], Broker]
) -> None:
    """The state directory on a real tmpfs filled to 0 bytes free: one warning, counters, and the
    device reconnects, publishes status and telemetry and answers commands (issue 8)."""
    device = f"full-{uuid.uuid4().hex[:8]}"
    broker = broker_factory([])
    prefix = f"fleet/v1/{device}"
    files = AgentFiles(tmp_path / "agent", broker.port, device, frames=60)
    stream = {"source": {"type": "file", "path": str(files.video), "loop": True, "realtime": True}}
    with small_disk(tmp_path / "disk", "16m") as disk:
        config = files.write_config(
            stream={**stream, "durable_results": True},
            state_dir=str(disk.path / "state"),
            mqtt={"reconnect_min_s": 0.2, "reconnect_max_s": 1.0},
        )
        daemon = Daemon(config, tmp_path / "agent.log")
        try:
            with Probe(broker.host, broker.port) as probe:
                probe.subscribe(f"{prefix}/up/#")
                probe.wait_for_count(f"{prefix}/up/results/cam", 10, timeout=60)
            disk.fill()
            broker.stop()
            time.sleep(3.0)  # ~90 frames whose durable results cannot be stored anywhere
            broker.start()
            with Probe(broker.host, broker.port) as probe:
                probe.subscribe(f"{prefix}/up/#")
                online = probe.wait_for(
                    lambda ms: any(
                        m.topic == f"{prefix}/up/status"
                        and decode(StatusMessage, m.payload).state == "online"
                        for m in ms
                    ),
                    timeout=20,
                )
                telemetry = probe.wait_for_count(f"{prefix}/up/telemetry", 1, timeout=10)
                probe.publish(
                    f"{prefix}/down/cmd/status",
                    encode(CommandRequest()),
                    response_topic=f"{prefix}/up/cmd/status",
                    correlation_data=b"full-disk",
                )
                [reply] = probe.wait_for_count(f"{prefix}/up/cmd/status", 1, timeout=20)
                # Connected again on a still-full disk: results go out from memory.
                full_disk_results = probe.wait_for_count(f"{prefix}/up/results/cam", 10, timeout=30)
                assert disk.free_bytes() == 0
                disk.free()
                # Space is back: durable results are stored and published again.
                count = len(probe.on_topic(f"{prefix}/up/results/cam"))
                probe.wait_for_count(f"{prefix}/up/results/cam", count + 10, timeout=30)
        finally:
            code = daemon.stop()
    assert code == 0, daemon.log()[-3000:]
    assert online
    assert json.loads(telemetry[0].payload)["spool.dropped_write_failed"] > 0
    assert decode(CommandReply, reply.payload).ok
    assert len(full_disk_results) >= 10
    events = daemon.events()
    names = [e.get("event") for e in events]
    assert names.count("spool.write.failed") == 1  # one warning per episode, not one per frame
    assert names.count("spool.write.recovered") == 1
    assert "pipeline.publish.failed" not in names
    assert "mqtt.network.failed" not in names  # the session counter no longer needs a disk write
    assert not [e for e in events if e.get("level") == "error"], [
        e for e in events if e.get("level") == "error"
    ]
