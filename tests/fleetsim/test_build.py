"""The simulated engine build (agent/fleetsim/build.py) against the real controller's engine desk.

Six simulated devices, two fingerprints (``hw`` label: Orin NX and AGX Orin alternate), a one-second
build stand-in, rollouts with shadow and probation (what the trust rules ask before an engine is
shared). With sharing on, a canary rollout of one device per fingerprint builds each engine once and
offers it after ACTIVE; once both are stored, the rollout to the other four devices downloads them.
(One rollout in waves races: the next wave may ask before the canary's upload is stored, and then
builds; the benchmark gives its waves a soak for that.) With sharing off, every device builds. The
counters the benchmark reports are the ones checked here.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.engines.cache.key import engine_cache_key
from agent.engines.sharing.cache import platform_fingerprint
from agent.fleetsim.build import engine_identity, sim_platform
from agent.machine.jetson_files import jetpack_for_l4t, parse_tegra_release
from tests.fleet.operator_side import unique_prefix
from tests.fleetsim.controller_rig import ControllerRig

DEVICES = 6
FLEET_ARGS = ("--label", "hw=orin-nx,orin-agx", "--build-seconds", "1")


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[ControllerRig]:
    made = ControllerRig(tmp_path, devices=DEVICES, prefix=unique_prefix(), fleet_args=FLEET_ARGS)
    try:
        yield made
    finally:
        made.close()


def _key_and_fingerprint(hw: str, *, upgraded: bool = False) -> tuple[str, str]:
    identity = engine_identity(sim_platform({"hw": hw}, upgraded=upgraded), "ab" * 32)
    return engine_cache_key(identity), platform_fingerprint(identity)


def test_each_board_and_each_jetpack_is_its_own_engine_key() -> None:
    nx, agx = _key_and_fingerprint("orin-nx"), _key_and_fingerprint("orin-agx")
    upgraded = _key_and_fingerprint("orin-nx", upgraded=True)
    assert len({nx[0], agx[0], upgraded[0]}) == 3
    assert nx[1] == "tensorrt 8.6.2 / Orin NX 8.7 / gpu / L4T R36.3.0"
    assert agx[1] == "tensorrt 8.6.2 / AGX Orin 8.7 / gpu / L4T R36.3.0"
    assert upgraded[1] == "tensorrt 10.3.0 / Orin NX 8.7 / gpu / L4T R36.4.0"


def test_each_simulated_release_is_spelled_as_a_jetson_reads_it() -> None:
    for upgraded in (False, True):
        platform = sim_platform({"hw": "orin-nx"}, upgraded=upgraded)
        major, revision = platform.l4t_release.removeprefix("R").split(".", 1)
        line = f"# R{major} (release), REVISION: {revision}, GCID: 1, BOARD: generic, EABI: aarch64"
        assert parse_tegra_release(line) == platform.l4t_release
        assert jetpack_for_l4t(platform.l4t_release) == platform.jetpack


def _rollout(rig: ControllerRig, devices: list[str], *, share: bool, name: str) -> None:
    body = {
        "rollout_id": name,
        "devices": devices,
        "waves": "100%",
        "max_failed": "0",
        "shadow": {"frames": 10, "min_agreement": 0.9},
        "probation_s": 1.0,
        "share_engines": share,
    }
    started = rig.start(body)
    status = rig.wait_final(started["rollout_id"])
    assert status["state"] == "DONE", status


def _on_v2(devices: dict[str, Any]) -> bool:
    return all(x["slots"]["main"] == "cls:2" for x in devices.values())


def _per_fingerprint(devices: dict[str, Any], what: str) -> Counter[str]:
    totals: Counter[str] = Counter()
    for device in devices.values():
        for fingerprint, row in device["engines"]["by_fingerprint"].items():
            totals[fingerprint] += row.get(what, 0)
    return totals


def test_with_sharing_each_fingerprint_is_built_once_and_downloaded_by_the_rest(rig: ControllerRig) -> None:
    canaries = rig.ids[:2]  # one device of each fingerprint: the labels alternate
    _rollout(rig, canaries, share=True, name="canary")
    rig.wait_devices(
        lambda d: all(d[c]["engines"]["uploaded"] == 1 for c in canaries), "both canaries' engines stored"
    )
    _rollout(rig, rig.ids[2:], share=True, name="rest")
    devices = rig.wait_devices(_on_v2, "every device on cls:2")
    builds = _per_fingerprint(devices, "builds")
    downloads = _per_fingerprint(devices, "downloads")
    assert len(builds) == 2, builds  # two fingerprints, two engine keys
    assert all("Orin NX" in fp or "AGX Orin" in fp for fp in builds)
    assert set(builds.values()) == {1}, builds
    assert downloads == Counter(dict.fromkeys(builds, 2)), downloads
    engines = [d["engines"] for d in devices.values()]
    assert sum(e["build_s"] for e in engines) == 2.0
    assert sum(e["uploaded"] for e in engines) == 2
    assert sum(e["download_bytes"] for e in engines) == 4 * 4096
    assert all(devices[c]["engines"]["builds"] == 1 for c in canaries)
    assert all(devices[d]["engines"]["asked"] == 1 for d in rig.ids)


def test_without_sharing_every_device_builds(rig: ControllerRig) -> None:
    _rollout(rig, list(rig.ids), share=False, name="unshared")
    devices = rig.wait_devices(_on_v2, "every device on cls:2")
    assert sum(_per_fingerprint(devices, "builds").values()) == DEVICES
    assert all(d["engines"]["downloads"] == 0 and d["engines"]["asked"] == 0 for d in devices.values())
    assert sum(d["engines"]["build_s"] for d in devices.values()) == DEVICES * 1.0


def test_devices_missing_the_same_key_at_once_build_it_once_per_fingerprint(rig: ControllerRig) -> None:
    # One wave to all six devices: three of each fingerprint miss the same key at the same moment.
    # The first asker of each key is told to build it (its claim); the other two wait, then download.
    _rollout(rig, list(rig.ids), share=True, name="all-at-once")
    devices = rig.wait_devices(_on_v2, "every device on cls:2")
    builds = _per_fingerprint(devices, "builds")
    downloads = _per_fingerprint(devices, "downloads")
    assert len(builds) == 2, builds
    assert set(builds.values()) == {1}, builds
    assert downloads == Counter(dict.fromkeys(builds, 2)), downloads
    engines = [d["engines"] for d in devices.values()]
    assert sum(e["waited"] for e in engines) == 4  # every downloader was told "being built by"
    assert sum(e["uploaded"] for e in engines) == 2
