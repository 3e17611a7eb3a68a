"""tools/install-controller.sh run against a temporary root, as docs/controller-install.md runs it on /.

What systemd/edge-fleet-controller.service needs is checked three ways: owners and modes as stat
reports them; the kernel's own answer, from a child chrooted into the root as the service user,
that loads the installed controller.yaml, its signing key and console token with the controller's
own code (and, as another user, is refused); and ``systemd-analyze verify`` of the installed unit.
The script adds the user through ``useradd --prefix``, so this machine's /etc/passwd is untouched.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.unit_files import analyze_verify, read_unit
from tests.waiting import patient

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tools" / "install-controller.sh"
USER = "edge-fleet-controller"
ETC = Path("/etc") / USER

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("useradd") is None,
    reason="the script creates a user and sets owners: it needs root and useradd",
)


@pytest.fixture
def root() -> Iterator[Path]:
    """A bare system root: /etc with the four account files useradd edits. Made under /tmp (0755
    all the way down, not pytest's 0700 directory) so the service user can walk to its files as on
    a real host."""
    path = Path(tempfile.mkdtemp(prefix="ctl-root-", dir="/tmp"))
    path.chmod(0o755)
    etc = path / "etc"
    etc.mkdir(mode=0o755)
    (etc / "passwd").write_text(
        "root:x:0:0:root:/root:/bin/bash\nnobody:x:65534:65534::/:/usr/sbin/nologin\n"
    )
    (etc / "group").write_text("root:x:0:\nnogroup:x:65534:\n")
    for name, line in (("shadow", "root:*:20000:0:99999:7:::\n"), ("gshadow", "root:*::\n")):
        (etc / name).write_text(line)
        (etc / name).chmod(0o640)
    yield path
    shutil.rmtree(path)


def install(root: Path, *extra: str) -> str:
    done = subprocess.run(
        [
            "bash",
            str(SCRIPT),
            "--root",
            str(root),
            "--key-id",
            "fleet-test",
            *extra,
            "--edge-agent",
            f"{sys.executable} -m agent",
        ],
        capture_output=True,
        text=True,
        timeout=patient(120),
        check=False,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def account(root: Path) -> tuple[int, int, str]:
    """(uid, gid, shell) of the service user in ``root``'s passwd."""
    for line in (root / "etc" / "passwd").read_text().splitlines():
        name, _, uid, gid, _, _, shell = line.split(":")
        if name == USER:
            return int(uid), int(gid), shell
    raise AssertionError(f"no {USER} in {root}/etc/passwd")


def owner_mode(path: Path) -> tuple[int, int, int]:
    st = path.stat()
    return st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)


#: Run in a child chrooted into the install root as uid/gid (argv 2, 3): imports first (the root
#: has no Python), then loads what the controller loads at start-up, by its own functions.
AS_SERVICE = """
import json, os, sys
from pathlib import Path
from agent.fleet.console.server import console_token
from agent.fleet.controller.config import load_controller_config
from agent.fleet.deploy.keys import load_signing_key
os.chroot(sys.argv[1]); os.chdir("/")
os.setgroups([]); os.setgid(int(sys.argv[3])); os.setuid(int(sys.argv[2]))
config = load_controller_config(Path(sys.argv[4]))
load_signing_key(config.signing_key)
print(json.dumps({"token": len(console_token(config.http.token_file) or ""),
                  "state_dir": str(config.state_dir), "key_id": config.key_id}))
"""


def as_user(root: Path, uid: int, gid: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", AS_SERVICE, str(root), str(uid), str(gid), str(ETC / "controller.yaml")],
        capture_output=True,
        text=True,
        timeout=patient(60),
        check=False,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


def put_broker_files(root: Path, uid: int, gid: int) -> None:
    """The two files the operator adds as docs/controller-install.md says (the example config names them)."""
    password, ca = root / "etc" / USER / "mqtt.password", root / "etc" / USER / "ca.pem"
    password.write_text("not-a-real-password\n")
    os.chown(password, uid, gid)
    password.chmod(0o600)
    ca.write_text("-----BEGIN CERTIFICATE-----\n-----END CERTIFICATE-----\n")
    ca.chmod(0o644)


@pytest.mark.slow
def test_the_unit_finds_its_user_and_every_file_it_reads(root: Path, tmp_path: Path) -> None:
    out = install(root)
    uid, gid, shell = account(root)
    assert 0 < uid < 1000, "a system account"
    assert shell == "/usr/sbin/nologin"
    assert f"{USER}:x:{gid}:" in (root / "etc" / "group").read_text()
    assert USER not in Path("/etc/passwd").read_text(), "the host's accounts were edited"

    unit_path = root / "etc" / "systemd" / "system" / f"{USER}.service"
    unit = read_unit(unit_path)
    service = unit["Service"]
    assert (service["User"], service["Group"], service["ConfigurationDirectory"]) == (USER, USER, USER)
    config_arg = service["ExecStart"].split("--config ")[1]
    assert config_arg == str(ETC / "controller.yaml")

    etc = root / "etc" / USER
    assert owner_mode(etc) == (0, gid, 0o750)
    assert owner_mode(etc / "controller.yaml") == (0, gid, 0o640)
    assert owner_mode(etc / "fleet-test.key") == (uid, gid, 0o600)
    assert owner_mode(etc / "fleet-test.pub") == (0, 0, 0o644)
    assert owner_mode(etc / "console.token") == (uid, gid, 0o600)
    assert len((etc / "console.token").read_text().strip()) >= 40  # 32 random bytes, base64
    assert "fleet-test.pub" in out

    # The kernel's answer: the service user reads all of it through the paths the unit names ...
    put_broker_files(root, uid, gid)
    done = as_user(root, uid, gid)
    assert done.returncode == 0, done.stderr
    loaded = json.loads(done.stdout)
    assert loaded["key_id"] == "fleet-test"
    assert loaded["token"] >= 40
    assert loaded["state_dir"] == f"/var/lib/{USER}" == "/var/lib/" + service["StateDirectory"]
    # ... and nobody else does.
    refused = as_user(root, 65534, 65534)
    assert refused.returncode != 0
    assert "PermissionError" in refused.stderr or "Permission denied" in refused.stderr, refused.stderr

    # Every file of its configuration directory the unit names, comments included, is one the
    # install made (KEY_ID: the key id it was given).
    named = re.findall(rf"{ETC}/([A-Za-z_.-]+)", unit_path.read_text(encoding="utf-8"))
    assert "KEY_ID.key" in named
    for name in named:
        assert (etc / name.replace("KEY_ID", "fleet-test")).is_file(), name

    # Documentation= names files the install put there (pip installs no docs).
    for url in unit["Unit"]["Documentation"].split():
        assert url.startswith("file:///"), url
        assert (root / url.removeprefix("file:///")).is_file(), url

    if shutil.which("systemd-analyze") is not None:
        analyze_verify(unit_path, tmp_path)


def test_a_second_run_keeps_the_key_and_token_and_mends_their_modes(root: Path) -> None:
    install(root)
    uid, gid, _ = account(root)
    etc = root / "etc" / USER
    key, token = (etc / "fleet-test.key").read_bytes(), (etc / "console.token").read_bytes()
    (etc / "fleet-test.key").chmod(0o644)
    os.chown(etc / "console.token", 0, 0)
    etc.chmod(0o700)

    out = install(root, "--key-id", "another")  # the existing controller.yaml names the key
    assert "exists: kept" in out
    assert (etc / "fleet-test.key").read_bytes() == key
    assert (etc / "console.token").read_bytes() == token
    assert not (etc / "another.key").exists()
    assert owner_mode(etc / "fleet-test.key") == (uid, gid, 0o600)
    assert owner_mode(etc / "console.token") == (uid, gid, 0o600)
    assert owner_mode(etc) == (0, gid, 0o750)
    accounts = [line.split(":")[0] for line in (root / "etc" / "passwd").read_text().splitlines()]
    assert accounts.count(USER) == 1


def test_an_empty_root_gets_its_account_files_and_the_whole_install() -> None:
    empty = Path(tempfile.mkdtemp(prefix="ctl-empty-", dir="/tmp"))
    try:
        empty.chmod(0o755)
        out = install(empty)
        assert "made etc/passwd, group, shadow and gshadow" in out
        uid, gid, shell = account(empty)
        assert 0 < uid < 1000
        assert shell == "/usr/sbin/nologin"
        assert (empty / "etc" / "passwd").read_text().startswith("root:x:0:0:")
        assert owner_mode(empty / "etc" / "shadow")[2] == 0o640
        etc = empty / "etc" / USER
        assert owner_mode(etc / "fleet-test.key") == (uid, gid, 0o600)
        assert owner_mode(etc / "controller.yaml") == (0, gid, 0o640)
        put_broker_files(empty, uid, gid)
        done = as_user(empty, uid, gid)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["key_id"] == "fleet-test"
    finally:
        shutil.rmtree(empty)


def run_script(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=patient(60), check=False
    )


def test_a_missing_edge_agent_is_named_before_anything_is_changed(tmp_path: Path) -> None:
    missing = tmp_path / "no-venv" / "edge-agent"
    done = run_script("--root", str(tmp_path), "--key-id", "fleet-test", "--edge-agent", str(missing))
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert lines == [
        f"install-controller: cannot run '{missing} fleet keygen' (it makes the signing key"
        f" {ETC}/fleet-test.key): install the code first (docs/controller-install.md, step 1)"
        " or name the command with --edge-agent CMD",
        "install-controller: nothing was changed",
    ]
    assert list(tmp_path.iterdir()) == [], "the run changed the root before it stopped"


def test_every_problem_is_named_at_once_and_nothing_is_changed(tmp_path: Path) -> None:
    done = run_script("--root", str(tmp_path), "--key-id", "../bad", "--edge-agent", "/nonexistent")
    assert done.returncode == 1
    assert "--key-id ../bad: 1-64 letters" in done.stderr
    assert "cannot run '/nonexistent fleet keygen'" in done.stderr
    assert list(tmp_path.iterdir()) == []
    gone = tmp_path / "absent"
    done = run_script("--root", str(gone), "--edge-agent", f"{sys.executable} -m agent")
    assert done.returncode == 1
    assert f"--root {gone} is not a directory" in done.stderr
    assert not gone.exists()


def test_the_documented_refusal_is_what_a_run_before_step_1_prints(tmp_path: Path) -> None:
    """docs/controller-install.md quotes the script's answer when the venv of step 1 is missing."""
    doc = (REPO / "docs" / "controller-install.md").read_text()
    start = doc.index("```\n", doc.index("for example, before step 1:")) + len("```\n")
    quoted = doc[start : doc.index("```", start)]
    venv = Path("/opt/edge-agent/.venv/bin/edge-agent")
    assert not venv.exists(), "this host has step 1's venv: the refusal cannot be shown here"
    done = run_script("--root", str(tmp_path), "--key-id", "fleet-2026")
    assert done.returncode == 1
    assert done.stderr == quoted
    assert list(tmp_path.iterdir()) == []
