"""What the agent tells an operator to install for CUDA, by machine (issue 22.11: the self-test on an
x86 workstation advised "cuda-python matching the CUDA of this JetPack")."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.backends import cuda


def test_a_jetson_is_told_about_its_jetpack_and_any_other_machine_is_not() -> None:
    assert "this JetPack" in cuda.install_hint(jetson=True)
    other = cuda.install_hint(jetson=False)
    assert "JetPack" not in other
    assert "nvidia-smi" in other
    assert "without an NVIDIA GPU, CUDA does not apply here" in other


@pytest.mark.skipif(Path("/etc/nv_tegra_release").exists(), reason="this machine is a Jetson")
def test_the_cuda_step_reason_on_this_machine_speaks_of_no_jetpack() -> None:
    usable, why = cuda.cuda_status()
    if usable:
        pytest.skip("CUDA is usable here: no install advice is given")
    assert "JetPack" not in why
