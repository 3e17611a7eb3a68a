"""Resume across a SIGKILLed agent process, and a broker restart mid-transfer.

The crash test runs the device side in a real child process (this module, run with ``child``)
and kills it with SIGKILL half way; the record it left (bitmap and log) must name only chunks whose
bytes are on disk, and a new pull over the same ``partial/`` directory must finish while fetching
at most one window of chunks again (counted by the chunk server).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from agent.delivery.transfer.chunk_log import read_log
from agent.delivery.transfer.flusher import read_record
from agent.delivery.transfer.pull import fetch_model
from agent.demo.broker import Broker
from agent.fleet.chunks.server import ChunkServer
from agent.protocol.manifest import DeployManifest
from tests.delivery.transfer.transfer_rig import (
    KIB,
    MIB,
    Device,
    Rig,
    Slow,
    delivery_config,
    manifest_for,
    random_model,
)
from tests.waiting import patient, wait_until

CHUNK = 64 * KIB
WINDOW = 4
REPO_ROOT = Path(__file__).resolve().parents[3]


class Throttled(Slow):
    """Takes 10 ms per chunk, so a transfer lasts long enough to be interrupted half way."""

    delay_s = 0.01


def _fetch(dev: Device, manifest: DeployManifest, window: int = WINDOW, **config: float) -> Path:
    return fetch_model(
        manifest,
        dev.part_dir,
        lambda done, total: None,
        threading.Event(),
        link=dev.link,
        topics=dev.topics,
        config=delivery_config(chunk_window=window, **config),
    )


def _kill_child_when_served(
    rig: Rig,
    server: ChunkServer,
    manifest: DeployManifest,
    device_id: str,
    fraction: float,
    window: int | None = None,
) -> None:
    """Pull ``manifest`` in a child process (``python -m`` this module) and SIGKILL it once the
    server sent ``fraction`` of the model to ``device_id``."""
    manifest_file = rig.tmp_path / "manifest.json"
    manifest_file.write_text(manifest.model_dump_json())
    argv = [str(rig.broker.port), rig.prefix, device_id, str(rig.tmp_path / device_id), str(manifest_file)]
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.delivery.transfer.test_transfer_restart", "child", *argv]
        + ([] if window is None else [str(window)]),
        cwd=REPO_ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        wait_until(
            lambda: server.served_bytes(device_id) >= manifest.size * fraction or child.poll() is not None,
            timeout=60,
            what=f"{fraction:.0%} of the model served to the child",
        )
        assert child.poll() is None, child.stderr.read().decode() if child.stderr else ""
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait(patient(10))


def test_a_killed_agent_resumes_and_fetches_at_most_one_window_again(rig: Rig) -> None:
    model = random_model(rig.tmp_path / "m.bin", 4 * MIB)
    manifest = manifest_for(model, CHUNK)
    server = rig.server(Throttled)
    server.register(manifest, model)
    device_id = "dev-crash"
    _kill_child_when_served(rig, server, manifest, device_id, 0.5)
    served_before = server.served_bytes(device_id)
    assert served_before < manifest.size

    dev = rig.device(device_id)  # same id: the broker session (and any late chunk replies) carry over
    named = _recorded_chunks(dev.part_dir, manifest)
    # The flushes since the download opened went to the log, and every chunk the record names
    # is on disk with its bytes, before the new process re-hashes anything.
    assert read_log(dev.part_dir / f"{manifest.sha256}.log", manifest)
    part = (dev.part_dir / f"{manifest.sha256}.part").read_bytes()
    for i in named:
        assert hashlib.sha256(part[i * CHUNK : (i + 1) * CHUNK]).hexdigest() == manifest.chunks[i]
    path = _fetch(dev, manifest)

    assert path.read_bytes() == model.read_bytes()
    refetched = server.served_bytes(device_id) - manifest.size
    assert 0 <= refetched <= WINDOW * CHUNK
    # Resumed, not restarted: the second process asked for well under the whole model.
    assert server.served_bytes(device_id) - served_before < manifest.size


@pytest.mark.parametrize("killed_at", [0.25, 0.5, 0.75])
def test_a_pull_killed_early_midway_or_late_fetches_at_most_one_window_again(
    rig: Rig, killed_at: float
) -> None:
    """A window of 16 (flushes of 8, the other half on its way meanwhile), SIGKILLed when a
    quarter, half and three quarters of an 8 MiB model were served: since at most one window
    (1 MiB) is at risk, the record names chunks already, only chunks whose bytes are on disk, and
    the next process fetches at most 16 chunks again (a restart from nothing would fetch at least
    2 MiB again)."""
    window = 16
    model = random_model(rig.tmp_path / "m.bin", 8 * MIB)
    manifest = manifest_for(model, CHUNK)
    server = rig.server(Throttled)
    server.register(manifest, model)
    device_id = f"dev-quarter-{round(killed_at * 100)}"
    _kill_child_when_served(rig, server, manifest, device_id, killed_at, window)
    dev = rig.device(device_id)
    named = _recorded_chunks(dev.part_dir, manifest)
    assert named, "no flush was recorded before the kill"
    part = (dev.part_dir / f"{manifest.sha256}.part").read_bytes()
    for i in named:
        assert hashlib.sha256(part[i * CHUNK : (i + 1) * CHUNK]).hexdigest() == manifest.chunks[i]
    path = _fetch(dev, manifest, window)

    assert path.read_bytes() == model.read_bytes()
    refetched = server.served_bytes(device_id) - manifest.size
    assert 0 <= refetched <= window * CHUNK


def test_a_broker_restart_mid_transfer_is_survived(private_broker: Broker, tmp_path: Path) -> None:
    rig = Rig(private_broker, tmp_path)
    try:
        model = random_model(tmp_path / "m.bin", 3 * MIB)
        manifest = manifest_for(model, CHUNK)
        server = rig.server(Throttled)
        server.register(manifest, model)
        dev = rig.device()
        result: dict[str, object] = {}

        def run() -> None:
            try:
                result["path"] = _fetch(dev, manifest, chunk_timeout_s=1.0)
            except BaseException as exc:
                result["error"] = exc

        thread = threading.Thread(target=run)
        thread.start()
        wait_until(
            lambda: server.served_bytes(dev.id) >= manifest.size // 3, timeout=30, what="a third served"
        )
        private_broker.restart()
        thread.join(patient(60))

        assert not thread.is_alive()
        assert "error" not in result, result.get("error")
        path = result["path"]
        assert isinstance(path, Path)
        assert path.read_bytes() == model.read_bytes()
        assert dev.link.stats()["reconnects"] >= 1
        assert server.stats()["mqtt_connects"] >= 2
    finally:
        rig.close()


def _recorded_chunks(part_dir: Path, manifest: DeployManifest) -> set[int]:
    """The chunks the durable record names: the bitmap's, plus the log's."""
    have = read_record(part_dir / f"{manifest.sha256}.bitmap", part_dir / f"{manifest.sha256}.log", manifest)
    assert have is not None
    return {i for i, bit in enumerate(have) if bit}


def _child(argv: list[str]) -> None:
    """The device process of the crash tests: pull the manifest's model until killed."""
    port, prefix, device_id, state_dir, manifest_file, *window = argv
    broker = Broker(Path(state_dir) / "unused", port=int(port))  # address only; never started here
    manifest = DeployManifest.model_validate(json.loads(Path(manifest_file).read_text()))
    dev = Device(broker, prefix, device_id, Path(state_dir))
    _fetch(dev, manifest, int(window[0]) if window else WINDOW)
    dev.close()


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "child":
    _child(sys.argv[2:])
