"""A real PostgreSQL (Debian's ``postgresql`` package) for tests: ``initdb`` and ``pg_ctl`` in a
temporary directory, on a free loopback port, with a password made at run time.

One server per test worker (a session fixture starts it once), a fresh database per test
(:meth:`PostgresServer.new_database`). As root (a container), the server runs as the ``postgres``
user: PostgreSQL refuses to run as root.
"""

from __future__ import annotations

import contextlib
import glob
import os
import secrets
import shutil
import subprocess
import tempfile
from pathlib import Path

import psycopg

from agent.demo.broker import free_port
from tests.waiting import patient

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
        self._run(
            "pg_ctl",
            "-D",
            str(self.data),
            "-l",
            str(self.log),
            "-w",
            "-t",
            str(int(patient(30))),
            "-o",
            f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.root} -c max_connections=200",
            "start",
        )

    def _run(self, tool: str, *args: str) -> None:
        subprocess.run(
            [*self._as, str(self.bindir / tool), *args],
            check=True,
            capture_output=True,
            timeout=patient(60),
            cwd=self.root,
        )

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
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "stop")
        shutil.rmtree(self.root, ignore_errors=True)
