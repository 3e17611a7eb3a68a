"""Make the installed ``tensorrt-stubs`` usable by mypy (run by ``make`` after installing them).

``tensorrt-stubs`` 10.x installs ``tensorrt/__init__.pyi`` without a ``py.typed`` marker, so mypy
ignores it, and its generated ``tensorrt.pyi`` has syntax errors (parameters named ``in``, a
non-default parameter after defaults). This writes fixed copies as PEP 561 stub-only packages
(``tensorrt-stubs/``, ``tensorrt_bindings-stubs/``) next to them. ``-stubs`` directories are not
importable, so the runtime check ``hasattr(tensorrt, "Builder")`` is unaffected. Idempotent.
"""

from __future__ import annotations

import re
import shutil
import sys
import sysconfig
from pathlib import Path


def main() -> int:
    site = Path(sysconfig.get_paths()["purelib"])
    for name in ("tensorrt", "tensorrt_bindings"):
        source, target = site / name, site / f"{name}-stubs"
        if not source.is_dir():
            print(f"fix_tensorrt_stubs: {source} missing; install tensorrt-stubs first", file=sys.stderr)
            return 1
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(source, target)
    stub = site / "tensorrt_bindings-stubs" / "tensorrt.pyi"
    text = stub.read_text()
    text = re.sub(r"\bin: ", "in_: ", text)
    text = text.replace(", channel_axis: int)", ", channel_axis: int = ...)")
    stub.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
