"""A calibration image folder made from a video file or a camera stream (``edge-agent build --calib-from``).

INT8 needs images like the ones the model will see; the operator usually has a recording or a
camera, not a folder of stills. :func:`write_calibration_frames` takes ``count`` frames spread over
the whole of a video file (evenly spaced by frame number, so a recording's scenes are all in) or,
from a stream whose length OpenCV cannot tell (RTSP/HTTP URL, a file without a frame count), every
:data:`STREAM_STRIDE`-th frame, and writes them as JPEG files that ``--calib DIR`` (a ``dataset``
calibration source) reads.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from agent.engines.calibration.data import dataset_images
from agent.errors import BuildError
from agent.fsutil import atomic_write_bytes, fsync_directory

#: From a stream of unknown length: one frame in this many (consecutive camera frames are near copies).
STREAM_STRIDE = 10
#: JPEG quality of the written frames: a recompression well below what calibration ranges notice.
JPEG_QUALITY = 95


def frame_numbers(total: int, count: int) -> list[int]:
    """``count`` frame numbers spread evenly over ``0..total-1`` (all of them when ``count >= total``)."""
    if total <= count:
        return list(range(total))
    return sorted({(i * total) // count for i in range(count)})


def write_calibration_frames(
    source: str,
    out_dir: Path,
    count: int,
    *,
    progress: Callable[[str], None] | None = None,
) -> list[Path]:
    """Write up to ``count`` frames of ``source`` (a video file or a stream URL) into ``out_dir``.

    ``out_dir`` is created; it must not hold images already (frames of two sources would mix into
    one calibration without anyone noticing). Each frame is written atomically as
    ``frame-NNNNNN.jpg`` (its frame number). Raises BuildError naming what was wrong.
    """
    import cv2

    if count < 1:
        raise BuildError("--calib-frames must be 1 or more")
    is_url = "://" in source
    if not is_url and not Path(source).is_file():
        raise BuildError(f"--calib-from {source}: no such video file")
    if out_dir.exists() and not out_dir.is_dir():
        raise BuildError(f"--calib {out_dir} is a file, not a directory for the frames")
    if out_dir.is_dir() and dataset_images(out_dir):
        raise BuildError(
            f"--calib {out_dir} already holds images: calibrate on them with --calib alone, "
            "or name an empty directory for the frames of --calib-from"
        )
    capture = cv2.VideoCapture(source)
    try:
        if not capture.isOpened():
            raise BuildError(f"--calib-from {source}: OpenCV cannot open it (not a video, or no decoder)")
        total = int(capture.get(cv2.CAP_PROP_FRAME_COUNT) or 0)
        wanted = set(frame_numbers(total, count)) if total > 0 and not is_url else None
        out_dir.mkdir(parents=True, exist_ok=True)
        written: list[Path] = []
        number = 0
        while len(written) < count:
            if wanted is not None and number > max(wanted):
                break
            take = number in wanted if wanted is not None else number % STREAM_STRIDE == 0
            # grab() without retrieve() skips the colour conversion of frames not taken.
            if not capture.grab():
                break
            if take:
                ok, frame = capture.retrieve()
                if ok and frame is not None:
                    encoded_ok, encoded = cv2.imencode(
                        ".jpg", frame, [cv2.IMWRITE_JPEG_QUALITY, JPEG_QUALITY]
                    )
                    if not encoded_ok:
                        raise BuildError(f"OpenCV could not encode frame {number} of {source} as JPEG")
                    path = out_dir / f"frame-{number:06d}.jpg"
                    atomic_write_bytes(path, encoded.tobytes())
                    written.append(path)
                    if progress is not None and len(written) % 50 == 0:
                        progress(f"calibration frames: {len(written)} of {count}")
            number += 1
    finally:
        capture.release()
    if not written:
        raise BuildError(f"--calib-from {source}: no frame could be read (empty video, or no decoder)")
    fsync_directory(out_dir)
    return written
