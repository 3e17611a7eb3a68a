"""An HTTP(S) model source with ``Range`` resume (stdlib ``urllib``, no extra dependency).

The download resumes at the first missing chunk with ``Range: bytes=<offset>-`` and, once the
server has shown a strong validator, ``If-Range: <ETag or Last-Modified>``: if the file changed the
server answers 200 with the whole body, which is read from offset 0. Either way every chunk is
verified against the manifest through :class:`~agent.delivery.transfer.partial.PartialDownload`, so a
server that ignores ``Range``, or serves another file, can never put wrong bytes in the model.

A connection that drops mid-body keeps every complete chunk and resumes with ``Range``; attempts
that make no progress are bounded (``max_attempts``), then ``http_failed``. 404 is final:
``http_not_found``.
"""

from __future__ import annotations

import http.client
import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import IO, Any

import structlog

from agent.backoff import reconnect_delay
from agent.delivery.transfer.partial import PartialDownload
from agent.protocol.delivery_errors import (
    HttpFailedError,
    HttpNotFoundError,
    JobCancelledError,
    TransferTimeoutError,
)

log = structlog.get_logger(__name__)

_CONTENT_RANGE = re.compile(r"^bytes\s+(\d+)-(\d+)/(\d+|\*)$")
#: Statuses worth another attempt (server busy or broken for a moment).
_RETRY_STATUSES = frozenset({408, 425, 429, 500, 502, 503, 504})


class _InterruptedError(Exception):
    """One attempt ended early in a way that another attempt may fix."""


class HttpSource:
    """Download a model from ``url`` into a :class:`PartialDownload`, resuming with ``Range``."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float,
        cancel: threading.Event | None = None,
        deadline: float | None = None,
        max_attempts: int = 4,
        retry_delay_s: float = 0.5,
        opener: urllib.request.OpenerDirector | None = None,
    ) -> None:
        """``timeout_s``: connect and per-read socket timeout. ``deadline``: monotonic time limit.

        ``max_attempts``: consecutive attempts without progress before giving up (an attempt that
        wrote at least one chunk resets the count).
        """
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"not an http(s) URL: {url!r}")
        self.url = url
        self.timeout_s = timeout_s
        self._cancel = cancel or threading.Event()
        self._deadline = deadline
        self.max_attempts = max_attempts
        self.retry_delay_s = retry_delay_s
        self._opener = opener or urllib.request.build_opener()
        self._validator: str | None = None
        #: Requests sent, and how many of them were answered 200 to a Range request (restarts).
        self.attempts = 0
        self.restarts = 0

    def fetch(self, partial: PartialDownload, progress: Callable[[int, int], None] | None = None) -> None:
        """Write every missing chunk of ``partial``.

        Raises HttpNotFoundError, HttpFailedError, JobCancelledError or TransferTimeoutError.
        """
        failures = 0
        try:
            while not partial.complete:
                self._check_stop(partial)
                before = partial.bytes_done
                try:
                    self._attempt(partial, progress)
                except _InterruptedError as exc:
                    failures = 0 if partial.bytes_done > before else failures + 1
                    log.warning(
                        "delivery.http.interrupted",
                        url=self.url,
                        error=str(exc),
                        have=partial.bytes_done,
                        size=partial.manifest.size,
                        failures=failures,
                    )
                    if failures >= self.max_attempts:
                        raise HttpFailedError(
                            f"GET {self.url} failed {failures} times in a row without progress "
                            f"(last: {exc}); check the server and the network, or list an mqtt source "
                            "in the manifest"
                        ) from exc
                    # Jittered like the MQTT reconnect: a fleet behind one flaky proxy does not retry in step.
                    delay = reconnect_delay(
                        max(failures - 1, 0), self.retry_delay_s, max(self.retry_delay_s, 10.0)
                    )
                    if self._cancel.wait(delay):
                        continue  # _check_stop raises JobCancelledError
        finally:
            partial.flush()

    def _check_stop(self, partial: PartialDownload) -> None:
        if self._cancel.is_set():
            raise JobCancelledError(f"download of {self.url} cancelled")
        if self._deadline is not None and time.monotonic() >= self._deadline:
            raise TransferTimeoutError(
                f"download of {self.url} not finished before the job deadline "
                f"({partial.bytes_done} of {partial.manifest.size} bytes); publish the manifest again "
                "to continue (downloaded chunks are kept)"
            )

    def _attempt(self, partial: PartialDownload, progress: Callable[[int, int], None] | None) -> None:
        offset = partial.contiguous_offset()
        headers = {"Accept-Encoding": "identity"}
        if offset > 0:
            headers["Range"] = f"bytes={offset}-"
            if self._validator is not None:
                headers["If-Range"] = self._validator
        # The scheme was checked in __init__ (http/https only), so no file: URLs reach urlopen.
        request = urllib.request.Request(self.url, headers=headers)  # noqa: S310
        self.attempts += 1
        try:
            response = self._opener.open(request, timeout=self.timeout_s)
        except urllib.error.HTTPError as exc:
            exc.close()
            if exc.code == 404:
                raise HttpNotFoundError(
                    f"GET {self.url}: 404 Not Found; fix the URL in the manifest or upload the model there"
                ) from exc
            if exc.code in _RETRY_STATUSES:
                raise _InterruptedError(f"HTTP {exc.code} {exc.reason}") from exc
            raise HttpFailedError(
                f"GET {self.url}: HTTP {exc.code} {exc.reason}; check the URL and server"
            ) from exc
        except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
            raise _InterruptedError(f"cannot connect: {exc}") from exc
        with response:
            start = self._start_offset(response, offset, partial.manifest.size)
            self._remember_validator(response)
            self._consume(response, start, partial, progress)

    def _start_offset(self, response: Any, offset: int, size: int) -> int:
        status = int(response.status)
        if status == 206:
            match = _CONTENT_RANGE.match(response.headers.get("Content-Range", ""))
            if match is None or int(match.group(1)) != offset:
                raise _InterruptedError(
                    f"206 with unexpected Content-Range {response.headers.get('Content-Range')!r}"
                )
            if match.group(3) != "*" and int(match.group(3)) != size:
                raise HttpFailedError(
                    f"GET {self.url}: the server's file has {match.group(3)} bytes, the manifest says "
                    f"{size}; the URL points at another file"
                )
            return offset
        if status == 200:
            if offset > 0:
                # Range ignored, or If-Range said the file changed: the whole body follows.
                self.restarts += 1
                log.info("delivery.http.restart", url=self.url, offset=offset)
            return 0
        raise HttpFailedError(f"GET {self.url}: unexpected HTTP {status}; the server must answer 200 or 206")

    def _remember_validator(self, response: Any) -> None:
        etag = response.headers.get("ETag")
        # If-Range needs a strong validator: a weak ETag (W/"...") never matches.
        if etag and not etag.startswith("W/"):
            self._validator = etag
        elif response.headers.get("Last-Modified"):
            self._validator = response.headers["Last-Modified"]

    def _consume(
        self,
        body: IO[bytes],
        start: int,
        partial: PartialDownload,
        progress: Callable[[int, int], None] | None,
    ) -> None:
        chunk_size = partial.manifest.chunk_size
        for index in range(start // chunk_size, partial.chunk_count):
            self._check_stop(partial)
            data = self._read_exact(body, partial.chunk_length(index))
            if partial.has(index):
                continue  # already there (another source, or the part before a 200 restart)
            if not partial.write_chunk(index, data):
                raise HttpFailedError(
                    f"GET {self.url}: chunk {index} does not match the manifest's SHA-256; the URL serves "
                    "another file than the manifest describes"
                )
            if progress is not None:
                progress(partial.bytes_done, partial.manifest.size)

    @staticmethod
    def _read_exact(body: IO[bytes], length: int) -> bytes:
        parts: list[bytes] = []
        remaining = length
        try:
            while remaining:
                block = body.read(remaining)
                if not block:
                    raise _InterruptedError(f"connection closed with {remaining} bytes of a chunk missing")
                parts.append(block)
                remaining -= len(block)
        except (OSError, http.client.HTTPException) as exc:  # reset, timeout, IncompleteRead
            raise _InterruptedError(f"connection dropped mid-body: {exc!r}") from exc
        return b"".join(parts)
