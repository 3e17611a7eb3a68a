"""A real controller engine desk (store, trust checks, signing) for the builder and desk tests, reached
in-process through :mod:`agent.fleet.engines.local` (what the broker adds is tested end to end in
tests/e2e/test_fleet_engines.py)."""

from __future__ import annotations

from pathlib import Path

from agent.fleet.controller.upload import UploadSink
from agent.fleet.engines.desk import EngineDesk
from agent.fleet.engines.settings import EngineShareSettings
from agent.fleet.engines.store import EngineStore
from agent.fleet.engines.trust import JobFacts
from agent.signing import Ed25519PrivateKey

ACTIVE_WITH_FIGURES = JobFacts(state="ACTIVE", shadow=True, probation=True)


def make_desk(
    root: Path,
    key: Ed25519PrivateKey | None,
    key_id: str = "ops",
    settings: EngineShareSettings | None = None,
) -> EngineDesk:
    settings = settings or EngineShareSettings()
    store = EngineStore(root, settings)
    return EngineDesk(
        settings,
        store,
        prefix="fleet/v1",
        signing_key=key,
        key_id=key_id if key is not None else None,
        publish=lambda _topic, _payload, _props: None,
        job_facts=lambda _device, _job: ACTIVE_WITH_FIGURES,
        sink=UploadSink(store.blobs),
    )
