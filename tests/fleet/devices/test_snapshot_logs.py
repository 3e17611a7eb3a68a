"""``fleet snapshot`` and ``fleet logs``: a wrong flag is named before anything is sent."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.cli import main


def test_wrong_flags_are_named_and_nothing_is_sent(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Port 9 (discard): nothing listens there, so reaching the broker would fail differently.
    broker = ["--broker", "127.0.0.1:9"]
    cases = [
        (["fleet", "logs", "d1", "-n", "5000", *broker], "error: --lines must be 1 to 1000"),
        (["fleet", "logs", "d1", "-n", "0", *broker], "error: --lines must be 1 to 1000"),
        (["fleet", "logs", "d1", "--follow", "--interval", "0", *broker], "error: --interval must be"),
        (
            ["fleet", "snapshot", "d1", "-o", str(tmp_path / "x.jpg"), "--max-dimension", "4", *broker],
            "error: --max-dimension must be 16 to 8192 pixels",
        ),
        (["fleet", "snapshot", "d1", "-o", str(tmp_path), *broker], f"error: -o {tmp_path} is a directory"),
    ]
    for argv, start in cases:
        assert main(argv) == 1, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert err, argv
        assert err[0].startswith(start), (argv, err)
    assert not (tmp_path / "x.jpg").exists()
