"""``edge-agent selftest [--quick] [--out report.json]``: prove what the agent can do on this machine.

Runs every step of :mod:`agent.selftest.steps` in order, prints one pass/fail/skip line per step as it
finishes, writes the JSON report to ``--out`` and the Markdown report beside it, and exits 0 only if
no step failed (skips are not failures: each says why the step cannot run here). Engines are built in
a fresh scratch cache (``--workdir``, default a temporary directory removed afterwards) so the first
build of each is a real build and the second a real cache hit. docs/selftest.md is the guide.
"""

from __future__ import annotations

import argparse
import datetime as dt
import platform as host_platform
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from agent.errors import UsageError

if TYPE_CHECKING:
    from agent.selftest.step import StepResult

DEFAULT_OUT = Path("selftest-report.json")
#: A build that runs longer than this is killed (the step fails) so the self-test always ends.
BUILD_TIMEOUT_S = 300.0


def add_selftest_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``edge-agent selftest``."""
    parser.add_argument(
        "--quick",
        action="store_true",
        help="fewer calibration images, timed runs, stream frames and leak cycles (same steps)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT,
        help=f"JSON report; the Markdown goes beside it (default {DEFAULT_OUT})",
    )
    parser.add_argument(
        "--workdir",
        type=Path,
        help="keep the scratch engine cache and images here (default: a temporary directory)",
    )


def run_selftest(args: argparse.Namespace) -> int:
    """``edge-agent selftest``: 0 when no step failed, 1 otherwise."""
    from agent import __version__
    from agent.cli.build import quiet_logs

    if args.out.suffix != ".json":
        raise UsageError(
            f"--out {args.out}: give a .json file name (the Markdown report goes beside it as .md)"
        )
    quiet_logs()
    started = dt.datetime.now(dt.timezone.utc)
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)
        results, seconds = _run(args.workdir, args.quick)
    else:
        with tempfile.TemporaryDirectory(prefix="edge-agent-selftest-") as scratch:
            results, seconds = _run(Path(scratch), args.quick)
    from agent.selftest.report import report_document, summary, write_reports

    header = {
        "agent_version": __version__,
        "started": started.isoformat(timespec="seconds"),
        "seconds": seconds,
        "quick": bool(args.quick),
        "machine": f"{host_platform.node()} {host_platform.machine()} {host_platform.platform()}",
    }
    document = report_document(results, header)
    md_path = write_reports(document, args.out)
    counts = summary(results)
    print(
        f"{'ok' if document['ok'] else 'FAILED'}: {counts['pass']} passed, {counts['fail']} failed, "
        f"{counts['skip']} skipped in {seconds:.1f} s; reports {args.out} and {md_path}"
    )
    return 0 if document["ok"] else 1


def _run(work_dir: Path, quick: bool) -> tuple[list[StepResult], float]:
    import time

    from agent.engines.building.builder import EngineBuilder
    from agent.engines.settings import EngineConfig
    from agent.machine.platform import detect_platform
    from agent.selftest.report import step_line
    from agent.selftest.run import FULL, QUICK, SelfTestRun
    from agent.selftest.step import run_steps
    from agent.selftest.steps import all_steps

    started = time.monotonic()
    platform = detect_platform()
    builder = EngineBuilder(work_dir / "state", EngineConfig(build_timeout_s=BUILD_TIMEOUT_S), platform)
    run = SelfTestRun(platform=platform, builder=builder, work_dir=work_dir, sizes=QUICK if quick else FULL)
    results = run_steps(all_steps(), run, on_result=lambda r: print(step_line(r), flush=True))
    return list(results), time.monotonic() - started


def main() -> int:
    """Standalone entry (``python -m agent.cli.selftest``), same as ``edge-agent selftest``."""
    from agent.cli.help_format import CliParser
    from agent.errors import AgentError

    parser = CliParser(prog="edge-agent selftest", description=__doc__.splitlines()[0])
    add_selftest_arguments(parser)
    try:
        return run_selftest(parser.parse_args())
    except AgentError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
