"""Stands in for the agent's composition root and job runner in the release tests.

Run by a release's own Python (the launcher starts it, as it starts ``-m agent run`` on a device), so
it imports the agent of that release: it builds the ``_agent`` target with a health reading from a
file the test writes, starts it, and runs the one job the test described, resuming it after every
restart the way the job runner does (every step again; each notices on disk what it already did).
It records each start and each job status in files, and serves until SIGTERM.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from pathlib import Path

from agent.delivery.jobs.steps import GuardReporter, JobReporter
from agent.errors import AgentError
from agent.lifecycle.health import HealthReading
from agent.lifecycle.release.target import AgentReleaseTarget
from agent.protocol.delivery_errors import JobCancelledError, RolledBackError, rejects
from agent.protocol.manifest import DeployManifest

STATE = Path(sys.argv[1])
JOB = json.loads((STATE / "job.json").read_text())
STOPPING = threading.Event()


def health() -> HealthReading:
    # The test names the releases that never connect: the reading taken before an update is the
    # running release's (connected), the candidate's is not.
    path = STATE / "health.json"
    offline = json.loads(path.read_text())["offline_in"] if path.exists() else []
    return HealthReading(
        connected=target.running not in offline,
        streams_flowing=frozenset({"cam"}),
        streams=frozenset({"cam"}),
        slots_failing=frozenset(),
    )


def record(name: str, entry: dict[str, object]) -> None:
    with open(STATE / name, "a") as out:
        out.write(json.dumps(entry) + "\n")
        out.flush()
        os.fsync(out.fileno())


def status(state: str, **extra: object) -> None:
    record("statuses.jsonl", {"state": state, "release": target.running, **extra})


signal.signal(signal.SIGTERM, lambda *_: STOPPING.set())
target = AgentReleaseTarget(STATE, health, confirm_s=JOB["confirm_s"], poll_s=0.1)
on_trial = target.start()
record("starts.jsonl", {"release": target.running, "pid": os.getpid(), "on_trial": on_trial})

if not (STATE / "done.json").exists():
    document = Path(JOB["document"])
    manifest = DeployManifest.model_validate(JOB["manifest"])
    artifacts = {name: Path(path) for name, path in JOB["artifacts"].items()}
    reporter = JobReporter(lambda fraction: None, STOPPING)
    guard = GuardReporter(
        lambda state: status(state.value), lambda *_: None, STOPPING, job_id=manifest.job_id
    )
    end: dict[str, object] | None = None
    try:
        status("VERIFYING")
        target.verify(document, manifest)
        status("BUILDING")
        target.install(document, artifacts, manifest, reporter)
        target.apply(document, manifest, guard)
        end = {"state": "ACTIVE"}
    except JobCancelledError:
        end = None  # stopping: the job resumes in the release that starts next
    except RolledBackError as exc:
        end = {"state": "ROLLED_BACK", "code": exc.code, "error": str(exc)}
    except AgentError as exc:
        end = {"state": "REJECTED" if rejects(exc) else "FAILED", "code": exc.code, "error": str(exc)}
    if end is not None:
        end["release"] = target.running
        status(str(end["state"]), code=end.get("code"))
        (STATE / "done.json.tmp").write_text(json.dumps(end))
        os.replace(STATE / "done.json.tmp", STATE / "done.json")

record("infos.jsonl", {"pid": os.getpid(), **target.info().model_dump()})
while not STOPPING.wait(0.2):
    pass
target.stop()
