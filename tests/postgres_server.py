"""A real PostgreSQL (Debian's ``postgresql`` package) for tests: ``initdb`` in a temporary
directory, the server on a free loopback port, with a password made at run time.

One server per test worker (a session fixture starts it once), a fresh database per test
(:meth:`PostgresServer.new_database`). As root (a container), the server runs as the ``postgres``
user: PostgreSQL refuses to run as root. The server is a child of the test process (``postgres``
run in the foreground, not daemonized by ``pg_ctl``), so the run's process registry
(tests/run_processes.py) ends it with the run however the run ends.
"""

from __future__ import annotations

import contextlib
import glob
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

import psycopg

from agent.demo.broker import free_port
from tests.waiting import patient, wait_until

#: The database user the tests' controllers log in as (not a secret: the password is).
USER = "fleet"


def postgres_bin() -> Path | None:
    """The newest installed PostgreSQL's binaries (None: the package is not installed)."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"), key=lambda p: int(p.split("/")[4]))
    return Path(found[-1]).parent if found else None


class PostgresServer:
    """A running server: :attr:`port`, :attr:`password_file`, :meth:`new_database`, :meth:`stop`."""

    def __init__(self) -> None:
        bindir = postgres_bin()
        if bindir is None:
            raise RuntimeError("PostgreSQL is not installed: tools/os-deps.sh test installs it")
        self.bindir = bindir
        self.root = Path(tempfile.mkdtemp(prefix="edge-pg-"))
        self.data = self.root / "data"
        self.port = free_port()
        self.password_file = self.root / "password"
        self.password_file.write_text(secrets.token_urlsafe(24) + "\n")
        self.password_file.chmod(0o600)
        self._as: list[str] = []
        if os.geteuid() == 0:
            self._as = ["runuser", "-u", "postgres", "--"]
            shutil.chown(self.root, "postgres")
            shutil.chown(self.password_file, "postgres")
            self.root.chmod(0o755)  # the tests (root) read the password file, postgres owns the rest
        self._run(
            "initdb",
            "-D",
            str(self.data),
            "-U",
            USER,
            f"--pwfile={self.password_file}",
            "--auth=scram-sha-256",
            "--no-sync",
            "--encoding=UTF8",
        )
        self.log = self.root / "server.log"
        with self.log.open("ab") as out:
            self.server = subprocess.Popen(
                [
                    *self._as,
                    str(self.bindir / "postgres"),
                    "-D",
                    str(self.data),
                    "-p",
                    str(self.port),
                    "-k",
                    str(self.root),
                    "-c",
                    "listen_addresses=127.0.0.1",
                    "-c",
                    "max_connections=200",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        wait_until(self._accepting, timeout=30, what=f"PostgreSQL accepting on port {self.port} ({self.log})")

    def _run(self, tool: str, *args: str) -> None:
        subprocess.run(
            [*self._as, str(self.bindir / tool), *args],
            check=True,
            capture_output=True,
            timeout=patient(60),
            cwd=self.root,
        )

    def _accepting(self) -> bool:
        if self.server.poll() is not None:
            raise RuntimeError(f"PostgreSQL exited: {self.log.read_text(errors='replace')[-2000:]}")
        try:
            psycopg.connect(self.conninfo("postgres"), connect_timeout=2).close()
        except psycopg.OperationalError:
            return False
        return True

    def password(self) -> str:
        return self.password_file.read_text().strip()

    def url(self, database: str, port: int | None = None) -> str:
        """The URL a controller's ``database.url`` gives (no password: that is in ``password_file``)."""
        return f"postgresql://{USER}@127.0.0.1:{port or self.port}/{database}"

    def conninfo(self, database: str, port: int | None = None) -> str:
        return f"{self.url(database, port)}?password={self.password()}"

    def new_database(self) -> str:
        """A new, empty database's name."""
        name = f"t_{secrets.token_hex(6)}"
        with psycopg.connect(self.conninfo("postgres"), autocommit=True) as admin:
            admin.execute(f'CREATE DATABASE "{name}"')
        return name

    def stop(self) -> None:
        """Immediate shutdown (SIGQUIT to the postmaster, whose pid it wrote), then the files go."""
        with contextlib.suppress(OSError, ValueError, IndexError):
            os.kill(int((self.data / "postmaster.pid").read_text().split()[0]), signal.SIGQUIT)
        try:
            self.server.wait(patient(30))
        except subprocess.TimeoutExpired:
            self.server.kill()
            self.server.wait(patient(10))
        shutil.rmtree(self.root, ignore_errors=True)
