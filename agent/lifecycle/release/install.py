"""Install an agent release side by side: a new virtual environment, pip from the checked wheels only.

The environment sees the system's site-packages (``--system-site-packages``): on a Jetson, JetPack's
TensorRT and CUDA Python bindings live there (apt's python3-libnvinfer) and no wheel carries them.
pip runs offline (``--no-index``) on a directory holding exactly the release's wheels, each checked
against the release's SHA-256 first, so pip can install nothing else; ``--require-hashes`` would check
the same hashes again and refuse a dependency the system already provides, which is the point here.
A release is complete once ``.complete`` is written inside it, last: a directory without it is what a
kill left and is installed again from scratch.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from agent.fsutil import atomic_write_json
from agent.lifecycle.release.layout import COMPLETE, CURRENT, GOOD, Releases, stop_point
from agent.lifecycle.release.wheels import WheelCache, link_or_copy
from agent.protocol.delivery_errors import AgentInstallFailedError, JobCancelledError
from agent.protocol.device_targets import AgentRelease

#: How much of pip's error output a FAILED job carries.
MAX_REASON_CHARS = 600


def install_release(
    releases: Releases,
    cache: WheelCache,
    release: AgentRelease,
    artifacts: Mapping[str, Path],
    *,
    job_id: str,
    timeout_s: float,
    cancel: threading.Event,
) -> None:
    """Install ``release`` under ``releases`` unless it is complete; the running release is never touched."""
    if releases.is_complete(release.version):
        return
    if release.version in {releases.link(CURRENT), releases.link(GOOD)}:
        raise AgentInstallFailedError(
            f"release {release.version} is in use but incomplete; reinstall it by hand"
        )
    wheels = [cache.take(wheel, artifacts) for wheel in release.wheels]
    target = releases.release_dir(release.version)
    staging = releases.root / f".staging-{release.version}"
    for leftover in (target, staging):
        shutil.rmtree(leftover, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        for wheel in wheels:
            link_or_copy(wheel, staging / wheel.name)
        deadline = time.monotonic() + timeout_s
        venv = [sys.executable, "-m", "venv", "--system-site-packages", str(target)]
        run_bounded(venv, deadline, cancel, "venv")
        stop_point("venv-created")
        pip = [str(releases.python(release.version)), "-m", "pip", "install", "--isolated", "--no-index"]
        pip += ["--no-cache-dir", "--disable-pip-version-check", "--no-input", "--find-links", str(staging)]
        run_bounded([*pip, f"{release.distribution}=={release.version}"], deadline, cancel, "pip")
        stop_point("pip-done")
        # pip does not fsync what it writes: without this a power cut could keep .complete and lose files.
        os.sync()
        record = {"version": release.version, "job_id": job_id, "wheels": [w.sha256 for w in release.wheels]}
        atomic_write_json(target / COMPLETE, record)
    except BaseException:
        shutil.rmtree(target, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def run_bounded(command: Sequence[str], deadline: float, cancel: threading.Event, what: str) -> None:
    """Run ``command`` until it ends, ``deadline`` passes or ``cancel`` is set; its error as the failure.

    pip reads no configuration file (``PIP_CONFIG_FILE`` = the null device; ``--isolated`` alone still
    reads the global one): a site's find-links or constraints cannot add to what the release names."""
    env = dict(os.environ, PIP_CONFIG_FILE=os.devnull)
    with tempfile.TemporaryFile() as output:
        process = subprocess.Popen(
            command, stdout=output, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
        )
        try:
            while True:
                try:
                    code = process.wait(timeout=0.5)
                    break
                except subprocess.TimeoutExpired:
                    if cancel.is_set():
                        raise JobCancelledError(f"{what} stopped: the job was cancelled") from None
                    if time.monotonic() >= deadline:
                        raise AgentInstallFailedError(
                            f"{what} took longer than the install may take"
                        ) from None
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
        if code != 0:
            output.seek(0)
            raise AgentInstallFailedError(f"{what} failed (exit {code}): {_reason(output.read())}")


def _reason(output: bytes) -> str:
    """pip's ERROR lines (else its last lines), bounded."""
    lines = output.decode("utf-8", "replace").splitlines()
    errors = [line.strip() for line in lines if line.startswith("ERROR:")]
    reason = " ".join(errors or [line.strip() for line in lines[-5:]])
    return reason[:MAX_REASON_CHARS]
