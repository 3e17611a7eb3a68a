"""Why an RTSP camera would not open: ask it DESCRIBE ourselves and read the status it answers.

OpenCV says only "not opened"; FFmpeg's reason (401, 404, refused) goes to its log, not to the
caller. One DESCRIBE on a socket of our own, with the URL's credentials (Basic or Digest, as the
camera asks), tells a wrong password from a wrong path from a camera that is off. Only called
after a failed open, so a working camera never sees the extra request.
"""

from __future__ import annotations

import base64
import hashlib
import re
import socket
from urllib.parse import unquote, urlsplit

#: Longest header block read back; a camera's DESCRIBE answer headers are a few hundred bytes.
_MAX_HEADER_BYTES = 16384
_CHALLENGE_FIELD = re.compile(r'(\w+)="([^"]*)"')


def describe_status(url: str, timeout_s: float) -> int | None:
    """The status the camera at ``url`` answers DESCRIBE with (after one authentication round).

    None when it cannot be asked: no answer within ``timeout_s``, refused, not RTSP, or rtsps://.
    """
    parts = urlsplit(url)
    if parts.scheme != "rtsp" or not parts.hostname:
        return None
    user, password = unquote(parts.username or ""), unquote(parts.password or "")
    host = parts.hostname if ":" not in parts.hostname else f"[{parts.hostname}]"
    query = f"?{parts.query}" if parts.query else ""
    target = f"rtsp://{host}:{parts.port or 554}{parts.path or '/'}{query}"
    try:
        with socket.create_connection((parts.hostname, parts.port or 554), timeout=timeout_s) as sock:
            status, challenge = _describe(sock, target, 1, None)
            if status == 401 and user and challenge:
                status, _ = _describe(sock, target, 2, _authorization(challenge, user, password, target))
            return status
    except (OSError, ValueError):
        return None


def _describe(sock: socket.socket, target: str, cseq: int, authorization: str | None) -> tuple[int, str]:
    """Send DESCRIBE; return the status code and the WWW-Authenticate challenge ('' when none)."""
    lines = [f"DESCRIBE {target} RTSP/1.0", f"CSeq: {cseq}", "Accept: application/sdp"]
    if authorization:
        lines.append(f"Authorization: {authorization}")
    sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk or len(data) > _MAX_HEADER_BYTES:
            raise ValueError("no complete RTSP answer")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    status = int(status_line.split()[1])
    headers: dict[str, str] = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        headers.setdefault(name.strip().lower(), value.strip())
    # Leave the socket at the next answer: read the body this answer announced.
    remaining = int(headers.get("content-length", "0") or 0) - len(body)
    while remaining > 0:
        chunk = sock.recv(min(remaining, 65536))
        if not chunk:
            break
        remaining -= len(chunk)
    return status, headers.get("www-authenticate", "")


def _authorization(challenge: str, user: str, password: str, target: str) -> str:
    """The Authorization header answering ``challenge`` (RFC 2617 Basic or Digest without qop)."""
    scheme = challenge.split(" ", 1)[0].lower()
    if scheme != "digest":
        return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
    fields = dict(_CHALLENGE_FIELD.findall(challenge))
    realm, nonce = fields.get("realm", ""), fields.get("nonce", "")
    ha1 = hashlib.md5(f"{user}:{realm}:{password}".encode(), usedforsecurity=False).hexdigest()
    ha2 = hashlib.md5(f"DESCRIBE:{target}".encode(), usedforsecurity=False).hexdigest()
    response = hashlib.md5(f"{ha1}:{nonce}:{ha2}".encode(), usedforsecurity=False).hexdigest()
    return (
        f'Digest username="{user}", realm="{realm}", nonce="{nonce}", uri="{target}", response="{response}"'
    )
