"""The console's ``Host`` check: a request must name this server, or it is refused (403).

Why: a page on another site can point its own name at 127.0.0.1 (DNS rebinding) and then read the
console as if it were its own origin; the browser still sends that page's name in ``Host``. So the
console answers only Hosts that name it: ``localhost``, an IP literal (a browser sends one only when
the page itself came from that address, and no DNS answer can change where an address leads), the
bind address, and the names listed in ``http.allowed_hosts`` (the name a TLS proxy or a Prometheus
target uses). The port in ``Host`` is not compared: the name is what a rebinding page controls.

Non-browser clients can send any ``Host``; this check keeps browsers of other sites out, nothing
more (the actions need the token whatever the Host says).
"""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Iterable

from starlette.types import ASGIApp, Receive, Scope, Send

#: ``Host``: a name or IPv4 address, or an IPv6 address in brackets, then an optional ``:port``.
_HOST_HEADER = re.compile(r"^(?:\[(?P<ipv6>[0-9A-Fa-f:.]+)\]|(?P<name>[^:\[\]]+))(?::(?P<port>[0-9]{1,5}))?$")


def host_name(header: str) -> str | None:
    """The name in a ``Host`` header: lower case, no port, brackets or trailing dot (None: malformed)."""
    match = _HOST_HEADER.match(header.strip())
    if match is None:
        return None
    name = (match.group("ipv6") or match.group("name") or "").lower().rstrip(".")
    return name or None


def is_ip_literal(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def allowed_names(bind_host: str, extra: Iterable[str] = ()) -> frozenset[str]:
    """The names a ``Host`` may carry besides IP literals: ``localhost``, the bind address, ``extra``."""
    return frozenset(n.lower().rstrip(".") for n in ("localhost", bind_host, *extra))


def host_refusal(header: str | None) -> str:
    """The refusal's text: which Host was refused and where to allow it."""
    if not header:
        return "this request has no Host header; the console answers only requests that name it"
    return (
        f"Host {header[:200]!r} is not a name of this console; if it is one, add it to "
        "http.allowed_hosts in controller.yaml (localhost, IP addresses and the bind address need no entry)"
    )


class HostCheck:
    """ASGI wrapper: requests whose ``Host`` is not allowed get 403 and never reach the app."""

    def __init__(self, app: ASGIApp, names: frozenset[str]) -> None:
        self.app = app
        self.names = names

    def allows(self, header: str | None) -> bool:
        name = host_name(header) if header else None
        return name is not None and (name in self.names or is_ip_literal(name))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        values = [v.decode("latin-1") for k, v in scope.get("headers", []) if k == b"host"]
        header = values[0] if len(values) == 1 else None  # two Host headers: refused, as HTTP says
        if self.allows(header):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        body = json.dumps({"error": host_refusal(header)}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 403,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"cache-control", b"no-store"),
                    (b"x-content-type-options", b"nosniff"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
