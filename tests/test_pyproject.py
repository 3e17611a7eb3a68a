"""pyproject.toml: what ``pip install`` makes of it, read the way pip reads it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

from tests.waiting import patient

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_building_the_package_warns_about_nothing(tmp_path: Path) -> None:
    """pip builds in an isolated environment with the newest setuptools the build-system allows, as
    a fresh ``make venv`` does; every deprecation it prints is a warning a new user reads (the
    license table printed three). Needs the package index (or pip's cache) for setuptools."""
    project = tmp_path / "project"
    (project / "agent").mkdir(parents=True)
    # Only what the metadata needs: the package's files do not change what setuptools warns about.
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, project / name)
    (project / "agent" / "__init__.py").write_text("")
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(tmp_path / "wheel"), str(project)],
        capture_output=True,
        text=True,
        timeout=patient(170),
        check=False,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert "deprecated" not in output.lower(), output[-3000:]
    assert "Warning" not in output, output[-3000:]


# --- which ONNX Runtime and cuda-python each platform gets (pyproject.toml with docs/operations.md) --

OPERATIONS = REPO / "docs" / "operations.md"


def _project() -> dict[str, Any]:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+; the tests run there
    project: dict[str, Any] = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return project


def _section(doc: str, title: str) -> str:
    start = doc.index(f"\n## {title}\n")
    end = doc.find("\n## ", start + 1)
    return doc[start : end if end != -1 else None]


def _supported_rows() -> list[dict[str, str]]:
    """The "Supported platforms" table, one dict per row keyed by its header."""
    table = [
        line
        for line in _section(OPERATIONS.read_text(), "Supported platforms").splitlines()
        if line.startswith("|")
    ]
    header = [cell.strip() for cell in table[0].strip("|").split("|")]
    return [
        dict(zip(header, (c.strip() for c in row.strip("|").split("|")), strict=True)) for row in table[2:]
    ]


def _environment(python: str, machine: str) -> dict[str, str]:
    """PEP 508 marker variables of a Linux machine, as pip evaluates them there."""
    return {
        "python_version": python,
        "python_full_version": f"{python}.0",
        "platform_machine": machine,
        "sys_platform": "linux",
        "platform_system": "Linux",
        "os_name": "posix",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "platform_release": "",
        "platform_version": "",
        "implementation_version": f"{python}.0",
    }


def _installs(project: dict[str, Any], extras: set[str], env: dict[str, str]) -> dict[str, Requirement]:
    """What ``pip install '.[extras]'`` asks for on ``env``: name -> requirement, markers evaluated."""
    wanted = [(r, "") for r in project["dependencies"]]
    wanted += [(r, extra) for extra in extras for r in project["optional-dependencies"][extra]]
    out: dict[str, Requirement] = {}
    for text, extra in wanted:
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate({**env, "extra": extra}):
            out[canonicalize_name(req.name)] = req
    return out


def test_a_jetson_install_keeps_nvidias_onnxruntime_and_matches_cuda_python_to_its_cuda() -> None:
    """Every supported JetPack: its Python meets requires-python, the install steps' extra exists and
    pins cuda-python to the JetPack's CUDA major, and nothing installed is PyPI's CPU onnxruntime,
    which would overwrite NVIDIA's onnxruntime-gpu (same import package) and drop the CUDA and
    TensorRT providers. x86-64 keeps the CPU build; JetPack 5 (Python 3.8) is listed as unsupported."""
    project = _project()
    floor = SpecifierSet(project["requires-python"])
    rows = {row["platform"]: row for row in _supported_rows()}
    jetpacks = {name: row for name, row in rows.items() if name.startswith("JetPack")}
    supported = {name for name, row in jetpacks.items() if row["status"] == "supported"}
    assert {name.split()[1].split(".")[0] for name in supported} >= {"6", "7"}
    for name, row in jetpacks.items():
        assert (row["status"] == "supported") == floor.contains(row["Python"]), name
        if row["status"] != "supported":
            assert f"Python {row['Python']} is below" in row["status"], name
            continue
        extra = row["extra"].strip("`")
        installs = _installs(project, {extra}, _environment(row["Python"], "aarch64"))
        assert "onnxruntime" not in installs, f"{name}: PyPI's CPU onnxruntime would shadow onnxruntime-gpu"
        assert "onnxruntime-gpu" not in installs, f"{name}: PyPI has no Jetson onnxruntime-gpu"
        cuda_python = installs["cuda-python"].specifier
        for cuda in row["CUDA"].split(", "):
            assert cuda_python.contains(cuda), f"{name}: cuda-python {cuda_python} does not match CUDA {cuda}"

    x86 = _installs(project, set(), _environment("3.11", "x86_64"))
    assert "onnxruntime" in x86, "x86-64 gets ONNX Runtime's CPU build without asking"
    assert "onnxruntime" in _installs(project, {"cpu"}, _environment("3.12", "aarch64"))


def test_the_install_steps_name_what_a_jetson_needs() -> None:
    """docs/operations.md's install block, read with pyproject: python3-venv before the venv, the venv
    sees JetPack's TensorRT, NVIDIA's onnxruntime-gpu wheel goes in, and the extra it installs is one
    of the supported rows' (docs/engines.md's Thor claim rests on the JetPack 7 row)."""
    project = _project()
    block = _section(OPERATIONS.read_text(), "Install as a service").split("```sh\n")[1].split("```")[0]
    commands = [line for line in block.splitlines() if line and not line.startswith("#")]
    venv = next(i for i, c in enumerate(commands) if "python3 -m venv" in c)
    assert any("apt-get install" in c and "python3-venv" in c for c in commands[:venv])
    assert "--system-site-packages" in commands[venv]
    assert any("pip install" in c and "onnxruntime_gpu" in c for c in commands)
    [agent] = [c for c in commands if "pip install" in c and "edge-agent[" in c]
    extra = agent.split("edge-agent[")[1].split("]")[0]
    assert extra in project["optional-dependencies"]
    assert extra in {row["extra"].strip("`") for row in _supported_rows() if row["status"] == "supported"}
    assert any("ort_providers" in c for c in commands), "the step that shows the providers came through"

    thor = next(row for row in _supported_rows() if "Thor" in row["platform"])
    assert thor["status"] == "supported"
    assert "JetPack 7" in thor["platform"]
    engines = (REPO / "docs" / "engines.md").read_text()
    assert f"installed with the {thor['extra']} extra" in engines
    assert "CUDA 13" in engines
    assert thor["CUDA"].startswith("13")
