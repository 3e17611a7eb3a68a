"""The deploy's progress display: one line per change when piped, a redraw on a terminal."""

from __future__ import annotations

import io

from agent.fleet.deploy_outcome import DeviceProgress
from agent.fleet.progress import ProgressView, progress_line
from agent.protocol.messages import JobState


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
