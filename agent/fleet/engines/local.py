"""The controller's engine desk reached in-process, without a broker: for ``edge-agent selftest``
(a downloaded engine loads on this device) and the builder tests.

:class:`LocalDeskRequests` hands each request to :meth:`EngineDesk.handle` as the controller's
MQTT thread would; :func:`local_download` stands in for the chunked pull: it copies the controller's
blob and checks its SHA-256, as the delivery fetch checks a pulled file.
"""

from __future__ import annotations

import shutil
import threading
from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel, ValidationError

from agent.errors import AgentError, HashMismatchError
from agent.fleet.engines.desk import EngineDesk
from agent.fsutil import sha256_file
from agent.protocol.engines import EngineFile
from agent.protocol.messages import CommandReply, JobStatus


class LocalDeskRequests:
    """:class:`~agent.engines.sharing.link.EngineRequests` answered by ``desk`` for ``device``."""

    def __init__(self, desk: EngineDesk, device: str) -> None:
        self.desk = desk
        self.device = device
        self.verbs: list[str] = []
        self.heard = threading.Event()  # set on every request (drops are sent from a thread)
        self.statuses: list[JobStatus] = []  # start-up jobs' statuses (no fleet view hears them here)

    def job_status(self, status: JobStatus) -> None:
        self.statuses.append(status)

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


def local_download(desk: EngineDesk) -> Callable[[EngineFile, Path, threading.Event | None], Path]:
    """``download(file, directory, cancel)``: the controller's blob copied, checked like a pull."""

    def download(file: EngineFile, directory: Path, cancel: threading.Event | None) -> Path:
        del cancel
        target = directory / f"{file.sha256}.part"
        shutil.copyfile(desk.store.blob_path(file.sha256), target)
        if sha256_file(target) != file.sha256:
            raise HashMismatchError(f"engine file {file.name} does not hash to the signed {file.sha256[:12]}")
        return target

    return download
