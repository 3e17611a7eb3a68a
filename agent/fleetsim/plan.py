"""What each simulated device is, from the simulator's flags (pure functions, no I/O but the RNG).

A :class:`DevicePlan` says everything the scenario dictates about one device: its id, its labels,
when it is switched off, which figure it fails, which model each slot runs at start. The flags:

``--devices N``
    devices ``{id_prefix}-0000`` .. (zero-padded to at least 4 digits, so sorted ids keep index order:
    a rollout's waves, which take the selection in order, take the lowest indices first).
``--label KEY=V1,V2,...`` (repeatable)
    device *i* gets ``KEY`` = the ``i mod len``-th value: ``--label site=berlin,munich`` alternates.
``--offline WHO:START-END`` (repeatable)
    the devices WHO are switched off from START to END seconds after the simulator started (a
    graceful stop of the agent: offline status, then a restart over the same state directory).
``--unhealthy WHO:FIGURE`` (repeatable)
    the devices WHO fail FIGURE when a manifest asks for it: ``agreement`` or ``latency_ratio``
    (shadow: the job ends REJECTED), ``fps_ratio``, ``p99_ratio``, ``nan_outputs`` or
    ``infer_errors`` (probation: ROLLED_BACK), ``load`` (the model fails to load: ROLLED_BACK,
    whatever the manifest asks).

WHO is ``N%`` or ``N`` (a share or a count of the devices), optionally ``@A-B`` to choose among the
devices with index A..B only (``2@0-49``: two of the first fifty); the devices are drawn with a
seeded RNG (``--seed``), so the same flags give the same devices. Every bad value raises
:class:`~agent.errors.UsageError` naming the flag.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, get_args

from agent.errors import UsageError

Figure = Literal[
    "agreement", "latency_ratio", "fps_ratio", "p99_ratio", "nan_outputs", "infer_errors", "load"
]
FIGURES: tuple[str, ...] = get_args(Figure)
#: The figures a shadow run measures; the others are probation's (``load`` is neither: it fails first).
SHADOW_FIGURES = frozenset({"agreement", "latency_ratio"})

_WHO = re.compile(r"^(?P<n>[0-9]+(?:\.[0-9]+)?)(?P<pct>%)?(?:@(?P<a>[0-9]+)-(?P<b>[0-9]+))?$")
_WINDOW = re.compile(r"^(?P<start>[0-9]+(?:\.[0-9]+)?)-(?P<end>[0-9]+(?:\.[0-9]+)?)$")
_LABEL_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


@dataclass(frozen=True)
class OfflineWindow:
    """Seconds after the simulator's start during which the device is switched off."""

    start_s: float
    end_s: float


@dataclass(frozen=True)
class DevicePlan:
    """One simulated device as the scenario dictates it."""

    index: int
    device_id: str
    labels: dict[str, str] = field(default_factory=dict)
    offline: tuple[OfflineWindow, ...] = ()
    unhealthy: Figure | None = None


def device_ids(count: int, prefix: str = "sim") -> list[str]:
    """``count`` device ids, zero-padded so that sorting them keeps their index order."""
    width = max(4, len(str(max(count - 1, 0))))
    return [f"{prefix}-{i:0{width}d}" for i in range(count)]


def choose(flag: str, who: str, count: int, rng: random.Random) -> list[int]:
    """The device indices ``who`` names among ``count`` devices (sorted); raises UsageError."""
    match = _WHO.match(who.strip())
    if not match:
        raise UsageError(f"{flag}: {who!r} is not a share (5%) or a count (3), optionally @FIRST-LAST")
    low, high = 0, count - 1
    if match.group("a") is not None:
        low, high = int(match.group("a")), int(match.group("b"))
        if low > high or high >= count:
            raise UsageError(f"{flag}: {who!r}: the index range must lie within 0-{count - 1}")
    pool = list(range(low, high + 1))
    number = float(match.group("n"))
    if match.group("pct"):
        if number > 100:
            raise UsageError(f"{flag}: {who!r} is above 100%")
        # Rounds up: 3 % of a 50-device canary is 2 devices, never none.
        n = math.ceil(number * len(pool) / 100.0 - 1e-9)
    else:
        if number != int(number):
            raise UsageError(f"{flag}: {who!r}: a count is a whole number")
        n = int(number)
        if n > len(pool):
            raise UsageError(f"{flag}: {who!r}: only {len(pool)} devices to choose from")
    return sorted(rng.sample(pool, n))


def parse_offline(text: str) -> tuple[str, OfflineWindow]:
    """``WHO:START-END`` -> (WHO, window); raises UsageError."""
    who, sep, window = text.rpartition(":")
    match = _WINDOW.match(window.strip())
    if not sep or not who or not match:
        raise UsageError(f"--offline: {text!r} is not WHO:START-END (e.g. 5%:10-90: seconds after start)")
    start, end = float(match.group("start")), float(match.group("end"))
    if end <= start:
        raise UsageError(f"--offline: {text!r}: the window must end after it starts")
    return who, OfflineWindow(start, end)


def parse_unhealthy(text: str) -> tuple[str, Figure]:
    """``WHO:FIGURE`` -> (WHO, figure); raises UsageError."""
    who, sep, figure = text.rpartition(":")
    if not sep or not who or figure not in FIGURES:
        raise UsageError(f"--unhealthy: {text!r} is not WHO:FIGURE; FIGURE is one of {', '.join(FIGURES)}")
    return who, figure  # type: ignore[return-value]  # checked against FIGURES above


def parse_label(text: str) -> tuple[str, list[str]]:
    """``KEY=V1,V2`` -> (KEY, values); raises UsageError."""
    key, sep, values = text.partition("=")
    items = [v.strip() for v in values.split(",")]
    if not sep or not _LABEL_KEY.match(key) or not all(items):
        raise UsageError(f"--label: {text!r} is not KEY=VALUE[,VALUE...] (e.g. site=berlin,munich)")
    return key, items


def plan_fleet(
    count: int,
    *,
    id_prefix: str = "sim",
    labels: Sequence[str] = (),
    offline: Sequence[str] = (),
    unhealthy: Sequence[str] = (),
    seed: int = 0,
) -> list[DevicePlan]:
    """Every device's plan from the flags' values; raises UsageError naming the flag."""
    if count < 1:
        raise UsageError("--devices: at least 1")
    rng = random.Random(seed)
    ids = device_ids(count, id_prefix)
    label_values = [parse_label(text) for text in labels]
    windows: dict[int, list[OfflineWindow]] = {}
    for text in offline:
        who, window = parse_offline(text)
        for i in choose("--offline", who, count, rng):
            windows.setdefault(i, []).append(window)
    figures: dict[int, Figure] = {}
    for text in unhealthy:
        who, figure = parse_unhealthy(text)
        for i in choose("--unhealthy", who, count, rng):
            figures[i] = figure
    return [
        DevicePlan(
            index=i,
            device_id=ids[i],
            labels={key: values[i % len(values)] for key, values in label_values},
            offline=tuple(sorted(windows.get(i, ()), key=lambda w: w.start_s)),
            unhealthy=figures.get(i),
        )
        for i in range(count)
    ]
