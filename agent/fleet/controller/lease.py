"""One controller per prefix: the lease it holds through the broker (docs/fleet.md, "Two controllers").

Two controllers on one prefix both drive rollouts: each gives every device a job of its own for the
same model. So a controller starts by taking the prefix's lease, and one that finds it held refuses
(:class:`LeaseHeldError`, naming the holder) or, with ``standby``, waits until it is free.

The claim is a retained :class:`~agent.protocol.messages.ControllerLease`, renewed by a thread of
its own and published with a Message Expiry, held over a connection whose client id every
controller derives from the signing key (:func:`lease_client_id`): the broker keeps one connection
per client id, so two controllers cannot both hold it. A dropped lease connection pauses the
controller; :meth:`PrefixLease.regain` then tells *taken over* (final: :class:`LeaseLostError`)
from any other loss (it takes the lease back if it is free or its own). mosquitto 2.0.11 sends no
"Session taken over" (mosquitto#2607), so a second **witness** connection tells the two apart.
Reading the claim needs no clock (:func:`read_lease`): a retained claim arrives before an echo of
the reader's own.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import secrets
import socket
import threading
import time
from pathlib import Path

import structlog

from agent.errors import AgentError, TransportError
from agent.mqtt.core import LastWill, PublishProperties
from agent.mqtt.inbound import InboundMessage
from agent.mqtt.service_client import ServiceClient
from agent.mqtt.settings import MqttSettings
from agent.protocol.messages import ControllerLease, ProtocolError, decode, encode
from agent.protocol.topics import ControllerTopics

log = structlog.get_logger(__name__)

#: A claim not renewed for this long expires (it is renewed every third of it).
DEFAULT_LEASE_TTL_S = 60


class LeaseHeldError(AgentError):
    """Another controller holds the prefix (the message names it)."""

    code = "lease_held"


def lease_client_id(prefix: str, secret: bytes | None) -> str:
    """The client id of the prefix's lease holder: a keyed hash of the prefix (the plain prefix
    for an unsigned test fleet, which has no key)."""
    if secret is None:
        return f"edge-fleet-controller:{prefix}"
    digest = hashlib.blake2b(prefix.encode(), key=hashlib.sha256(secret).digest(), digest_size=12)
    return f"edge-fleet-controller:{digest.hexdigest()}"


def describe(claim: ControllerLease) -> str:
    """The holder in words, for the one line a refused controller prints."""
    since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(claim.since))
    return (
        f"controller {claim.holder} (pid {claim.pid} on {claim.host}, "
        f"state_dir {claim.state_dir}, since {since})"
    )


def read_lease(settings: MqttSettings, timeout: float = 10.0) -> ControllerLease | None:
    """The prefix's current claim (None: free). LeaseHeldError when the retained message is no claim."""
    topics = ControllerTopics(settings.prefix)
    reader = f"lease-reader-{secrets.token_hex(6)}"
    echo = topics.lease_echo(reader)
    payloads: list[bytes] = []
    echoed = threading.Event()

    def on_message(message: InboundMessage) -> None:
        if message.topic == topics.lease:
            payloads.append(message.payload)
        elif message.topic == echo:
            echoed.set()

    client = ServiceClient(settings, client_id=reader, handler=on_message)
    client.start(timeout)
    try:
        client.subscribe(topics.lease, qos=1, timeout=timeout)
        client.subscribe(echo, qos=1, timeout=timeout)
        client.publish(echo, b"echo", qos=1)
        if not echoed.wait(timeout):
            raise TransportError(f"the broker did not echo {echo} within {timeout:.0f}s")
    finally:
        client.stop()
    return claim_of(payloads[-1] if payloads else b"", topics.lease)


def claim_of(payload: bytes, topic: str) -> ControllerLease | None:
    """The claim in a lease message (None: an empty one, nobody holds the prefix)."""
    if not payload:
        return None
    try:
        return decode(ControllerLease, payload)
    except ProtocolError as exc:
        raise LeaseHeldError(
            f"the retained message on {topic} is not a controller lease ({exc}); if no controller runs "
            f"on this prefix, clear it: mosquitto_pub -r -n -t '{topic}'"
        ) from exc


def holder_is_gone(claim: ControllerLease) -> bool:
    """True for a claim whose holder was a process of this host that no longer exists."""
    if claim.host != socket.gethostname() or claim.pid == os.getpid():
        return False
    try:
        os.kill(claim.pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # it exists, under another user
        return False
    return False


class StandbyEndedError(AgentError):
    """A standby controller was told to stop before the lease came free."""

    code = "standby_ended"


class LeaseLostError(AgentError):
    """This controller no longer holds the prefix: it must stop driving rollouts."""

    code = "lease_lost"


class PrefixLease:
    """This controller's lease on ``settings.prefix``: acquire, renew, lost, regain, release."""

    def __init__(
        self,
        settings: MqttSettings,
        state_dir: Path,
        *,
        secret: bytes | None = None,
        ttl_s: int = DEFAULT_LEASE_TTL_S,
    ) -> None:
        """``secret``: what the lease's client id is derived from (the signing key's bytes)."""
        self.settings = settings
        self.topics = ControllerTopics(settings.prefix)
        self.client_id = lease_client_id(settings.prefix, secret)
        host, pid = socket.gethostname(), os.getpid()
        self.claim = ControllerLease(
            holder=f"{host}:{pid}:{secrets.token_hex(4)}",
            host=host,
            pid=pid,
            state_dir=str(state_dir),
            since=time.time(),
            ttl_s=ttl_s,
        )
        self._client: ServiceClient | None = None
        self._lock = threading.Lock()
        self._own_seen = threading.Event()  # our claim came back: it is on the broker
        self._taken_by: str | None = None
        self._cleared = threading.Event()  # a standby's wake-up: the holder let go
        self._renew_now = threading.Event()  # the claim was cleared by hand: put it back
        self._released = threading.Event()
        self._renewer: threading.Thread | None = None
        self._taken_once = False
        self._retry = _Backoff(settings.reconnect_min_s, settings.reconnect_max_s)
        #: A second connection of this controller's, to tell a broker that closed the lease connection
        #: alone (another took its client id) from one that went away (``_closed_alone``).
        self._witness: ServiceClient | None = None
        self._witness_mark = 0  # the witness's connects when the lease was last taken
        self._loss_judged = False
        self._closed_alone = False

    # -- taking it -----------------------------------------------------------------------------------

    def acquire(
        self, *, standby: bool = False, stop: threading.Event | None = None, timeout: float = 10.0
    ) -> bool:
        """Take the lease; False only when ``stop`` was set while standing by.

        Raises LeaseHeldError when another live controller holds it and ``standby`` is False, and
        TransportError when the broker cannot be reached before standing by (a standby rides
        through a broker outage: it tries again).
        """
        announced = False
        while True:
            try:
                held = read_lease(self.settings, timeout)
                if held is not None and holder_is_gone(held):
                    log.warning("fleet.controller.lease.stale", holder=describe(held))
                    held = None
                if held is None:
                    try:
                        self._take(timeout)
                    except BaseException:
                        self._stop_witness()
                        raise
                    return True
                if not standby:
                    raise LeaseHeldError(
                        f"prefix {self.settings.prefix} is held by {describe(held)}; one controller per "
                        "prefix: stop that one first, or set standby: true to take over when it stops"
                    )
                if not announced:
                    log.warning(
                        "fleet.controller.standby", prefix=self.settings.prefix, holder=describe(held)
                    )
                    print(
                        f"controller: standing by, prefix {self.settings.prefix} is held by {describe(held)}",
                        flush=True,
                    )
                    announced = True
                if self._wait_for_release(held, stop, timeout):
                    return False
            except TransportError as exc:
                if not announced:
                    raise
                # A standby outlives the broker's restart: the holder may be back when it is.
                log.warning("fleet.controller.standby.broker_unreachable", error=str(exc))
                if (stop or threading.Event()).wait(self._retry.next()):
                    return False

    def _wait_for_release(self, held: ControllerLease, stop: threading.Event | None, timeout: float) -> bool:
        """Watch the lease until it is cleared or not renewed for its ttl; True when ``stop`` was set."""
        self._cleared.clear()
        watcher = ServiceClient(self.settings, handler=self._on_standby_message)
        watcher.start(timeout)
        try:
            watcher.subscribe(self.topics.lease, qos=1, timeout=timeout)
            self._retry.reset()
            deadline = time.monotonic() + held.ttl_s
            while not self._cleared.is_set() and time.monotonic() < deadline:
                if stop is not None and stop.is_set():
                    return True
                self._cleared.wait(0.2)
        finally:
            watcher.stop()
        return stop is not None and stop.is_set()

    def _on_standby_message(self, message: InboundMessage) -> None:
        if not message.payload:
            self._cleared.set()

    def _take(self, timeout: float) -> None:
        """Connect under the lease's client id and publish the claim; TransportError when it is not
        back from the broker (nothing of this try is left connected)."""
        self.claim = self.claim.model_copy(update={"since": time.time()})
        self._own_seen.clear()
        client = ServiceClient(
            self.settings,
            client_id=self.client_id,
            handler=self._on_holder_message,
            last_will=LastWill(self.topics.lease, b"", retain=True),
            reconnect=False,
        )
        client.start(timeout)
        self._client = client
        self._taken_once = True
        try:
            if self._witness is None:
                self._witness = ServiceClient(self.settings).start(timeout)
            self._claim(client, timeout)
        except BaseException:
            self._client = None
            if client.connected:  # connected but not holding: clear what we claimed, let another take it
                with contextlib.suppress(TransportError):
                    client.publish(self.topics.lease, b"", qos=1, retain=True)
                    client.wait_published(timeout)
            client.stop()
            raise
        # Renewed by a thread of its own: a controller loop busy with one long request is alive,
        # and its claim must not expire meanwhile (a newcomer would take the lease from it).
        self._renewer = threading.Thread(
            target=self._renew, args=(client,), name="controller-lease", daemon=True
        )
        self._renewer.start()
        self._retry.reset()
        self._witness_mark, self._loss_judged = self._witness.connects, False
        log.info("fleet.controller.lease.taken", prefix=self.settings.prefix, holder=self.claim.holder)

    def _claim(self, client: ServiceClient, timeout: float) -> None:
        """Watch the lease topic, publish the claim, and wait until the broker sends it back."""
        client.subscribe(self.topics.lease, qos=1, timeout=timeout)
        self._publish_claim()
        deadline = time.monotonic() + timeout
        while not self._own_seen.wait(0.05):
            if not client.connected:  # closed meanwhile: another connection took the client id
                raise TransportError(
                    "the lease connection to the broker was lost while claiming prefix "
                    f"{self.settings.prefix}; another controller may hold it now"
                )
            if time.monotonic() > deadline:
                raise TransportError(
                    f"the broker did not return this controller's claim on {self.topics.lease}"
                )

    def _publish_claim(self) -> None:
        client = self._client
        if client is None:
            return  # released
        client.publish(
            self.topics.lease,
            encode(self.claim),
            qos=1,
            retain=True,
            properties=PublishProperties(message_expiry_s=self.claim.ttl_s),
        )

    def _on_holder_message(self, message: InboundMessage) -> None:
        """Dispatcher thread: our own claim, an old retained one, a clearing, or another holder's."""
        try:
            claim = claim_of(message.payload, self.topics.lease)
        except LeaseHeldError:
            claim = None
        with self._lock:
            if claim is not None and claim.holder == self.claim.holder:
                self._own_seen.set()
            elif not self._own_seen.is_set():
                return  # what was retained before our claim
            elif claim is not None:
                self._taken_by = describe(claim)
            else:
                self._renew_now.set()  # cleared by hand while we hold it: put the claim back

    # -- holding it ----------------------------------------------------------------------------------

    @property
    def lost(self) -> str | None:
        """Why this controller does not hold the lease now (None: it does): :attr:`lost_for_good`,
        or its connection dropped (:meth:`regain` may get it back)."""
        final = self.lost_for_good
        if final is not None:
            return final
        client = self._client
        if client is None and not self._taken_once:
            return "the lease was never taken"
        if client is None or not client.connected or client.connects != 1:
            return f"the lease connection to the broker was lost (prefix {self.settings.prefix})"
        return None

    @property
    def lost_for_good(self) -> str | None:
        """Why the lease is another's now (None: it is not known to be): another controller's claim
        was seen, or the broker said another connection took the lease's client id."""
        if self._taken_by is not None:
            return f"prefix {self.settings.prefix} was taken by {self._taken_by}"
        client = self._client
        if client is not None and client.taken_over:
            return (
                "the broker closed the lease connection because another connection took its client id "
                f"(session taken over); another controller may hold prefix {self.settings.prefix} now"
            )
        if self._closed_alone:
            return (
                "the broker closed the lease connection while this controller's other connection stayed "
                f"up (another connection took its client id); another controller may hold prefix "
                f"{self.settings.prefix} now"
            )
        return None

    def regain(self, timeout: float = 10.0) -> bool:
        """After the lease connection dropped (not taken over): one try to get the lease back.

        True when held (again); False when the broker cannot be reached yet or it is too soon after
        the last try (call again: tries are spaced like reconnects, ``mqtt.reconnect_min_s`` doubling
        up to ``reconnect_max_s``). LeaseLostError when the lease is another's: its claim is on the
        broker, or the broker said so. The claim is read first and the lease connection comes back
        only when it is absent (a broker without persistence forgot it; it expired; our Last Will
        cleared it) or this controller's own: the connection would close another holder's.
        """
        final = self.lost_for_good
        if final is not None:
            raise LeaseLostError(final)
        if self.lost is None:
            return True
        if self._released.is_set():
            return False
        if not self._loss_judged:
            self._loss_judged = True
            if self._broker_closed_it_alone(timeout):
                self._closed_alone = True
                raise LeaseLostError(str(self.lost_for_good))
        if not self._retry.due():
            return False
        try:
            held = read_lease(self.settings, timeout)
        except TransportError as exc:
            self._retry.failed()
            log.info("fleet.controller.lease.regain_failed", prefix=self.settings.prefix, error=str(exc))
            return False
        if held is not None and held.holder != self.claim.holder:
            self._taken_by = describe(held)
            raise LeaseLostError(f"prefix {self.settings.prefix} was taken by {self._taken_by}")
        old, self._client = self._client, None
        if old is not None:
            old.stop()
        try:
            self._take(timeout)
        except TransportError as exc:
            self._retry.failed()
            log.info("fleet.controller.lease.regain_failed", prefix=self.settings.prefix, error=str(exc))
            return False
        log.warning("fleet.controller.lease.regained", prefix=self.settings.prefix, holder=self.claim.holder)
        return True

    def _stop_witness(self) -> None:
        witness, self._witness = self._witness, None
        if witness is not None:
            witness.stop()

    def _broker_closed_it_alone(self, timeout: float) -> bool:
        """Whether the broker that closed the lease connection is still up with the witness's
        connection of that time: a QoS 1 round trip on it, its connects unchanged since the lease was
        taken. A broker that restarted, or a network that dropped, took the witness's connection too.

        Why: mosquitto before 2.0.15 closes the connection whose client id another connection takes
        without the DISCONNECT "Session taken over" (mosquitto#2607): to paho it looks like any loss.
        """
        witness = self._witness
        if witness is None or witness.connects != self._witness_mark or not witness.connected:
            return False
        try:
            witness.publish(self.topics.lease_echo(witness.client_id), b"", qos=1)
        except TransportError:
            return False
        deadline = time.monotonic() + timeout
        while not witness.wait_published(0.05):
            if not witness.connected or time.monotonic() > deadline:
                return False
        return witness.connected and witness.connects == self._witness_mark

    def _renew(self, client: ServiceClient) -> None:
        """A renewer thread: the claim again every third of its ttl, while ``client`` holds the lease."""
        while not self._released.is_set():
            self._renew_now.wait(self.claim.ttl_s / 3)
            self._renew_now.clear()
            if self._released.is_set() or self._client is not client or self.lost is not None:
                return  # released, or lost: a regained lease has a renewer of its own
            try:
                self._publish_claim()
            except TransportError:
                return  # the connection is gone: `lost` says so

    def release(self, timeout: float = 5.0) -> None:
        """Clear the claim (unless the lease was lost: the claim there is another's) and disconnect."""
        self._released.set()
        self._renew_now.set()
        self._stop_witness()
        client, self._client = self._client, None
        if client is None:
            return
        if self._renewer is not None:
            self._renewer.join(5.0)  # not one renewal after the claim is cleared
        if self._taken_by is None and client.connected:
            try:
                client.publish(self.topics.lease, b"", qos=1, retain=True)
                client.wait_published(timeout)
            except TransportError:
                log.warning("fleet.controller.lease.release_failed", prefix=self.settings.prefix)
        client.stop()  # a normal DISCONNECT: the broker discards the Last Will
        log.info("fleet.controller.lease.released", prefix=self.settings.prefix)


class _Backoff:
    """When to try again: ``first_s`` doubling up to ``max_s``, with jitter (a few controllers that
    lost the broker together must not come back in step)."""

    def __init__(self, first_s: float, max_s: float) -> None:
        self._first = first_s
        self._max = max(first_s, max_s)
        self._delay = 0.0
        self._at = 0.0

    def due(self) -> bool:
        return time.monotonic() >= self._at

    def failed(self) -> None:
        self._delay = min(self._max, self._delay * 2 if self._delay else self._first)
        self._at = time.monotonic() + random.uniform(0.5, 1.0) * self._delay

    def next(self) -> float:
        """Record a failure and return the wait before the next try."""
        self.failed()
        return max(0.0, self._at - time.monotonic())

    def reset(self) -> None:
        self._delay = 0.0
        self._at = 0.0
