"""A TCP proxy on loopback that can freeze or cut its connections: link faults without iptables.

Frozen connections stay open at both ends but carry no byte in either direction, which is what a
pulled cable, a dead NAT entry or a camera whose encoder hung looks like to both peers. Cut
connections are closed at both ends at once. Connections accepted afterwards pass normally, so a
client that notices and reconnects gets through. Used for MQTT links and RTSP cameras alike.
"""

from __future__ import annotations

import contextlib
import socket
import threading

from agent.demo.broker import free_port
from tests.waiting import patient


class FreezableProxy:
    """``127.0.0.1:port`` -> ``upstream``; :meth:`freeze` stalls every connection open at that moment."""

    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.port = free_port()
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self._lock = threading.Lock()
        self._generation = 0  # connections opened before the current freeze are frozen
        self._frozen_below = -1
        self._sockets: list[socket.socket] = []
        self._closed = threading.Event()
        self._refusing = threading.Event()
        self.accepted = 0
        #: Connections tried, refused ones included.
        self.attempts = 0

    def start(self) -> FreezableProxy:
        threading.Thread(target=self._accept, daemon=True, name="proxy-accept").start()
        return self

    def freeze(self) -> None:
        with self._lock:
            self._frozen_below = self._generation

    def refuse(self, refusing: bool = True) -> None:
        """While refusing, a new connection is closed as soon as it is accepted (a server out of reach:
        with :meth:`cut`, an outage that lasts until ``refuse(False)``)."""
        if refusing:
            self._refusing.set()
        else:
            self._refusing.clear()

    def cut(self) -> None:
        """Close every connection open now, at both ends."""
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for s in sockets:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _addr = self._listener.accept()
            except OSError:
                return
            self.attempts += 1
            if self._refusing.is_set():
                client.close()
                continue
            try:
                server = socket.create_connection(self.upstream, timeout=patient(5))
            except OSError:
                client.close()
                continue
            with self._lock:
                self._generation += 1
                generation = self._generation
                self._sockets += [client, server]
                self.accepted += 1
            for src, dst in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(src, dst, generation), daemon=True).start()

    def _frozen(self, generation: int) -> bool:
        with self._lock:
            return generation <= self._frozen_below

    def _pump(self, src: socket.socket, dst: socket.socket, generation: int) -> None:
        src.settimeout(0.1)
        while not self._closed.is_set():
            if self._frozen(generation):
                self._closed.wait(0.1)  # hold the bytes: nothing is read, nothing is closed
                continue
            try:
                data = src.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                break
            if not data:
                break
            try:
                dst.sendall(data)
            except OSError:
                break
        if not self._frozen(generation):
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._closed.set()
        self._listener.close()
        with self._lock:
            sockets = list(self._sockets)
        for s in sockets:
            with contextlib.suppress(OSError):
                s.close()
