"""A real controller engine desk (store, trust checks, signing) reached in-process, for builder tests.

:class:`DeskRequests` hands each request to :meth:`EngineDesk.handle` as the controller's MQTT
thread would (what the broker adds is tested end to end in tests/e2e/test_fleet_engines.py), and
:func:`blob_download` stands in for the chunked pull: it copies the controller's blob and checks
its SHA-256 as the delivery fetch does.
"""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

from pydantic import BaseModel, ValidationError

from agent.engines.fleet_cache import DownloadFn
from agent.errors import AgentError, HashMismatchError
from agent.fleet.engines.desk import EngineDesk
from agent.fleet.engines.settings import EngineShareSettings
from agent.fleet.engines.store import EngineStore
from agent.fleet.engines.trust import JobFacts
from agent.fsutil import sha256_file
from agent.protocol.engines import EngineFile
from agent.protocol.messages import CommandReply
from agent.signing import Ed25519PrivateKey

ACTIVE_WITH_FIGURES = JobFacts(state="ACTIVE", shadow=True, probation=True)


def make_desk(
    root: Path,
    key: Ed25519PrivateKey | None,
    key_id: str = "ops",
    settings: EngineShareSettings | None = None,
) -> EngineDesk:
    settings = settings or EngineShareSettings()
    return EngineDesk(
        settings,
        EngineStore(root, settings),
        prefix="fleet/v1",
        signing_key=key,
        key_id=key_id if key is not None else None,
        publish=lambda _topic, _payload, _props: None,
        job_facts=lambda _device, _job: ACTIVE_WITH_FIGURES,
    )


class DeskRequests:
    """:class:`~agent.engines.fleet_link.EngineRequests` answered by ``desk`` for ``device``."""

    def __init__(self, desk: EngineDesk, device: str) -> None:
        self.desk = desk
        self.device = device
        self.verbs: list[str] = []
        self.heard = threading.Event()  # set on every request (drops are sent from a thread)

    def request(
        self,
        verb: str,
        payload: bytes | BaseModel,
        timeout_s: float,
        user_properties: dict[str, str] | None = None,
    ) -> CommandReply | None:
        del timeout_s
        data = payload.model_dump_json().encode() if isinstance(payload, BaseModel) else payload
        self.verbs.append(verb)
        try:
            result = self.desk.handle(self.device, verb, data, dict(user_properties or {}))
            reply = CommandReply(command=verb, ok=True, result=result)
        except (AgentError, ValidationError, ValueError) as exc:
            code = exc.code if isinstance(exc, AgentError) else "bad_request"
            reply = CommandReply(command=verb, ok=False, error_code=code, error=str(exc))
        self.heard.set()
        return reply


def blob_download(desk: EngineDesk) -> DownloadFn:
    """``download(file, directory, cancel)`` copying the controller's blob, checked like a pull."""

    def download(file: EngineFile, directory: Path, cancel: threading.Event | None) -> Path:
        del cancel
        target = directory / f"{file.sha256}.part"
        shutil.copyfile(desk.store.blob_path(file.sha256), target)
        if sha256_file(target) != file.sha256:
            raise HashMismatchError(f"engine file {file.name} does not hash to the signed {file.sha256[:12]}")
        return target

    return download
