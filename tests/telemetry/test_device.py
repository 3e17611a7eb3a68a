"""DeviceStats against a fake Jetson sysfs tree and against this machine's real root."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.telemetry import DeviceStats


class FakeJetsonSysfs:
    """A fake Jetson (Orin) /sys tree under a temporary root.

    A FAKE because the hardware is absent here: no Jetson thermal zones, GPU load or devfreq
    files exist on the build machine. File names and units follow L4T: thermal ``temp`` in
    millidegrees, GPU ``load`` in per mille, devfreq ``cur_freq`` in Hz.
    """

    def __init__(self, root: Path) -> None:
        self.root = root

    def write(self, relative: str, text: str) -> Path:
        path = self.root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
        return path

    def thermal_zone(self, index: int, kind: str, millideg: int | None) -> None:
        self.write(f"sys/class/thermal/thermal_zone{index}/type", kind)
        if millideg is not None:
            self.write(f"sys/class/thermal/thermal_zone{index}/temp", str(millideg))

    def gpu_load(self, per_mille: int, relative: str = "sys/devices/platform/gpu.0/load") -> None:
        self.write(relative, str(per_mille))


@pytest.fixture
def jetson(tmp_path: Path) -> FakeJetsonSysfs:
    fake = FakeJetsonSysfs(tmp_path)
    fake.thermal_zone(0, "CPU-therm", 45500)
    fake.thermal_zone(1, "GPU-therm", 41000)
    fake.gpu_load(537)
    return fake


def test_fake_jetson_thermal_zones_and_gpu_load(jetson: FakeJetsonSysfs) -> None:
    stats = DeviceStats(jetson.root).collect()
    assert stats["temp.cpu_therm_c"] == pytest.approx(45.5)
    assert stats["temp.gpu_therm_c"] == pytest.approx(41.0)
    assert stats["gpu.load_percent"] == pytest.approx(53.7)
    assert not [
        k for k in stats if k.startswith("temp.") and k not in {"temp.cpu_therm_c", "temp.gpu_therm_c"}
    ]


def test_values_are_read_at_every_collect(jetson: FakeJetsonSysfs) -> None:
    device = DeviceStats(jetson.root)
    assert device.collect()["gpu.load_percent"] == pytest.approx(53.7)
    jetson.gpu_load(1000)
    jetson.thermal_zone(0, "CPU-therm", 71250)
    stats = device.collect()
    assert stats["gpu.load_percent"] == pytest.approx(100.0)
    assert stats["temp.cpu_therm_c"] == pytest.approx(71.25)


def test_unreadable_and_offline_zones_are_skipped(jetson: FakeJetsonSysfs) -> None:
    jetson.thermal_zone(2, "PMIC-Die", None)  # no temp file
    jetson.thermal_zone(3, "SOC0-therm", -256000)  # L4T's sentinel for an offline sensor
    jetson.write("sys/class/thermal/thermal_zone4/temp", "39000")  # no type file
    jetson.thermal_zone(5, "tj-therm", 0)
    (jetson.root / "sys/class/thermal/thermal_zone5/temp").unlink()
    (jetson.root / "sys/class/thermal/thermal_zone5/temp").mkdir()  # reading it raises
    jetson.thermal_zone(6, "BCPU-therm", 50000)
    (jetson.root / "sys/class/thermal/thermal_zone6/temp").write_text("garbage\n")
    stats = DeviceStats(jetson.root).collect()
    temps = {k: v for k, v in stats.items() if k.startswith("temp.")}
    assert temps == {"temp.cpu_therm_c": pytest.approx(45.5), "temp.gpu_therm_c": pytest.approx(41.0)}


def test_duplicate_zone_types_are_numbered(tmp_path: Path) -> None:
    fake = FakeJetsonSysfs(tmp_path)
    fake.thermal_zone(0, "acpitz", 30000)
    fake.thermal_zone(1, "acpitz", 32000)
    stats = DeviceStats(tmp_path).collect()
    assert stats["temp.acpitz_c"] == pytest.approx(30.0)
    assert stats["temp.acpitz_1_c"] == pytest.approx(32.0)


def test_older_gpu_load_path_and_devfreq(tmp_path: Path) -> None:
    fake = FakeJetsonSysfs(tmp_path)
    fake.gpu_load(250, "sys/devices/gpu.0/load")
    fake.write("sys/class/devfreq/17000000.gpu/cur_freq", "918000000")
    fake.write("sys/class/devfreq/3d00000.pcie/cur_freq", "1000")
    stats = DeviceStats(tmp_path).collect()
    assert stats["gpu.load_percent"] == pytest.approx(25.0)
    assert stats["gpu.freq_mhz"] == pytest.approx(918.0)


def test_emc_and_dla_clocks_when_readable(tmp_path: Path) -> None:
    fake = FakeJetsonSysfs(tmp_path)
    fake.write("sys/kernel/debug/bpmp/debug/clk/emc/rate", "3199000000")
    fake.write("sys/kernel/debug/bpmp/debug/clk/dla0_core/rate", "1600000000")
    stats = DeviceStats(tmp_path).collect()
    assert stats["emc.freq_mhz"] == pytest.approx(3199.0)
    assert stats["dla0.freq_mhz"] == pytest.approx(1600.0)
    assert "dla1.freq_mhz" not in stats


def test_no_jetson_files_means_no_jetson_keys(tmp_path: Path) -> None:
    stats = DeviceStats(tmp_path).collect()
    assert not [k for k in stats if k.startswith(("temp.", "gpu.", "emc.", "dla"))]


def test_real_root_reports_plausible_process_and_memory() -> None:
    device = DeviceStats(Path("/"))
    stats = device.collect()
    assert 0 < stats["process.rss_mb"] < 1024 * 1024
    assert stats["process.cpu_percent"] >= 0.0
    assert stats["process.threads"] >= 1
    assert 0.0 <= stats["cpu.percent"] <= 100.0
    assert stats["memory.available_mb"] > 0
    assert stats["memory.used_mb"] > 0
    assert 0.0 < stats["memory.percent"] < 100.0
    for key, value in stats.items():
        if key.startswith("temp."):
            assert -100.0 < value < 200.0, key
