"""Device statistics: process and system CPU/memory (psutil), temperatures and Jetson load from sysfs.

Sysfs files are located once, at construction, so each :meth:`DeviceStats.collect` is a handful of
small reads. Every read may fail (a sensor goes offline, a zone returns EIO while power-gated):
such a value is skipped for that collection, never raised.
"""

from __future__ import annotations

import re
from pathlib import Path

import psutil
import structlog

log = structlog.get_logger(__name__)

_MB = 1024.0 * 1024.0

#: Where the Jetson GPU driver exposes its load (0..1000, per mille), newest layouts first.
#: The GPU's device name moved between L4T releases and SoCs (Orin ga10b, Xavier gv11b, Nano/TX gpu.0).
GPU_LOAD_FILES = (
    "sys/devices/platform/gpu.0/load",
    "sys/devices/gpu.0/load",
    "sys/devices/platform/bus@0/17000000.gpu/load",
    "sys/devices/platform/17000000.ga10b/load",
    "sys/devices/platform/17000000.gv11b/load",
    "sys/devices/17000000.gv11b/load",
)

#: devfreq nodes whose name says GPU; their ``cur_freq`` is in Hz and world-readable.
_GPU_DEVFREQ = re.compile(r"gpu|ga10b|gv11b|gp10b|gm20b")

#: Memory controller (EMC) and DLA clocks, in Hz. They live in debugfs, which only root can read, so
#: under the systemd unit (User=edge-agent) they are simply absent; they appear when run as root.
CLOCK_FILES = {
    "emc.freq_mhz": ("sys/kernel/debug/bpmp/debug/clk/emc/rate", "sys/kernel/debug/clk/emc/clk_rate"),
    "dla0.freq_mhz": ("sys/kernel/debug/bpmp/debug/clk/dla0_core/rate",),
    "dla1.freq_mhz": ("sys/kernel/debug/bpmp/debug/clk/dla1_core/rate",),
}

#: Older L4T (actmon) reports EMC utilisation in per mille, world-readable.
EMC_LOAD_FILE = "sys/kernel/actmon_avg_activity/mc_all"

#: Below this a thermal reading is a sentinel, not a temperature: Jetson zones report values like
#: -256 °C while their sensor is offline (e.g. GPU-therm with the GPU power-gated).
_OFFLINE_BELOW_C = -100.0


def _read_number(path: Path) -> float | None:
    try:
        return float(path.read_text(encoding="ascii").split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _field_name(raw: str) -> str:
    """``CPU-therm`` -> ``cpu_therm``: a stable, Influx-friendly field name."""
    return re.sub(r"[^a-z0-9]+", "_", raw.strip().lower()).strip("_") or "zone"


class DeviceStats:
    """Collects device statistics as a flat ``{name: number}`` dict.

    ``root`` prefixes every sysfs path, so tests (and containers with the host's /sys mounted
    elsewhere) can point it at another tree; psutil always reports the real process and system.

    Keys: ``process.cpu_percent``, ``process.rss_mb``, ``process.threads``, ``cpu.percent``,
    ``memory.used_mb``, ``memory.available_mb``, ``memory.percent``, ``temp.<zone type>_c``,
    and where the files exist ``gpu.load_percent``, ``gpu.freq_mhz``, ``emc.load_percent``,
    ``emc.freq_mhz``, ``dla0.freq_mhz``, ``dla1.freq_mhz``.
    """

    def __init__(self, root: Path = Path("/")) -> None:
        self.root = root
        self._process = psutil.Process()
        # cpu_percent() measures since its previous call; the first call only sets the baseline.
        self._process.cpu_percent(None)
        psutil.cpu_percent(None)
        self._thermal = self._find_thermal_zones()
        self._gpu_load = self._first_existing(GPU_LOAD_FILES)
        self._gpu_freq = self._find_gpu_devfreq()
        self._emc_load = self._first_existing((EMC_LOAD_FILE,))
        self._clocks = {
            key: path for key, paths in CLOCK_FILES.items() if (path := self._first_existing(paths))
        }
        log.debug(
            "telemetry.device.found",
            thermal_zones=sorted(self._thermal),
            gpu_load=str(self._gpu_load) if self._gpu_load else None,
            clocks=sorted(self._clocks),
        )

    def collect(self) -> dict[str, float]:
        """Read everything once; unreadable values are left out."""
        out: dict[str, float] = {}
        try:
            with self._process.oneshot():
                out["process.cpu_percent"] = float(self._process.cpu_percent(None))
                out["process.rss_mb"] = self._process.memory_info().rss / _MB
                out["process.threads"] = float(self._process.num_threads())
        except psutil.Error as exc:  # pragma: no cover - our own process does not vanish
            log.warning("telemetry.device.process_failed", error=repr(exc))
        out["cpu.percent"] = float(psutil.cpu_percent(None))
        mem = psutil.virtual_memory()
        out["memory.used_mb"] = (mem.total - mem.available) / _MB
        out["memory.available_mb"] = mem.available / _MB
        out["memory.percent"] = float(mem.percent)

        for key, path in self._thermal.items():
            milli = _read_number(path)
            if milli is not None and milli / 1000.0 > _OFFLINE_BELOW_C:
                out[key] = milli / 1000.0
        if self._gpu_load and (load := _read_number(self._gpu_load)) is not None:
            out["gpu.load_percent"] = load / 10.0
        if self._gpu_freq and (hz := _read_number(self._gpu_freq)) is not None:
            out["gpu.freq_mhz"] = hz / 1e6
        if self._emc_load and (emc := _read_number(self._emc_load)) is not None:
            out["emc.load_percent"] = emc / 10.0
        for key, path in self._clocks.items():
            if (hz := _read_number(path)) is not None:
                out[key] = hz / 1e6
        return out

    def _find_thermal_zones(self) -> dict[str, Path]:
        zones: dict[str, Path] = {}
        base = self.root / "sys/class/thermal"
        for zone in sorted(base.glob("thermal_zone*"), key=lambda p: _zone_index(p.name)):
            try:
                kind = _field_name((zone / "type").read_text(encoding="utf-8"))
            except OSError:
                continue
            key = f"temp.{kind}_c"
            if key in zones:  # several zones of one type (e.g. acpitz on a PC): number them
                key = f"temp.{kind}_{_zone_index(zone.name)}_c"
            zones[key] = zone / "temp"
        return zones

    def _find_gpu_devfreq(self) -> Path | None:
        for node in sorted((self.root / "sys/class/devfreq").glob("*")):
            if _GPU_DEVFREQ.search(node.name) and (node / "cur_freq").is_file():
                return node / "cur_freq"
        return None

    def _first_existing(self, relative: tuple[str, ...]) -> Path | None:
        for rel in relative:
            path = self.root / rel
            try:
                if path.is_file():
                    return path
            except OSError:  # debugfs without permission raises instead of answering False
                continue
        return None


def _zone_index(name: str) -> int:
    digits = name.removeprefix("thermal_zone")
    return int(digits) if digits.isdigit() else 1_000_000
