"""The settings every edge-agent process makes for itself: freed buffers kept, not faulted in anew."""

from __future__ import annotations

import os
import subprocess
import sys

from agent.machine.process import keep_freed_buffers

#: In a child process: 40 rounds of a window of 32 chunk-sized buffers, all freed together (as a
#: pull's window drains), then the minor page faults those rounds took. Before it, ``SETUP`` runs.
_ROUNDS = """
import resource
{setup}
source = b"x" * (256 * 1024)
window = [bytearray(source) for _ in range(32)]
del window
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(40):
    window = [bytearray(source) for _ in range(32)]
    del window
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""

_PAGES_PER_ROUND = 32 * 256 * 1024 // 4096


def _faults(setup: str, env: dict[str, str] | None = None) -> int:
    out = subprocess.run(
        [sys.executable, "-c", _ROUNDS.format(setup=setup)],
        capture_output=True, text=True, check=True, env=env,
    )  # fmt: skip
    return int(out.stdout.split()[-1])  # after whatever the setup printed


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}


def test_an_edge_agent_process_reuses_freed_chunk_buffers_instead_of_faulting_them_in_again() -> None:
    """The allocator's thresholds are set by the edge-agent entry point itself (here through
    ``--version``, which returns right after): a window of freed buffers is reused, where glibc's
    defaults hand it back to the kernel and fault every page in again the next round."""
    default = _faults("", _clean_env())
    agent = _faults(
        "from agent.cli import main\ntry:\n    main(['--version'])\nexcept SystemExit:\n    pass",
        _clean_env(),
    )
    # How often glibc's dynamic thresholds hand the window back varies with the machine (every
    # round here, a quarter of them on another), so the defaults are only held to several rounds.
    assert default > 5 * _PAGES_PER_ROUND, (default, agent)
    assert agent < _PAGES_PER_ROUND, (default, agent)  # not even one round's worth


def test_the_operators_own_allocator_tuning_is_left_alone() -> None:
    """Where the environment tunes glibc's allocator, the agent changes nothing of it."""
    assert not keep_freed_buffers({"MALLOC_TRIM_THRESHOLD_": "131072"})
    assert not keep_freed_buffers({"GLIBC_TUNABLES": "glibc.cpu.x86_shstk=0:glibc.malloc.trim_threshold=1"})
    env = {**_clean_env(), "MALLOC_TRIM_THRESHOLD_": "131072"}
    faults = _faults(
        "from agent.machine.process import keep_freed_buffers\nassert not keep_freed_buffers()", env
    )
    assert faults > 20 * _PAGES_PER_ROUND, faults
