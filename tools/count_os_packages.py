"""How many OS packages ``apt-get install`` would add to a fresh Debian, without installing anything.

A fresh machine is modelled by a dpkg status file holding only this machine's installed packages of
priority required or important, plus ``python3`` and ``make`` (what ``make demo`` itself needs), and
their Depends/Pre-Depends. ``apt-get -s`` then simulates the install against it:

    python tools/count_os_packages.py python3-venv mosquitto
    python tools/count_os_packages.py --install-recommends python3-venv mosquitto prometheus ...

prints the count of packages it would newly install. The README's figures for `make demo` and
`make test` come from here (Debian 12, bookworm).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

STATUS = Path("/var/lib/dpkg/status")
BASE = ("python3", "make")


def _field(stanza: str, name: str) -> str:
    found = re.search(rf"^{name}: (.*(?:\n .*)*)", stanza, re.MULTILINE)
    return found.group(1) if found else ""


def fresh_status(status_text: str, extra: tuple[str, ...] = BASE) -> tuple[str, int]:
    """A status file of the required and important packages plus ``extra``, closed over their
    dependencies (the first installed alternative of each); and how many packages it holds."""
    stanzas: dict[str, str] = {}
    for stanza in status_text.strip().split("\n\n"):
        package = re.search(r"^Package: (\S+)", stanza, re.MULTILINE)
        if package and re.search(r"^Status: install ok installed", stanza, re.MULTILINE):
            stanzas[package.group(1)] = stanza
    provides: dict[str, str] = {}
    for name, stanza in stanzas.items():
        for virtual in _field(stanza, "Provides").split(","):
            if virtual.strip():
                provides.setdefault(virtual.strip().split()[0], name)
    keep: set[str] = set()
    todo = [n for n, s in stanzas.items() if _field(s, "Priority") in ("required", "important")]
    todo += list(extra)
    while todo:
        wanted = todo.pop().split(":")[0]
        found = wanted if wanted in stanzas else provides.get(wanted)
        if found is None or found in keep:
            continue
        keep.add(found)
        depends = _field(stanzas[found], "Depends") + "," + _field(stanzas[found], "Pre-Depends")
        for clause in depends.split(","):
            alternatives = [a.strip().split()[0].split(":")[0] for a in clause.split("|") if a.strip()]
            for alternative in alternatives:
                if alternative in stanzas or alternative in provides:
                    todo.append(alternative)
                    break
    return "\n\n".join(stanzas[n] for n in sorted(keep)) + "\n", len(keep)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--install-recommends", action="store_true", help="count recommends too")
    parser.add_argument("packages", nargs="+")
    args = parser.parse_args()
    text, size = fresh_status(STATUS.read_text())
    with tempfile.NamedTemporaryFile("w", suffix=".status") as status:
        status.write(text)
        status.flush()
        recommends = "--install-recommends" if args.install_recommends else "--no-install-recommends"
        done = subprocess.run(
            [
                "apt-get",
                "-s",
                "-o",
                f"Dir::State::status={status.name}",
                "install",
                recommends,
                *args.packages,
            ],
            capture_output=True,
            text=True,
            check=False,
        )
    if done.returncode != 0:
        print(done.stdout + done.stderr, file=sys.stderr)
        return 1
    new = [line.split()[1] for line in done.stdout.splitlines() if line.startswith("Inst ")]
    summary = next(line for line in done.stdout.splitlines() if "newly installed" in line)
    print(f"fresh system: {size} packages; {recommends}: {summary}")
    print(" ".join(new))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
