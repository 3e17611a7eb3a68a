"""The core's topic matcher (agent/mqtt/core.py ``topic_matches``) against paho's ``topic_matches_sub``.

The dispatcher asks it for every received message and every subscription, so the core matches
itself instead of building paho's matcher tree per call; the answer must be paho's for every
filter and topic, wildcards, empty levels and ``$`` topics included.
"""

from __future__ import annotations

import itertools

import paho.mqtt.client as paho
import pytest

from agent.mqtt.core import topic_matches

FILTER_LEVELS = ["a", "", "$SYS", "+", "#", "x+", "a#"]
TOPIC_LEVELS = ["a", "b", "", "$SYS", "+", "$x"]


def _answer(match: object, topic_filter: str, topic: str) -> object:
    try:
        return match(topic_filter, topic)  # type: ignore[operator]
    except Exception as exc:  # which exception is what is compared
        return type(exc)


@pytest.mark.parametrize("filter_depth", [1, 2, 3, 4])
def test_every_filter_matches_every_topic_as_paho_matches_it(filter_depth: int) -> None:
    differ = [
        (topic_filter, topic)
        for levels in itertools.product(FILTER_LEVELS, repeat=filter_depth)
        for depth in (1, 2, 3, 4)
        for topic_levels in itertools.product(TOPIC_LEVELS, repeat=depth)
        for topic_filter, topic in [("/".join(levels), "/".join(topic_levels))]
        if _answer(topic_matches, topic_filter, topic) != _answer(paho.topic_matches_sub, topic_filter, topic)
    ]
    assert differ == []


@pytest.mark.parametrize(
    ("topic_filter", "topic", "matches"),
    [
        ("fleet/v1/dev-1/down/xfer/+", "fleet/v1/dev-1/down/xfer/" + "ab" * 32, True),
        ("fleet/v1/dev-1/down/xfer/+", "fleet/v1/dev-2/down/xfer/ab", False),
        ("fleet/v1/dev-1/down/#", "fleet/v1/dev-1/down", True),
        ("fleet/v1/+/up/#", "fleet/v1/dev-1/up/status", True),
        ("#", "$SYS/broker/uptime", False),
        ("+/broker/uptime", "$SYS/broker/uptime", False),
        ("$SYS/#", "$SYS/broker/uptime", True),
        ("a/+", "a/b/c", False),
        ("a/+/c", "a//c", True),
    ],
)
def test_the_fleets_own_filters_match_as_documented(topic_filter: str, topic: str, matches: bool) -> None:
    assert topic_matches(topic_filter, topic) is matches
    assert bool(paho.topic_matches_sub(topic_filter, topic)) is matches
