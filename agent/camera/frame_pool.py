"""Image buffers a driver decodes into again, once nothing else holds them.

A decoder that writes into a fresh array per frame makes the allocator hand out (and the kernel
fault in) a frame's worth of pages again and again: the frame path keeps several frames alive at
once (the stream's queue, the batch in inference, the snapshot board's pair, the shadow run's latest
frame), so the freed array is rarely the one handed out next. A :class:`FramePool` keeps up to
``capacity`` arrays of the stream's frame size and lends one back to the decoder only when nothing
outside the pool references it.

Safe by construction, without any stage giving buffers back: "nothing references it" is read from
the array's reference count, under the GIL. A :class:`~agent.camera.frame.Frame` in a queue, a view
(``image[:, :, 0]`` keeps its base alive), a snapshot, a sample waiting to be encoded, a frame an
evidence heap keeps, a C call in progress on another thread (its argument tuple holds the array):
each is a reference, and a buffer with one is never written to. (The GPU path's upload,
``cupy.ndarray.set`` from pageable memory, returns once the host pixels have been read.) Nobody
can take a new reference to a buffer nobody holds, so the check cannot race. When every buffer is
held (a slow consumer), the decoder gets no buffer and allocates as before; the new array takes the
slot of a held one, so frames held for long do not keep the pool from being reused.

Where a slot preprocesses on the GPU, the pool is given an allocator of page-locked (pinned) host
memory (:meth:`FramePool.allocate_with`): a frame the decoder wrote into a new array is then not
kept, a page-locked buffer of its size is made in its place, and from the next frame on the decoder
writes straight into page-locked memory. The upload to the GPU then runs at the bus's speed and
asynchronously, with no copy into a staging buffer (:mod:`agent.camera.gpu_preprocess`).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable

import numpy as np
import numpy.typing as npt

Image = npt.NDArray[np.uint8]
#: Makes a new, contiguous uint8 buffer of a frame's shape (page-locked memory, for the GPU path).
Allocator = Callable[[tuple[int, ...]], Image]

#: Buffers kept per stream: the frames in flight on a default stream (queue of 4, a batch of up to 4,
#: the snapshot board's two, the shadow run's latest) fit; more in flight only allocate as before.
DEFAULT_CAPACITY = 12


def _refs(buffers: list[Image], i: int) -> int:
    """References to ``buffers[i]``, counted the same way for the calibration below and the pool."""
    return sys.getrefcount(buffers[i])


#: What :func:`_refs` reads for an array only a list holds (2 on CPython 3.11: the list and the
#: call's argument). Measured, not assumed: newer interpreters borrow references on the stack.
_FREE_REFS = _refs([np.empty(1, np.uint8)], 0)


class FramePool:
    """Up to ``capacity`` reusable frame buffers of one shape (the stream's latest frame size).

    Used by one decoding thread: :meth:`take` before a decode, :meth:`keep` after it. The counters
    are read by anyone (telemetry, tests).
    """

    def __init__(self, capacity: int = DEFAULT_CAPACITY, allocate: Allocator | None = None) -> None:
        self.capacity = capacity
        self._allocate = allocate
        self._buffers: list[Image] = []
        self._lock = threading.Lock()  # take/keep from the decoder vs clear() from a closing thread
        self._evict = -1  # the slot a new array took last when all were held
        #: Decodes written into a pooled buffer / into a fresh array (none free, or the first ones).
        self.reused = 0
        self.allocated = 0

    def allocate_with(self, allocate: Allocator | None) -> None:
        """Make the pool's buffers with ``allocate`` from now on (None: keep the decoder's arrays).

        The buffers made otherwise are forgotten (their holders keep them), so the next decodes
        fill the pool with buffers of the new kind. Called by the decoding thread.
        """
        with self._lock:
            if allocate == self._allocate:  # a bound method is a new object at each access
                return
            self._allocate = allocate
            self._buffers = []

    def take(self) -> Image | None:
        """A buffer no one else references, to decode the next frame into; None: decode into a new one."""
        with self._lock:
            buffers = self._buffers
            for i in range(len(buffers)):
                if _refs(buffers, i) == _FREE_REFS:
                    return buffers[i]
            return None

    def keep(self, image: Image, taken: Image | None) -> None:
        """After a decode: ``image`` is what the decoder returned, ``taken`` what :meth:`take` lent.

        A decoder that wrote into ``taken`` returns that very array. Anything else is a new array (no
        buffer was free, or the frame size changed): kept while there is room, else in place of one
        of the held buffers, in turn (a frame held for long, an evidence frame, must not keep its
        slot for good); a new size replaces the buffers of the old one. A buffer the pool forgets
        lives on until its holders let go of it.
        """
        if image is taken:
            self.reused += 1
            return
        self.allocated += 1
        if image.ndim != 3 or image.dtype != np.uint8 or not image.flags.c_contiguous:
            return
        with self._lock:
            if self._buffers and self._buffers[0].shape != image.shape:
                self._buffers = []
            if self._allocate is not None:
                # The decoder's own array serves this frame; the next ones land in a made buffer.
                if len(self._buffers) < self.capacity:
                    self._buffers.append(self._allocate(image.shape))
                return
            if len(self._buffers) < self.capacity:
                self._buffers.append(image)
            elif self.capacity > 0:
                self._evict = (self._evict + 1) % self.capacity
                self._buffers[self._evict] = image

    def clear(self) -> None:
        """Forget every buffer (the driver closed: its memory goes back once the frames are done)."""
        with self._lock:
            self._buffers = []

    def __len__(self) -> int:
        with self._lock:
            return len(self._buffers)
