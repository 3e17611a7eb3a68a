"""The agent's launcher: at each start, decide which release runs, and put a failed update back.

Run by the unit from the last confirmed release (``releases/good``), so a release that fails at import
never breaks the launcher; the standard library only (it must not import pydantic or the agent)::

    releases/good/bin/python -I -m agent.lifecycle.release.launcher RELEASES -- -m agent run -c FILE
    releases/<v>/bin/python -I -m agent.lifecycle.release.launcher RELEASES --adopt

With no update pending it starts ``current``. With one pending it counts the candidate's start and
starts it, unless the candidate has had its starts or its time: then ``current`` goes back to the
previous release, the reason is recorded (crashed at import, exited N times, not confirmed within T
s), and the previous release starts; it reports the job ROLLED_BACK when the job resumes. The chosen
release replaces this process (``exec``), so systemd's main process, notifications and watchdog are
the agent's.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import NoReturn

from agent.fsutil import atomic_write_json
from agent.lifecycle.release.layout import (
    COMPLETE,
    CONFIRMING,
    CURRENT,
    GOOD,
    RELEASE_ENV,
    RELEASES_ENV,
    REVERTING,
    PendingUpdate,
    Releases,
    stop_point,
)


def exhausted(update: PendingUpdate, now: float) -> str | None:
    """Why the candidate of ``update`` must not be started again; None while it may."""
    if update.attempts >= update.max_attempts:
        if update.started == 0:
            return f"crashed at import: started {update.attempts} times and never reached start-up"
        return f"exited {update.attempts} times without being confirmed"
    if now >= update.deadline:
        return f"not confirmed within {update.deadline_s:g} s"
    return None


def choose(releases: Releases, now: float) -> str:
    """The release to start now, after finishing whatever a kill interrupted."""
    try:
        update = releases.read_update()
    except (ValueError, TypeError) as exc:
        _say(f"{exc}: starting the last good release")
        good = releases.link(GOOD)
        if good is not None:
            return good
        update = None
    if update is None:
        current = releases.link(CURRENT)
        if current is not None and releases.is_complete(current):
            return current
        good = releases.link(GOOD)
        if good is None:
            raise SystemExit(f"edge-agent launcher: no release in {releases.root} (docs/operations.md)")
        return good
    if update.state == CONFIRMING:
        releases.finish_confirm(update)
        return update.candidate
    if update.state == REVERTING:
        releases.finish_revert(update)
        return update.previous
    # A kill between recording the update and switching the link: finish the switch.
    releases.switch(CURRENT, update.candidate)
    reason = exhausted(update, now)
    if reason is not None:
        update.state, update.reason = REVERTING, reason
        releases.write_update(update)
        stop_point("revert-recorded")
        releases.finish_revert(update)
        _say(f"release {update.candidate} put back ({reason}); starting {update.previous}")
        return update.previous
    update.attempts += 1
    releases.write_update(update)
    stop_point("attempt-counted")
    _say(f"starting release {update.candidate} on trial, start {update.attempts} of {update.max_attempts}")
    return update.candidate


def adopt(releases: Releases) -> str:
    """Make the release this interpreter runs from current and good (the first install, by hand)."""
    prefix = Path(sys.prefix).resolve()
    if prefix.parent != releases.root.resolve():
        raise SystemExit(f"edge-agent launcher: {prefix} is not a release under {releases.root}")
    if releases.read_update() is not None:
        raise SystemExit("edge-agent launcher: an update is in progress; adopt once it ended")
    atomic_write_json(prefix / COMPLETE, {"version": prefix.name, "adopted": True, "wheels": []})
    releases.switch(CURRENT, prefix.name)
    releases.switch(GOOD, prefix.name)
    return prefix.name


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # Everything after "--" is the agent's, passed on untouched.
    ours, args = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(prog="python -m agent.lifecycle.release.launcher")
    parser.add_argument("releases", type=Path, help="the releases directory ({state_dir}/releases)")
    parser.add_argument(
        "--adopt", action="store_true", help="make this interpreter's release current and good"
    )
    options = parser.parse_args(ours)
    releases = Releases(options.releases)
    if options.adopt:
        _say(f"adopted release {adopt(releases)}")
        return 0
    return start(releases, choose(releases, time.time()), args)


def start(releases: Releases, version: str, args: list[str]) -> NoReturn:
    """Replace this process by ``version``'s Python with ``args``: systemd's main process, its
    notifications and watchdog are the agent's."""
    python = releases.python(version)
    env = dict(os.environ, **{RELEASE_ENV: version, RELEASES_ENV: str(releases.root)})
    sys.stderr.flush()
    os.execve(python, [str(python), *args], env)  # noqa: S606 (the unit's arguments, no shell)


def _say(line: str) -> None:
    print(f"edge-agent launcher: {line}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
