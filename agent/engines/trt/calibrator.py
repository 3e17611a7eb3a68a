"""TensorRT INT8 entropy calibrator (implicit quantization, TensorRT 8.5 to 10.x).

TensorRT pulls calibration batches through ``get_batch(names)`` and expects device pointers back,
then reads and writes its scale table through ``read/write_calibration_cache``. The TensorRT class
is defined inside :func:`make_entropy_calibrator`, so this module imports without TensorRT; the
batch bookkeeping (:class:`CalibrationFeed`) and the cache file I/O are plain Python and unit-tested.

TensorRT calls these methods from inside ``build_serialized_network``; an exception escaping into
TensorRT's C++ is at best printed and at worst aborts the process. So every failure is recorded in
:attr:`CalibrationFeed.error`, calibration is ended (``None``), and the builder raises it as a
:class:`~agent.errors.BuildError` after the build returns.

The cache bytes are passed through unchanged (TensorRT owns their format: ``TRT-<version>-
EntropyCalibration2`` then ``tensor: hex scale`` lines); :mod:`agent.model_contract.trt_cache` parses
and writes that format when another tool needs it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import structlog

from agent.backends.trt_api import tensorrt_status
from agent.errors import BuildError
from agent.fsutil import atomic_write_bytes

if TYPE_CHECKING:
    import tensorrt as trt

log = structlog.get_logger(__name__)

#: One calibration batch: an array for a single-input network, or arrays by input name.
CalibrationBatch = npt.NDArray[Any] | Mapping[str, npt.NDArray[Any]]


def read_cache_bytes(path: Path | None) -> bytes | None:
    """The calibration cache at ``path``, or None when there is none (or it is empty/unreadable).

    None makes TensorRT calibrate from the batches; an unreadable file is logged, not raised,
    because recalibrating is always a correct answer.
    """
    if path is None:
        return None
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.warning("engine.calibration.cache_unreadable", path=str(path), error=str(exc))
        return None
    return data or None


def write_cache_bytes(path: Path | None, data: bytes) -> None:
    """Store the cache TensorRT produced, atomically (temp file + fsync + rename)."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, data)


class CalibrationFeed:
    """Turns an iterator of preprocessed batches into per-input contiguous arrays for TensorRT.

    Each batch's first axis must equal ``batch_size``: TensorRT sizes its statistics from
    ``get_batch_size()`` and does not check the data it is handed.
    """

    def __init__(self, batches: Iterable[CalibrationBatch], batch_size: int) -> None:
        if batch_size < 1:
            raise BuildError(f"calibration batch size must be >= 1, got {batch_size}")
        self.batch_size = batch_size
        self._batches: Iterator[CalibrationBatch] = iter(batches)
        self.batches_served = 0
        self.error: BuildError | None = None
        self._done = False

    def next_feeds(self, names: Sequence[str]) -> dict[str, npt.NDArray[Any]] | None:
        """Arrays for ``names`` from the next batch; None when the batches are exhausted or bad."""
        if self._done:
            return None
        try:
            batch = next(self._batches)
            feeds = self._arrays_for(batch, names)
        except StopIteration:
            self._done = True
            return None
        except BuildError as exc:
            self._fail(exc)
            return None
        except Exception as exc:  # noqa: BLE001 - a broken data source must not reach TensorRT's C++
            self._fail(BuildError(f"calibration data source failed: {exc!r}"))
            return None
        self.batches_served += 1
        return feeds

    def _fail(self, error: BuildError) -> None:
        self.error = error
        self._done = True
        log.error("engine.calibration.batch_failed", error=str(error), batches=self.batches_served)

    def _arrays_for(self, batch: CalibrationBatch, names: Sequence[str]) -> dict[str, npt.NDArray[Any]]:
        if isinstance(batch, Mapping):
            missing = [n for n in names if n not in batch]
            if missing:
                raise BuildError(f"calibration batch lacks inputs {missing}; it has {sorted(batch)}")
            arrays = {n: batch[n] for n in names}
        else:
            if len(names) != 1:
                raise BuildError(
                    f"the network has {len(names)} inputs {list(names)}: give calibration batches "
                    "as a mapping of input name to array"
                )
            arrays = {names[0]: batch}
        out: dict[str, npt.NDArray[Any]] = {}
        for name, array in arrays.items():
            contiguous = np.ascontiguousarray(array)
            if contiguous.ndim == 0 or contiguous.shape[0] != self.batch_size:
                raise BuildError(
                    f"calibration batch for {name!r} has shape {contiguous.shape}; "
                    f"its first axis must be the batch size {self.batch_size}"
                )
            out[name] = contiguous
        return out


@dataclass(frozen=True)
class Calibrator:
    """A TensorRT calibrator with its feed (check ``feed.error`` after the build) and a way to
    free its device buffers (call ``release()`` after the build)."""

    trt_calibrator: trt.IInt8EntropyCalibrator2
    feed: CalibrationFeed
    release: Callable[[], None]


def make_entropy_calibrator(
    batches: Iterable[CalibrationBatch], *, batch_size: int, cache_path: Path | None
) -> Calibrator:
    """An ``IInt8EntropyCalibrator2`` fed from ``batches`` and caching to ``cache_path``.

    Needs TensorRT and cuda-python (the batches go to device memory).
    """
    ok, why = tensorrt_status()
    if not ok:
        raise BuildError(why)
    import tensorrt as trt

    from agent.backends import cuda

    feed = CalibrationFeed(batches, batch_size)

    class EntropyCalibrator(trt.IInt8EntropyCalibrator2):
        """Entropy calibration 2: the calibrator TensorRT requires for DLA."""

        def __init__(self) -> None:
            # Without the base __init__ the pybind11 trampoline is not set up and TensorRT crashes
            # on the first virtual call.
            trt.IInt8EntropyCalibrator2.__init__(self)
            self._device: dict[str, cuda.DeviceBuffer] = {}
            self._stream: cuda.Stream | None = None

        def get_batch_size(self) -> int:
            return feed.batch_size

        def get_batch(self, names: list[str]) -> list[int] | None:  # type: ignore[override]
            # None ends calibration (the stubs only declare list[int]; TensorRT accepts both).
            feeds = feed.next_feeds(names)
            if feeds is None:
                return None
            try:
                cuda.ensure_device(0)
                if self._stream is None:
                    self._stream = cuda.Stream()
                pointers = [self._upload(name, feeds[name]) for name in names]
                self._stream.synchronize()
            except Exception as exc:  # must not propagate into TensorRT's C++ (logged with traceback)
                feed.error = BuildError(f"calibration batch upload failed: {exc}")
                log.exception("engine.calibration.upload_failed")
                return None
            return pointers

        def _upload(self, name: str, array: npt.NDArray[Any]) -> int:
            buf = self._device.get(name)
            if buf is None or buf.nbytes < array.nbytes:
                if buf is not None:
                    buf.free()
                buf = cuda.DeviceBuffer(array.nbytes)
                self._device[name] = buf
            assert self._stream is not None
            cuda.copy_htod_async(buf, array, self._stream)
            return buf.ptr

        def read_calibration_cache(self) -> bytes | None:
            # None: no cache, calibrate from the batches (the stubs omit the None TensorRT accepts).
            return read_cache_bytes(cache_path)

        def write_calibration_cache(self, cache: Any) -> None:
            try:
                write_cache_bytes(cache_path, bytes(cache))
            except OSError as exc:
                # The engine is still good; only the next build will have to recalibrate.
                log.warning("engine.calibration.cache_write_failed", path=str(cache_path), error=str(exc))

        def release(self) -> None:
            """Free the device buffers and the stream. Idempotent."""
            for buf in self._device.values():
                buf.free()
            self._device.clear()
            if self._stream is not None:
                self._stream.destroy()
                self._stream = None

    calibrator = EntropyCalibrator()
    return Calibrator(trt_calibrator=calibrator, feed=feed, release=calibrator.release)
