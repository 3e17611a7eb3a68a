"""The MQTT topic tree: the only place in the project where topics are spelled.

Layout (see docs/protocol.md): ``{prefix}/{device}/{up|down}/{kind}[/{arg}]``. The device id is one
topic level, so one ACL pattern scopes a device: write ``{prefix}/%u/up/#``, read ``{prefix}/%u/down/#``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

#: The default topic prefix (``mqtt.prefix`` in the configuration).
DEFAULT_PREFIX = "fleet/v1"
UP = "up"
DOWN = "down"

#: Kinds without an argument level, by direction.
_FIXED_KINDS: dict[str, frozenset[str]] = {
    UP: frozenset({"status", "info", "telemetry", "samples", "cert"}),
    DOWN: frozenset({"cert"}),
}
#: Kinds followed by exactly one argument level, by direction.
_ARG_KINDS: dict[str, frozenset[str]] = {
    UP: frozenset({"results", "jobs", "cmd", "xfer", "engines"}),
    DOWN: frozenset({"desired", "xfer", "cmd", "engines"}),
}
_UP_XFER_REQ = "req"  # up/xfer/req: the one argument up/xfer takes
#: up/engines/{verb}: the requests about fleet-shared engines (agent.protocol.engines).
ENGINE_REQUEST_VERBS = frozenset({"ask", "offer", "piece", "drop", "claim"})
_DOWN_ENGINES_REPLY = "reply"  # down/engines/reply: the one argument down/engines takes


def check_level(value: str, what: str) -> str:
    """Return ``value`` if it is usable as ONE topic level, else raise ValueError naming ``what``.

    Refused: empty, ``/`` (would add levels), ``+``/``#`` (wildcards are not allowed in published
    topics), and NUL (forbidden by the MQTT spec).
    """
    if not value:
        raise ValueError(f"{what} must not be empty (it is an MQTT topic level)")
    for bad in ("/", "+", "#", "\0"):
        if bad in value:
            raise ValueError(f"{what} {value!r} must not contain {bad!r} (it is one MQTT topic level)")
    return value


def check_prefix(prefix: str) -> str:
    """Return ``prefix`` if it is a wildcard-free topic prefix without empty levels, else raise ValueError."""
    if not prefix:
        raise ValueError("topic prefix must not be empty")
    for level in prefix.split("/"):
        check_level(level, f"topic prefix {prefix!r} level")
    return prefix


@dataclass(frozen=True)
class ParsedTopic:
    """A topic of the tree taken apart: ``{prefix}/{device}/{direction}/{kind}[/{arg}]``."""

    device: str
    direction: Literal["up", "down"]
    kind: str
    arg: str | None


class Topics:
    """The topics of one device under one prefix (defaults: ``fleet/v1`` and the MQTT client id)."""

    def __init__(self, prefix: str, device_id: str) -> None:
        self.prefix = check_prefix(prefix)
        self.device_id = check_level(device_id, "device id")
        self._base = f"{prefix}/{device_id}"

    def __repr__(self) -> str:
        return f"Topics({self.prefix!r}, {self.device_id!r})"

    # -- device -> operator ------------------------------------------------------------------
    @property
    def status(self) -> str:
        """Retained online/offline status; the Last Will writes offline here."""
        return f"{self._base}/up/status"

    @property
    def info(self) -> str:
        """Retained description of the device: versions, platform, backends, slots."""
        return f"{self._base}/up/info"

    @property
    def telemetry(self) -> str:
        """Periodic flat numeric telemetry (QoS 0, not retained)."""
        return f"{self._base}/up/telemetry"

    @property
    def samples(self) -> str:
        """Frames kept for retraining, one JPEG and its prediction each (QoS 1, not retained; opt-in)."""
        return f"{self._base}/up/samples"

    @property
    def xfer_req(self) -> str:
        """Chunk requests of a model transfer (the device pulls)."""
        return f"{self._base}/up/xfer/{_UP_XFER_REQ}"

    def results(self, stream: str) -> str:
        """Per-frame results of one camera stream."""
        return f"{self._base}/up/results/{check_level(stream, 'stream name')}"

    def jobs(self, job_id: str) -> str:
        """State transitions of one deployment job."""
        return f"{self._base}/up/jobs/{check_level(job_id, 'job id')}"

    def engines_request(self, verb: str) -> str:
        """A request about fleet-shared engines (``ask``, ``offer``, ``piece``, ``drop``, ``claim``)."""
        if verb not in ENGINE_REQUEST_VERBS:
            known = ", ".join(sorted(ENGINE_REQUEST_VERBS))
            raise ValueError(f"unknown engines verb {verb!r}; known: {known}")
        return f"{self._base}/up/engines/{verb}"

    @property
    def engines_reply(self) -> str:
        """Where the controller answers this device's engines requests (their response topic)."""
        return f"{self._base}/down/engines/{_DOWN_ENGINES_REPLY}"

    @property
    def cert_renewal(self) -> str:
        """Certificate renewal requests (only the device's own certificate may publish here)."""
        return f"{self._base}/up/cert"

    def cmd_reply(self, name: str) -> str:
        """Reply to a command named ``name``."""
        return f"{self._base}/up/cmd/{check_level(name, 'command name')}"

    # -- operator -> device ------------------------------------------------------------------
    @property
    def desired_filter(self) -> str:
        """Subscription filter for every slot's desired-state manifest."""
        return f"{self._base}/down/desired/+"

    @property
    def cmd_filter(self) -> str:
        """Subscription filter for every command."""
        return f"{self._base}/down/cmd/+"

    @property
    def xfer_filter(self) -> str:
        """Subscription filter for every transfer's chunk replies."""
        return f"{self._base}/down/xfer/+"

    @property
    def cert_reply(self) -> str:
        """The controller's answers to this device's certificate renewals."""
        return f"{self._base}/down/cert"

    def desired(self, slot: str) -> str:
        """Retained, signed desired-state manifest of one model slot."""
        return f"{self._base}/down/desired/{check_level(slot, 'slot name')}"

    def xfer(self, sha256: str) -> str:
        """Chunk bytes of the model whose SHA-256 is ``sha256``."""
        return f"{self._base}/down/xfer/{check_level(sha256, 'model sha256')}"

    def cmd(self, name: str) -> str:
        """Command ``name`` sent to the device."""
        return f"{self._base}/down/cmd/{check_level(name, 'command name')}"


#: The level under the prefix that holds enrollment topics (outside every device's own tree).
ENROLL_LEVEL = "enroll"


def enroll_request(prefix: str, client_id: str) -> str:
    """Where an enrolling client (id ``enroll:{device}``) publishes its request."""
    return f"{check_prefix(prefix)}/{ENROLL_LEVEL}/{check_level(client_id, 'enrollment client id')}/request"


def enroll_reply(prefix: str, client_id: str) -> str:
    """Where the controller answers an enrolling client (id ``enroll:{device}``)."""
    return f"{check_prefix(prefix)}/{ENROLL_LEVEL}/{check_level(client_id, 'enrollment client id')}/reply"


def enroll_request_filter(prefix: str) -> str:
    """The controller's subscription to every enrollment request."""
    return f"{check_prefix(prefix)}/{ENROLL_LEVEL}/+/request"


def enroll_client_of(topic: str, prefix: str) -> str:
    """The client id level of an enrollment request topic; raise ValueError if it is not one."""
    head = f"{check_prefix(prefix)}/{ENROLL_LEVEL}/"
    if not topic.startswith(head) or not topic.endswith("/request"):
        raise ValueError(f"topic {topic!r} is not an enrollment request under {prefix!r}")
    return check_level(topic[len(head) : -len("/request")], "enrollment client id")


#: The level under the prefix that holds the fleet's trust metadata (a device id cannot start with ``_``).
TRUST_LEVEL = "_trust"


def trust_root(prefix: str) -> str:
    """Retained, fleet-wide: every version of the fleet root (:class:`agent.protocol.messages.RootChain`).

    Every device reads it; only the operator's trust publisher writes it.
    """
    return f"{check_prefix(prefix)}/{TRUST_LEVEL}/root"


def fleet_filter(prefix: str, kind: str, direction: Literal["up", "down"] = "up") -> str:
    """Subscription filter for ``kind`` of every device, e.g. ``fleet/v1/+/up/status``.

    Kinds that take an argument get a trailing ``+`` (``fleet/v1/+/up/jobs/+``).
    """
    check_prefix(prefix)
    if kind in _FIXED_KINDS[direction]:
        return f"{prefix}/+/{direction}/{kind}"
    if kind in _ARG_KINDS[direction]:
        return f"{prefix}/+/{direction}/{kind}/+"
    known = sorted(_FIXED_KINDS[direction] | _ARG_KINDS[direction])
    raise ValueError(f"unknown {direction} topic kind {kind!r}; known: {', '.join(known)}")


def parse(topic: str, prefix: str = DEFAULT_PREFIX) -> ParsedTopic:
    """Take a topic of the tree under ``prefix`` apart; raise ValueError if it is not one."""
    check_prefix(prefix)
    head = prefix + "/"
    if not topic.startswith(head):
        raise ValueError(f"topic {topic!r} is not under prefix {prefix!r}")
    levels = topic[len(head) :].split("/")
    if len(levels) < 3:
        raise ValueError(f"topic {topic!r} has too few levels for {prefix}/<device>/<up|down>/<kind>")
    device, direction, kind, *rest = levels
    check_level(device, "device id")
    if direction == UP:
        way: Literal["up", "down"] = "up"
    elif direction == DOWN:
        way = "down"
    else:
        raise ValueError(f"topic {topic!r}: direction {direction!r} is neither 'up' nor 'down'")
    if kind in _FIXED_KINDS[way] and not rest:
        return ParsedTopic(device, way, kind, None)
    if kind in _ARG_KINDS[way] and len(rest) == 1:
        arg = check_level(rest[0], f"{kind} argument")
        if way == UP and kind == "xfer" and arg != _UP_XFER_REQ:
            raise ValueError(f"topic {topic!r}: up/xfer only has the level {_UP_XFER_REQ!r}")
        if way == UP and kind == "engines" and arg not in ENGINE_REQUEST_VERBS:
            raise ValueError(f"topic {topic!r}: up/engines has the levels {sorted(ENGINE_REQUEST_VERBS)}")
        if way == DOWN and kind == "engines" and arg != _DOWN_ENGINES_REPLY:
            raise ValueError(f"topic {topic!r}: down/engines only has the level {_DOWN_ENGINES_REPLY!r}")
        return ParsedTopic(device, way, kind, arg)
    raise ValueError(
        f"topic {topic!r} is not in the topic tree ({direction}/{kind} with {len(rest)} more levels)"
    )


#: The controller's topic level under the prefix. Not a device id: the levels after it (``req``,
#: ``reply``) are neither ``up`` nor ``down``, so no device topic and no device ACL pattern meets it.
CONTROLLER_LEVEL = "_controller"
#: Verbs the fleet controller answers (``{prefix}/_controller/req/{verb}``).
CONTROLLER_VERBS = (
    "start",
    "status",
    "list",
    "pause",
    "resume",
    "abort",
    "upload",
    "engines",
    "engines_release",
    "rollback",
    "document",
    "devices_register",
    "devices_pending",
    "devices_accept",
    "devices_reject",
    "devices_enrolled",
)


class ControllerTopics:
    """The fleet controller's request/reply topics (docs/protocol.md, "The fleet controller")."""

    def __init__(self, prefix: str) -> None:
        self.prefix = check_prefix(prefix)
        self._base = f"{prefix}/{CONTROLLER_LEVEL}"

    @property
    def request_filter(self) -> str:
        """What the controller subscribes to: every verb's requests."""
        return f"{self._base}/req/+"

    def request(self, verb: str) -> str:
        """Requests of ``verb`` (an operator CLI publishes here, with a response topic)."""
        if verb not in CONTROLLER_VERBS:
            raise ValueError(f"unknown controller verb {verb!r}; known: {', '.join(CONTROLLER_VERBS)}")
        return f"{self._base}/req/{verb}"

    def reply(self, client: str) -> str:
        """Where one CLI process wants its replies (its response topic)."""
        return f"{self._base}/reply/{check_level(client, 'reply client id')}"

    @property
    def lease(self) -> str:
        """The retained claim of the controller holding the prefix (``ControllerLease``; empty: free)."""
        return f"{self._base}/lease"

    def lease_echo(self, client: str) -> str:
        """Where a controller reading the lease sends itself a message: its arrival ends the read."""
        return f"{self._base}/lease-echo/{check_level(client, 'lease reader client id')}"

    def verb(self, topic: str) -> str | None:
        """The verb of a request topic, or None when ``topic`` is not one."""
        verb = self.requested(topic)
        return verb if verb in CONTROLLER_VERBS else None

    def requested(self, topic: str) -> str | None:
        """The level after ``req/`` of any request topic, known verb or not (None: no request topic).

        The controller answers an unknown verb (``unknown_verb``) instead of dropping it unanswered.
        """
        head = f"{self._base}/req/"
        return topic[len(head) :] if topic.startswith(head) else None
