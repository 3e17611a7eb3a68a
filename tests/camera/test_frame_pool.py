"""Decoding into reused buffers: a buffer is written again only once nothing references it.

Real video (``agent.demo.setup.write_demo_video``, MJPG) decoded by the real file source; the
reference pixels come from a second, plain ``cv2.VideoCapture`` of the same file.
"""

from __future__ import annotations

import threading
from pathlib import Path

import cv2
import numpy as np
import pytest

from agent.camera.frame import Frame
from agent.camera.frame_pool import FramePool
from agent.camera.source import VideoSource
from agent.camera.source_spec import FileSourceSpec
from agent.demo.setup import write_demo_video
from tests.camera.specs import make

FRAMES = 60


@pytest.fixture(scope="module")
def clip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_demo_video(tmp_path_factory.mktemp("pool") / "clip.avi", frames=FRAMES, fps=30.0)


@pytest.fixture(scope="module")
def reference(clip: Path) -> list[np.ndarray]:
    """Every frame of the clip, each decoded into its own new array."""
    cap = cv2.VideoCapture(str(clip))
    frames = []
    while True:
        ok, image = cap.read()
        if not ok:
            break
        frames.append(image)
    cap.release()
    assert len(frames) == FRAMES
    return frames


def test_a_buffer_is_lent_again_only_when_nothing_else_holds_it() -> None:
    pool = FramePool(capacity=2)
    image = np.zeros((4, 6, 3), np.uint8)
    pool.keep(image, None)
    assert pool.take() is None  # ``image`` (this test's variable) still holds it
    view = image[:, :, 0]
    frame = Frame("s", 0, image, 0.0, 0.0)
    del image
    assert pool.take() is None  # the frame and the view hold it
    del frame
    assert pool.take() is None  # the view alone keeps its base
    del view
    lent = pool.take()
    assert lent is not None
    assert lent.shape == (4, 6, 3)
    pool.keep(lent, lent)  # decoded into it
    assert (pool.reused, pool.allocated) == (1, 1)


def test_the_pool_keeps_at_most_capacity_buffers_and_forgets_them_when_the_size_changes() -> None:
    pool = FramePool(capacity=2)
    held = [np.zeros((4, 6, 3), np.uint8) for _ in range(3)]
    for image in held:
        pool.keep(image, None)
    assert len(pool) == 2
    # All held: the third took a slot of a held one, which lives on with its holder.
    assert pool.take() is None
    del held[0]
    assert pool.take() is None  # the forgotten buffer is not lent however free it gets
    pool.keep(np.zeros((8, 6, 3), np.uint8), None)
    assert len(pool) == 1
    assert pool.allocated == 4
    del held
    lent = pool.take()
    assert lent is not None
    assert lent.shape == (8, 6, 3)


def test_frames_held_by_later_stages_keep_their_pixels_while_released_ones_are_decoded_into_again(
    clip: Path, reference: list[np.ndarray]
) -> None:
    # Every 5th frame is held to the end (as a snapshot, a sample or a shadow run holds one), every
    # other one is dropped as soon as the next arrives (inferred and released).
    source = VideoSource("cam", make(FileSourceSpec, path=clip, loop=False))
    held: list[Frame] = []
    addresses: list[int] = []
    for frame in source.frames(threading.Event()):
        addresses.append(frame.image.__array_interface__["data"][0])
        np.testing.assert_array_equal(frame.image, reference[frame.index])
        if frame.index % 5 == 0:
            held.append(frame)
    assert len(addresses) == FRAMES
    for frame in held:
        np.testing.assert_array_equal(frame.image, reference[frame.index], err_msg=f"frame {frame.index}")
    # Each held frame's buffer was never lent again: no later frame was decoded at its address.
    for frame in held:
        address = frame.image.__array_interface__["data"][0]
        assert address not in addresses[frame.index + 1 :]
    pool = source._driver.buffers
    # The released frames were decoded into the same few buffers again: a new array only for each
    # frame held and the two in rotation (the frame being decoded, the consumer's previous one).
    assert pool.allocated <= len(held) + 3
    assert pool.reused == FRAMES - pool.allocated
    assert len(pool) == 0  # the ended source let go of its buffers


def test_a_stage_holding_every_frame_makes_the_source_decode_into_new_arrays(
    clip: Path, reference: list[np.ndarray]
) -> None:
    source = VideoSource("cam", make(FileSourceSpec, path=clip, loop=False))
    held = list(source.frames(threading.Event()))
    assert [f.index for f in held] == list(range(FRAMES))
    for frame in held:
        np.testing.assert_array_equal(frame.image, reference[frame.index])
    assert len({id(f.image) for f in held}) == FRAMES
    assert source._driver.buffers.reused == 0


def test_a_looping_file_reuses_buffers_across_the_rewind(clip: Path, reference: list[np.ndarray]) -> None:
    source = VideoSource("cam", make(FileSourceSpec, path=clip, loop=True))
    stop = threading.Event()
    kept: Frame | None = None
    for frame in source.frames(stop):
        np.testing.assert_array_equal(frame.image, reference[frame.index % FRAMES])
        if frame.index == FRAMES - 1:
            kept = frame  # the last frame before the rewind stays held across it
        if frame.index == 2 * FRAMES + 3:
            stop.set()
    assert kept is not None
    np.testing.assert_array_equal(kept.image, reference[FRAMES - 1])
    assert source._driver.buffers.reused > FRAMES


class _MadeBuffers:
    """An allocator of the pool's own buffers that remembers what it made. On the GPU path this is
    page-locked memory (``PinnedFrames.empty``, cudaHostAlloc through CuPy, tested in
    tests/camera/test_gpu_preprocess.py on a GPU); here, with no CUDA, plain numpy memory stands in:
    the pool's logic does not depend on the kind of memory."""

    def __init__(self) -> None:
        self.made: dict[int, tuple[int, ...]] = {}

    def __call__(self, shape: tuple[int, ...]) -> np.ndarray:
        image = np.empty(shape, np.uint8)
        self.made[image.__array_interface__["data"][0]] = shape
        return image

    def holds(self, image: np.ndarray) -> bool:
        return image.__array_interface__["data"][0] in self.made


def test_with_an_allocator_the_decoder_writes_every_frame_after_the_first_into_the_made_buffers(
    clip: Path, reference: list[np.ndarray]
) -> None:
    made = _MadeBuffers()
    source = VideoSource("cam", make(FileSourceSpec, path=clip, loop=False))
    outside: list[int] = []
    for frame in source.frames(threading.Event()):
        if frame.index == 0:
            source.decode_into(made)  # from the decoding thread, as the capture stage does
        np.testing.assert_array_equal(frame.image, reference[frame.index])
        if not made.holds(frame.image):
            outside.append(frame.index)

    # Frame 0 came before the allocator; after it, a frame lands in the decoder's own array only
    # while the pool grows (no made buffer free yet), and each such frame makes one more buffer.
    assert outside[:2] == [0, 1]
    assert len(made.made) == len(outside) - 1
    assert len(made.made) <= 3  # the frame being decoded and the consumer's previous one
    assert all(shape == reference[0].shape for shape in made.made.values())


def test_frames_held_everywhere_make_the_pool_grow_its_made_buffers_up_to_capacity_and_no_further() -> None:
    made = _MadeBuffers()
    pool = FramePool(capacity=3, allocate=made)
    held = []
    for _ in range(8):
        taken = pool.take()
        image = np.zeros((4, 6, 3), np.uint8) if taken is None else taken
        pool.keep(image, taken)
        held.append(image)  # a stage holds every frame
        del taken, image
    assert len(made.made) == 3
    assert pool.take() is None  # every made buffer is held
    pool.keep(np.zeros((4, 6, 3), np.uint8), None)  # decoded into a new array: none made beyond capacity
    assert len(made.made) == 3
    held.clear()
    lent = pool.take()
    assert lent is not None
    assert made.holds(lent)


def test_giving_the_pool_another_allocator_forgets_its_buffers_and_the_same_one_keeps_them() -> None:
    made = _MadeBuffers()
    pool = FramePool(capacity=2)
    pool.keep(np.zeros((4, 6, 3), np.uint8), None)
    assert len(pool) == 1
    pool.allocate_with(made)
    assert len(pool) == 0  # a decoder's own array is not what the new allocator makes
    pool.keep(np.zeros((4, 6, 3), np.uint8), None)
    pool.allocate_with(made)  # the same again: nothing changes
    assert len(pool) == 1
    lent = pool.take()
    assert lent is not None
    assert made.holds(lent)
    pool.allocate_with(None)
    assert len(pool) == 0
