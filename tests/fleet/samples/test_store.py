"""The controller's sample store, as files and in a real PostgreSQL (each test runs on both where it is
not about one of them): bounds in count, bytes and per device, oldest evicted, a restart (or another
controller) reads back, bad input refused; and the export a labelling tool reads (COCO JSON re-read,
class folders of JPEGs)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import cv2
import pytest

from agent.fleet.samples.export import FORMATS, export_samples
from agent.fleet.samples.pg_store import PostgresSampleStore
from agent.fleet.samples.store import FileSampleStore, SampleBounds, SampleStore
from agent.fleet.statedb.postgres import DatabaseUnavailableError, StateDatabase
from agent.protocol.results import Detection, Prediction
from agent.protocol.samples import SampleMessage
from tests.fleet.samples.driver import BOUNDS
from tests.fleet.samples.made import low_class, made_sample
from tests.postgres_server import PostgresServer
from tests.tcp_proxy import FreezableProxy
from tests.waiting import patient

ROOT = Path(__file__).resolve().parents[3]

#: Opens the test's store (again: a restart, or another controller on the same database).
OpenStore = Callable[[SampleBounds | None], SampleStore]


@pytest.fixture(params=["file", "postgresql"])
def open_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[OpenStore]:
    """The store as files under ``tmp_path/samples``, or in a fresh database of the tests' PostgreSQL."""
    opened: list[SampleStore] = []
    if request.param == "file":

        def opening(bounds: SampleBounds | None) -> SampleStore:
            opened.append(FileSampleStore(tmp_path / "samples", bounds))
            return opened[-1]

    else:
        server: PostgresServer = request.getfixturevalue("postgres")
        address = server.conninfo(server.new_database())

        def opening(bounds: SampleBounds | None) -> SampleStore:
            opened.append(PostgresSampleStore(StateDatabase(address), bounds))
            return opened[-1]

    yield opening
    for store in opened:
        store.close()


def _low_boxes() -> Prediction:
    return Prediction(
        detections=[
            Detection(index=0, label="person", score=0.4, box=(32, 24, 96, 120)),
            Detection(index=2, label="car", score=0.9, box=(100, 100, 300, 200)),
        ]
    )


def test_one_device_cannot_fill_the_store(open_store: OpenStore) -> None:
    store = open_store(SampleBounds(max_count=10, max_bytes=10**9, per_device=3))
    other = store.add("quiet", made_sample(low_class(), 100))
    assert other is not None
    for frame in range(6):
        store.add("loud", made_sample(low_class(), frame))
    kept = store.samples()
    assert [s.device for s in kept].count("loud") == 3
    assert other in kept
    assert [store.read(s).frame for s in kept if s.device == "loud"] == [3, 4, 5]  # the oldest went
    assert store.evicted == 3
    assert len(kept) == 4


def test_count_and_bytes_bounds_evict_the_oldest_and_a_restart_reads_back(open_store: OpenStore) -> None:
    store = open_store(SampleBounds(max_count=3, max_bytes=10**9, per_device=100))
    for frame in range(5):
        store.add(f"d{frame}", made_sample(low_class(), frame))
    assert [s.device for s in store.samples()] == ["d2", "d3", "d4"]
    size = store.samples()[0].size
    # Below the configurable 1 MiB floor, so built unchecked: room for two and a half samples.
    bounds = SampleBounds.model_construct(max_count=100, max_bytes=size * 2 + size // 2, per_device=100)
    tight = open_store(bounds)
    assert [s.device for s in tight.samples()] == ["d2", "d3", "d4"]  # read back
    tight.add("d5", made_sample(low_class(), 5))
    assert [s.device for s in tight.samples()] == ["d4", "d5"]
    assert tight.held_bytes() <= tight.bounds.max_bytes
    assert [tight.read(s).frame for s in tight.samples()] == [4, 5]


def test_the_file_store_keeps_one_file_per_sample_and_deletes_the_evicted(tmp_path: Path) -> None:
    store = FileSampleStore(tmp_path, SampleBounds(max_count=2, max_bytes=10**9, per_device=100))
    for frame in range(4):
        store.add(f"d{frame}", made_sample(low_class(), frame))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(store.path_of(s).name for s in store)
    assert len(list(tmp_path.glob("*.json"))) == 2


def test_coco_export_is_read_back_with_boxes_in_the_jpegs_pixels(
    open_store: OpenStore, tmp_path: Path
) -> None:
    store = open_store(None)
    store.add("dev-a", made_sample(_low_boxes(), 1, slot="det"))
    store.add("dev-b", made_sample(_low_boxes(), 2, slot="det"))
    store.add("dev-b", made_sample(low_class(), 3, slot="cls"))  # a classifier's: not COCO
    summary = export_samples(store, "coco", tmp_path / "out")
    assert (summary.images, summary.annotations, summary.skipped) == (2, 4, 1)
    coco = json.loads((tmp_path / "out" / "annotations.json").read_text())
    assert {c["name"]: c["id"] for c in coco["categories"]} == {"person": 1, "car": 3}
    assert len(coco["images"]) == 2
    assert len(coco["annotations"]) == 4
    for image in coco["images"]:
        pixels = cv2.imread(str(tmp_path / "out" / image["file_name"]))
        assert pixels is not None
        assert (pixels.shape[1], pixels.shape[0]) == (image["width"], image["height"]) == (160, 120)
    person = next(a for a in coco["annotations"] if a["category_id"] == 1)
    assert person["bbox"] == [16.0, 12.0, 32.0, 48.0]  # halved: the 320x240 frame became 160x120
    assert person["score"] == 0.4


def test_folders_export_puts_each_jpeg_under_its_top_label(open_store: OpenStore, tmp_path: Path) -> None:
    store = open_store(None)
    store.add("dev-a", made_sample(low_class("cat"), 1))
    store.add("dev-a", made_sample(low_class("../escape"), 2))
    store.add("dev-a", made_sample(_low_boxes(), 3))
    summary = export_samples(store, "folders", tmp_path / "out")
    assert (summary.images, summary.skipped) == (2, 1)
    folders = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert folders == ["_escape", "cat"]
    for folder in folders:
        (jpeg,) = (tmp_path / "out" / folder).glob("*.jpg")
        assert cv2.imread(str(jpeg)) is not None


def test_a_resent_sample_is_kept_once(open_store: OpenStore) -> None:
    store = open_store(None)
    sample = made_sample(low_class(), 1)
    assert store.add("cam-1", sample) is not None
    assert store.add("cam-1", sample) is None  # the QoS 1 resend of the same msg_id
    assert store.add("cam-2", sample) is not None  # another device's message is its own
    assert len(store.samples()) == 2


def test_a_sample_over_the_bytes_bound_alone_is_refused_and_nothing_is_evicted(
    open_store: OpenStore,
) -> None:
    first = made_sample(low_class(), 1)
    store = open_store(None)
    store.add("cam-1", first)
    size = store.samples()[0].size
    small = open_store(SampleBounds.model_construct(max_count=100, max_bytes=size - 1, per_device=100))
    with pytest.raises(ValueError, match=rf"a sample of {size} bytes is over the store's {size - 1}"):
        small.add("cam-2", made_sample(low_class(), 1))
    assert [(s.device, s.size) for s in small.samples()] == [("cam-1", size)]
    assert small.evicted == 0


@pytest.mark.parametrize("device", ["", "a/b", "cam+", "cam#"])
def test_a_device_id_that_is_not_one_topic_level_is_refused_naming_it(
    open_store: OpenStore, device: str
) -> None:
    store = open_store(None)
    with pytest.raises(ValueError, match="device id"):
        store.add(device, made_sample(low_class(), 1))
    assert store.samples() == []


def test_a_second_store_on_the_same_database_sees_the_samples_and_exports_the_same_bytes(
    postgres: PostgresServer, tmp_path: Path
) -> None:
    """Two controllers on two hosts: the second has none of the first's files, only the database."""
    address = postgres.conninfo(postgres.new_database())
    first = PostgresSampleStore(StateDatabase(address, name="host-a"))
    first.add("dev-a", made_sample(_low_boxes(), 1, slot="det"))
    first.add("dev-b", made_sample(low_class(), 2))
    first.add("dev-b", made_sample(_low_boxes(), 3, slot="det"))
    second = PostgresSampleStore(StateDatabase(address, name="host-b"))
    try:
        assert second.samples() == first.samples()
        assert second.add("dev-a", first.read(first.samples()[0])) is None  # kept once, whoever took it
        for fmt in FORMATS:
            export_samples(first, fmt, tmp_path / f"a-{fmt}")
            export_samples(second, fmt, tmp_path / f"b-{fmt}")
            assert _tree(tmp_path / f"a-{fmt}") == _tree(tmp_path / f"b-{fmt}") != {}
    finally:
        first.close()
        second.close()


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_two_stores_adding_at_once_keep_the_bounds_as_one_store_adding_in_their_order(
    postgres: PostgresServer, tmp_path: Path
) -> None:
    """Two controllers' stores on one database add at the same time (threads on their own
    connections): the result is exactly what one store adding the same samples in commit order
    keeps (count, bytes and per device, oldest first), and every sample is kept or counted evicted."""
    samples = [made_sample(low_class(), frame) for frame in range(60)]
    size = max(len(s.model_dump_json()) for s in samples) + 200
    bounds = SampleBounds.model_construct(max_count=9, max_bytes=size * 7, per_device=4)
    address = postgres.conninfo(postgres.new_database())
    stores = [PostgresSampleStore(StateDatabase(address, name=f"host-{n}"), bounds) for n in range(2)]
    start = threading.Barrier(2, timeout=patient(10))
    taken: list[tuple[int, str, SampleMessage]] = []

    def adding(store: PostgresSampleStore, mine: list[SampleMessage], side: int) -> None:
        start.wait()
        for n, sample in enumerate(mine):
            device = f"cam-{(n + side) % 3}"
            stored = store.add(device, sample)
            assert stored is not None
            taken.append((stored.seq, device, sample))

    threads = [
        threading.Thread(target=adding, args=(stores[side], samples[side::2], side)) for side in (0, 1)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(patient(60))
        assert not thread.is_alive()
    try:
        assert len(taken) == len(samples)
        kept = [(stored.device, sample.msg_id) for stored, sample in stores[1].read_all()]
        assert sum(s.evicted for s in stores) == len(samples) - len(kept)
        assert len(kept) <= bounds.max_count
        assert stores[1].held_bytes() <= bounds.max_bytes
        for device in {d for d, _ in kept}:
            assert [d for d, _ in kept].count(device) <= bounds.per_device
        # Each add holds the table until it commits, so the sequence numbers are the commit order:
        # one store adding the same samples in that order keeps exactly the same ones.
        replay = FileSampleStore(tmp_path / "replay", bounds)
        for _, device, sample in sorted(taken, key=lambda t: t[0]):
            replay.add(device, sample)
        assert [(s.device, replay.read(s).msg_id) for s in replay] == kept
        assert replay.evicted == sum(s.evicted for s in stores)
    finally:
        for store in stores:
            store.close()


def test_after_the_database_was_out_of_reach_a_sample_is_refused_at_once(
    postgres: PostgresServer,
) -> None:
    """The controller's message thread is not held a connect timeout per sample while the database
    is down: after one failed add, the next ones are refused without a connection attempt."""
    name = postgres.new_database()
    proxy = FreezableProxy("127.0.0.1", postgres.port).start()
    store = PostgresSampleStore(StateDatabase(postgres.conninfo(name, proxy.port)))
    try:
        assert store.add("cam-1", made_sample(low_class(), 1)) is not None
        proxy.refuse()
        proxy.cut()
        with pytest.raises(DatabaseUnavailableError, match="cannot be reached"):
            store.add("cam-1", made_sample(low_class(), 2))
        tried = proxy.attempts
        assert tried >= 1
        with pytest.raises(DatabaseUnavailableError, match="was out of reach less than 5 s ago"):
            store.add("cam-1", made_sample(low_class(), 3))
        assert proxy.attempts == tried  # not even tried
    finally:
        store.close()
    direct = PostgresSampleStore(StateDatabase(postgres.conninfo(name)))
    try:
        assert [s.device for s in direct.samples()] == ["cam-1"]  # the failed adds left nothing
    finally:
        direct.close()


@pytest.mark.parametrize("kill_after", [3, 25, 60])
def test_a_controller_killed_mid_add_leaves_every_sample_whole_and_the_bounds_kept(
    postgres: PostgresServer, kill_after: int
) -> None:
    """SIGKILL a real child process adding samples at its bounds (almost every add evicts): each add
    is one transaction, so the store reopens within its bounds, every sample it lists reads back
    whole, and the last add the child reported committed is there."""
    address = postgres.conninfo(postgres.new_database())
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.fleet.samples.driver", address],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    last, added = -1, 0
    while added < kill_after:
        line = child.stdout.readline()
        assert line, "the child ended before it was killed"
        if line.startswith("added "):  # the rest is its log
            last, added = int(line.split()[1]), added + 1
    os.kill(child.pid, signal.SIGKILL)
    for rest in child.stdout.read().splitlines():  # printed before it died: committed too
        if rest.startswith("added "):
            last = int(rest.split()[1])
    child.wait(timeout=patient(10))
    assert child.returncode == -signal.SIGKILL

    store = PostgresSampleStore(StateDatabase(address), BOUNDS)
    try:
        kept = store.samples()
        read = list(store.read_all())
        assert [stored for stored, _ in read] == kept  # each one whole
        assert last in {s.seq for s in kept}
        assert max(s.seq for s in kept) <= last + 1  # at most the add in flight besides
        assert len(kept) <= BOUNDS.max_count
        assert store.held_bytes() <= BOUNDS.max_bytes
        assert max(Counter(s.device for s in kept).values()) <= BOUNDS.per_device
    finally:
        store.close()
