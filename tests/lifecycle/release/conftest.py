"""Fixtures of the release tests: the wheels built once per session, a device with its first release."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.lifecycle.release.releases import (
    ABSENT,
    BASE_VERSION,
    EXTRA,
    Built,
    Device,
    build_extra_wheel,
    build_wheel,
    crashing_later,
    environment,
    failing_at_import,
    install_first,
    needing,
    system_site,
)


@pytest.fixture(scope="session")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    out = tmp_path_factory.mktemp("agent-wheels")
    wheels = {
        BASE_VERSION: build_wheel(out, BASE_VERSION),
        "1.0.1": build_wheel(out, "1.0.1"),
        "1.0.2": build_wheel(out, "1.0.2", failing_at_import),
        "1.0.3": build_wheel(out, "1.0.3", crashing_later),
        "1.0.4": build_wheel(out, "1.0.4", needing(ABSENT)),
        "1.0.5": build_wheel(out, "1.0.5", needing(EXTRA)),
        "1.0.6": build_wheel(out, "1.0.6", needing(EXTRA)),
        "extra": build_extra_wheel(out),
    }
    return Built(wheels, system_site(out))


@pytest.fixture
def device(built: Built, tmp_path: Path) -> Device:
    state = tmp_path / "state"
    state.mkdir()
    delivered = tmp_path / "delivered"
    delivered.mkdir()
    env = environment(built.site)
    install_first(state, built.wheels[BASE_VERSION].parent, env)
    return Device(state, env, delivered, built)
