"""What a Jetson's own files say: L4T release, JetPack release, device model, Tegra SoC.

:func:`probe_jetson_files` reads ``/etc/nv_tegra_release`` and the device tree under a ``root``
(tests point it at a temporary directory dressed as a Jetson); every fact it cannot read gets a
one-line reason instead. The parsers and tables are pure. :func:`agent.machine.platform.detect_platform`
runs it beside the CUDA, TensorRT and ONNX Runtime probes.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

#: Paths read relative to the ``root`` given to :func:`detect_platform` (so tests can use a fake root).
NV_TEGRA_RELEASE = Path("etc/nv_tegra_release")
DEVICE_TREE_MODEL = Path("proc/device-tree/model")
DEVICE_TREE_COMPATIBLE = Path("proc/device-tree/compatible")

#: L4T release prefix -> JetPack release, longest prefix wins. Best effort from NVIDIA's JetPack
#: archive; an unknown release keeps ``jetpack=None`` rather than guessing.
L4T_TO_JETPACK: tuple[tuple[str, str], ...] = (
    ("R35.1", "5.0.2"),
    ("R35.2", "5.1"),
    ("R35.3", "5.1.1"),
    ("R35.4", "5.1.2"),
    ("R35.5", "5.1.3"),
    ("R35.6.0", "5.1.4"),
    ("R35.6.1", "5.1.5"),
    ("R35", "5.1.x"),
    ("R36.2", "6.0"),  # 6.0 developer preview
    ("R36.3", "6.0"),
    ("R36.4.0", "6.1"),
    ("R36.4.3", "6.2"),
    ("R36.4.4", "6.2.1"),
    ("R36.4", "6.1/6.2"),
    ("R38.2", "7.0"),
)

#: Tegra SoC (device-tree ``compatible``) -> product family and how many DLA cores the chip has at
#: most (a module may fuse some off: Orin NX has 1, Orin Nano 0; TensorRT's count is the truth).
#: Jetson Thor (JetPack 7) has no DLA at all: its planner reason names the chip, not a count.
SOC_FACTS: dict[str, tuple[str, int]] = {
    "tegra194": ("Xavier", 2),
    "tegra234": ("Orin", 2),
    "tegra264": ("Thor", 0),
}

_TEGRA_RELEASE_RE = re.compile(
    r"#\s*R(?P<major>\d+)\s*\(release\),\s*REVISION:\s*(?P<revision>\d+(?:\.\d+)*)"
)


def parse_tegra_release(text: str) -> str | None:
    """``# R36 (release), REVISION: 4.0, GCID: ...`` -> ``'R36.4.0'``; None when it does not parse."""
    match = _TEGRA_RELEASE_RE.search(text)
    if match is None:
        return None
    return f"R{match['major']}.{match['revision']}"


def jetpack_for_l4t(l4t_release: str) -> str | None:
    """Best-effort JetPack release of an L4T release: ``'R36.4.0'`` -> ``'6.1'`` (:data:`L4T_TO_JETPACK`)."""
    best: tuple[str, str] | None = None
    for prefix, jetpack in L4T_TO_JETPACK:
        # Prefix on a version-component boundary: "R36.4" matches "R36.4.3" but not "R36.45".
        if (l4t_release == prefix or l4t_release.startswith(prefix + ".")) and (
            best is None or len(prefix) > len(best[0])
        ):
            best = (prefix, jetpack)
    return best[1] if best else None


def _read_text(path: Path) -> str | None:
    try:
        return path.read_bytes().decode("utf-8", errors="replace")
    except OSError:
        return None


def parse_soc(compatible: str) -> str | None:
    """The Tegra SoC of a device-tree ``compatible`` list (NUL-separated): ``'...nvidia,tegra234'`` ->
    ``'tegra234'``; None when no ``nvidia,tegraNNN`` entry is there."""
    match = re.search(r"nvidia,(tegra\d+)", compatible.lower())
    return match[1] if match else None


def probe_jetson_files(root: Path) -> tuple[dict[str, Any], dict[str, str]]:
    """L4T release, JetPack, device model, SoC and is_jetson from the files under ``root``."""
    values: dict[str, Any] = {}
    reasons: dict[str, str] = {}
    release_text = _read_text(root / NV_TEGRA_RELEASE)
    if release_text is None:
        reasons["l4t_release"] = f"/{NV_TEGRA_RELEASE} not found (not a Jetson, or L4T not installed)"
    else:
        release = parse_tegra_release(release_text)
        if release is None:
            reasons["l4t_release"] = f"/{NV_TEGRA_RELEASE} does not parse: {release_text.strip()[:80]!r}"
        else:
            values["l4t_release"] = release
            jetpack = jetpack_for_l4t(release)
            if jetpack is None:
                reasons["jetpack"] = f"L4T {release} is not in the JetPack table"
            else:
                values["jetpack"] = jetpack
    model_text = _read_text(root / DEVICE_TREE_MODEL)
    if model_text is None:
        reasons["device_model"] = f"/{DEVICE_TREE_MODEL} not found"
    else:
        # Device-tree strings end with NUL.
        values["device_model"] = model_text.replace("\x00", "").strip() or None
    compatible = (_read_text(root / DEVICE_TREE_COMPATIBLE) or "").lower()
    soc = parse_soc(compatible)
    if soc is None:
        reasons["soc"] = f"no nvidia,tegra entry in /{DEVICE_TREE_COMPATIBLE}"
    else:
        values["soc"] = soc
    values["is_jetson"] = (
        release_text is not None or "jetson" in (model_text or "").lower() or "nvidia,tegra" in compatible
    )
    return values, reasons
