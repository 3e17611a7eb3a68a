"""``edge-agent demo``: where its files go, and that a run leaves nothing behind unless asked to."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from agent.cli import _parser
from agent.demo.run import demo_workdir, run_demo


@pytest.fixture
def temp_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The directory ``tempfile.mkdtemp`` writes into for this test (what TMPDIR sets)."""
    root = tmp_path / "tmp"
    root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    return root


@pytest.mark.slow
def test_a_demo_run_removes_its_temporary_directory(temp_root: Path) -> None:
    # A short run: the verdict may fail (no second deploy in 3 s); the files must go either way.
    run_demo(duration=3.0)
    assert list(temp_root.iterdir()) == []


def test_keep_leaves_the_temporary_directory_with_its_files(temp_root: Path) -> None:
    with demo_workdir(None, keep=True) as where:
        (where / "lobby.avi").write_bytes(b"x")
    assert [p.name for p in where.iterdir()] == ["lobby.avi"]
    assert where.parent == temp_root


def test_the_temporary_directory_goes_even_when_the_demo_fails(temp_root: Path) -> None:
    seen: list[Path] = []

    def interrupted_demo() -> None:
        with demo_workdir(None, keep=False) as where:
            seen.append(where)
            (where / "agent.yaml").write_text("x")
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        interrupted_demo()
    assert not seen[0].exists()
    assert list(temp_root.iterdir()) == []


def test_a_workdir_the_user_named_is_kept(tmp_path: Path) -> None:
    with demo_workdir(tmp_path / "mine", keep=False) as where:
        (where / "agent.yaml").write_text("x")
    assert (tmp_path / "mine" / "agent.yaml").exists()


def test_keep_is_a_demo_option() -> None:
    assert _parser().parse_args(["demo", "--keep"]).keep is True
    assert _parser().parse_args(["demo"]).keep is False
