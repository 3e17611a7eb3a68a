"""The deploy's progress display: one line per change when piped, a redraw on a terminal."""

from __future__ import annotations

import io
import re
import time

from agent.fleet.cli.progress import ProgressView, progress_line
from agent.fleet.deploy.outcome import DeviceProgress
from agent.protocol.messages import JobState, ProbationFigures, RunsInfo


def _p(device: str, state: JobState | None, history: list[JobState], **fields: object) -> DeviceProgress:
    return DeviceProgress(device, bytes_total=1000, state=state, history=history, **fields)  # type: ignore[arg-type]


def test_piped_output_has_a_line_per_state_including_those_passed_between_polls() -> None:
    out = io.StringIO()
    view = ProgressView(out, tty=False)
    view.update([_p("jet-1", None, [])])
    view.update([_p("jet-1", JobState.DOWNLOADING, [JobState.QUEUED, JobState.DOWNLOADING], bytes_done=400)])
    view.update([_p("jet-1", JobState.DOWNLOADING, [JobState.QUEUED, JobState.DOWNLOADING], bytes_done=450)])
    history = [
        JobState.QUEUED,
        JobState.DOWNLOADING,
        JobState.VERIFYING,
        JobState.BUILDING,
        JobState.REJECTED,
    ]
    view.update([_p("jet-1", JobState.REJECTED, history, error_code="bad_onnx", error="truncated")])

    lines = out.getvalue().splitlines()
    assert [line.split()[1] for line in lines] == [
        "waiting",
        "QUEUED",
        "DOWNLOADING",
        "VERIFYING",
        "BUILDING",
        "REJECTED",
    ]
    assert "40%" in lines[2]
    assert lines[-1].endswith("bad_onnx: truncated")


def test_terminal_output_redraws_every_device_in_place() -> None:
    out = io.StringIO()
    view = ProgressView(out, tty=True, min_interval_s=0.0)
    devices = [_p("a", JobState.QUEUED, [JobState.QUEUED]), _p("bb", None, [])]
    view.update(devices)
    view.update(devices)
    text = out.getvalue()
    assert text.count("\x1b[2F") == 1  # back up two lines before the second drawing
    assert text.count("\n") == 4


def test_download_progress_is_the_devices_report_not_the_bytes_served() -> None:
    # Served bytes can be lost or joined by another server's: only the device knows what it has.
    p = _p("a", JobState.DOWNLOADING, [JobState.DOWNLOADING], bytes_done=100, served=600)
    assert p.fraction == 0.1
    assert " 10%  100 B / 1000 B" in progress_line(p)


def test_an_unknown_device_says_so_instead_of_waiting_at_zero() -> None:
    waited = _p("jet-9", None, [], unknown=True)
    assert "unknown device: no retained status yet" in progress_line(waited)
    skipped = _p("jet-9", None, [], unknown=True, skipped=True)
    assert progress_line(skipped).split()[1] == "unknown"
    assert "%" not in progress_line(skipped)


def test_terminal_redraw_carries_only_its_own_escapes_whatever_the_device_sent() -> None:
    out = io.StringIO()
    view = ProgressView(out, tty=True, min_interval_s=0.0)
    evil = "\x1b[1A\x1b[2K\rjet-01  ACTIVE 100%\n\u202e"
    devices = [
        _p("a", JobState.REJECTED, [JobState.REJECTED], error_code=evil, error=evil * 1000),
        _p("b", JobState.QUEUED, [JobState.QUEUED], malformed=2),
    ]
    view.update(devices)
    view.update(devices)
    text = out.getvalue()
    own = text.replace("\x1b[2K", "").replace("\x1b[2F", "")
    assert "\x1b" not in own
    assert "\r" not in own
    assert "\u202e" not in own
    assert text.count("\n") == 4  # two lines per drawing: nothing the device sent added one
    assert max(len(line) for line in own.splitlines()) < 200
    assert "(2 malformed message(s) from it)" in own


def test_a_long_phase_shows_how_long_it_ran_and_how_long_is_left() -> None:
    """Issue 22.8: 60 s of PROBATION showed one unchanging line."""
    now = time.monotonic()
    probation = _p("jet-1", JobState.PROBATION, [JobState.PROBATION], state_since=now - 12.4)
    shadow = _p("jet-2", JobState.SHADOW, [JobState.SHADOW], state_since=now - 75)
    reported = ProbationFigures(elapsed_s=5.0, probation_s=300.0)
    own_length = _p("jet-3", JobState.PROBATION, [], state_since=now - 100, probation=reported)

    assert progress_line(probation, now=now, probation_s=60.0).endswith(
        "probation 12 s of 1 min 00 s, 48 s left"
    )
    assert progress_line(probation, now=now + 50, probation_s=60.0).endswith(
        "probation 1 min 02 s of 1 min 00 s, ending"
    )
    assert progress_line(probation, now=now).endswith("probation 12 s")  # its length unknown
    assert progress_line(shadow, now=now).endswith("shadow 1 min 15 s")
    assert progress_line(own_length, now=now, probation_s=60.0).endswith("of 5 min 00 s, 3 min 20 s left")


def test_piped_output_prints_a_long_phase_again_as_its_clock_moves() -> None:
    out = io.StringIO()
    view = ProgressView(out, tty=False, probation_s=60.0)
    p = _p("jet-1", JobState.PROBATION, [JobState.PROBATION], state_since=time.monotonic())
    view.update([p])
    view.update([p])  # same state, same ten seconds: nothing new
    p.state_since -= 10.2  # the phase has run ten seconds more
    view.update([p])

    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    # ten seconds on (and a little more on a loaded machine)
    assert re.search(r"probation 1\d s of 1 min 00 s, [45]\d s left$", lines[1]), lines[1]


def test_a_line_of_the_command_never_lands_on_an_unterminated_progress_line() -> None:
    """Issue 22.8: "0 B / 239.1 KiBdeploy: job ..." on a terminal."""
    out = io.StringIO()
    view = ProgressView(out, tty=True, min_interval_s=0.0)
    p = _p("jet-1", JobState.QUEUED, [JobState.QUEUED])
    view.update([p])  # one device: drawn with \r, no newline
    view.say("deploy: job j-1 (sequence 1): m v1")
    view.update([p])  # a fresh line below the text, not over it

    text = out.getvalue()
    assert "1000 B\ndeploy: job j-1" in text.replace(" \n", "\n")
    assert text.endswith("deploy: job j-1 (sequence 1): m v1\n\r" + progress_line(p)) or text.endswith(
        "deploy: job j-1 (sequence 1): m v1\n" + progress_line(p)
    )


def test_an_active_device_running_another_precision_than_asked_says_so() -> None:
    runs = RunsInfo(requested="int8", precision="fp32", source="built", fallback="INT8 accuracy guard: ...")
    done = [JobState.BUILDING, JobState.ACTIVE]
    timings = {"build": 2.0}
    line = progress_line(_p("jet-1", JobState.ACTIVE, done, timings_s=timings, runs=runs))
    assert line.endswith("  in 2.0 s  runs fp32, int8 asked"), line
    asked = RunsInfo(requested="int8", precision="int8", source="built")
    assert progress_line(_p("jet-1", JobState.ACTIVE, done, timings_s=timings, runs=asked)).endswith(
        "in 2.0 s"
    )
