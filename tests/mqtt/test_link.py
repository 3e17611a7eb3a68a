"""MqttLink against a real mosquitto: round trips, status and Last Will, limits, failures, reconnects."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import cast

import pytest

from agent.demo.broker import Broker, free_port
from agent.errors import TransportError
from agent.mqtt import link as link_module
from agent.mqtt.core import PublishProperties
from agent.mqtt.core import _AckedOnlyClient as AckedOnlyClient
from agent.mqtt.inbound import Connected, InboundMessage, Inbox
from agent.mqtt.wake import CoalescedWake
from agent.protocol.messages import StatusMessage, decode
from agent.spool.queue import Spool
from tests.mqtt.conftest import LinkFactory, fast_settings
from tests.mqtt_probe import Probe, Received
from tests.tcp_proxy import FreezableProxy
from tests.waiting import patient, wait_until


def wait_subscribed(probe: Probe, link: link_module.MqttLink) -> None:
    """Until the broker holds the link's subscriptions. The link subscribes on CONNACK and then
    publishes its retained "online" status; the broker handles one client's packets in order, so
    once that status is there the subscriptions are too (``link.connected`` alone comes before them:
    a message published right after it was once lost at load 20)."""
    probe.subscribe(link.status_topic)
    probe.wait_for(
        lambda ms: any(m.topic == link.status_topic and b'"online"' in m.payload for m in ms), timeout=30
    )


def _statuses(probe: Probe, topic: str) -> list[StatusMessage]:
    return [decode(StatusMessage, m.payload) for m in probe.on_topic(topic)]


def test_round_trip_publish_subscribe_with_properties(
    broker: Broker, make_link: LinkFactory, device_id: str
) -> None:
    settings = fast_settings(broker)
    received: list[InboundMessage] = []
    link = make_link(settings, client_id=device_id)
    link.subscribe(f"fleet/v1/{device_id}/down/cmd/+", received.append)
    link.start()
    wait_until(lambda: link.connected, what="connect")
    with Probe(broker.host, broker.port) as probe:
        probe.subscribe(f"fleet/v1/{device_id}/up/#")
        link.publish(
            f"fleet/v1/{device_id}/up/results/cam0",
            b'{"x":1}',
            qos=1,
            properties=PublishProperties(correlation_data=b"c1", user_properties=(("k", "v"),)),
        )
        [msg] = probe.wait_for_count(f"fleet/v1/{device_id}/up/results/cam0", 1)
        assert msg.payload == b'{"x":1}'
        assert msg.correlation_data == b"c1"
        assert msg.user_properties == (("k", "v"),)

        # The command arrives on the dispatcher with its MQTT 5 request/response properties.
        probe.publish(
            f"fleet/v1/{device_id}/down/cmd/status",
            b"{}",
            response_topic=f"fleet/v1/{device_id}/up/cmd/status",
            correlation_data=b"req-7",
        )
        wait_until(lambda: len(received) == 1, what="command delivery")
        assert received[0].topic == f"fleet/v1/{device_id}/down/cmd/status"
        assert received[0].response_topic == f"fleet/v1/{device_id}/up/cmd/status"
        assert received[0].correlation_data == b"req-7"
    assert link.healthy()
    assert link.stats()["published"] >= 1


def test_online_status_is_retained_with_a_growing_session(
    broker: Broker, make_link: LinkFactory, device_id: str, tmp_path: Path
) -> None:
    settings = fast_settings(broker)
    status_topic = f"fleet/v1/{device_id}/up/status"
    spool = Spool(tmp_path / "spool.sqlite")
    sessions: list[int] = []
    first = make_link(settings, client_id=device_id, spool=spool, on_connected=sessions.append)
    first.start()
    wait_until(lambda: sessions == [first.session], what="on_connected")
    first.stop()
    # The agent restarts: the counter lives in the spool, so the new link's session is higher.
    second = make_link(settings, client_id=device_id, spool=spool, on_connected=sessions.append)
    second.start()
    wait_until(lambda: len(sessions) == 2, what="second on_connected")
    assert sessions[1] > sessions[0]
    with Probe(broker.host, broker.port) as probe:
        probe.subscribe(status_topic)
        [retained] = probe.wait_for_count(status_topic, 1)
    assert retained.retain
    status = decode(StatusMessage, retained.payload)
    assert (status.state, status.session, status.agent_version) == ("online", sessions[1], "0.0.test")
    second.stop()
    spool.close()


def test_graceful_stop_publishes_retained_offline_with_same_session(
    broker: Broker, make_link: LinkFactory, device_id: str
) -> None:
    status_topic = f"fleet/v1/{device_id}/up/status"
    link = make_link(fast_settings(broker), client_id=device_id)
    link.start()
    wait_until(lambda: link.connected, what="connect")
    link.stop()
    assert not link.connected
    with Probe(broker.host, broker.port) as probe:
        probe.subscribe(status_topic)
        [retained] = probe.wait_for_count(status_topic, 1)
    status = decode(StatusMessage, retained.payload)
    assert retained.retain
    assert (status.state, status.session) == ("offline", link.session)


def test_last_will_writes_offline_when_the_agent_process_is_killed(broker: Broker, tmp_path: Path) -> None:
    device = "dev-killed"
    status_topic = f"fleet/v1/{device}/up/status"
    child_script = Path(__file__).with_name("link_child.py")
    with Probe(broker.host, broker.port) as probe:
        probe.subscribe(status_topic)
        child = subprocess.Popen(
            [
                sys.executable,
                str(child_script),
                broker.host,
                str(broker.port),
                str(tmp_path / "s.sqlite"),
                device,
            ],
            stdout=subprocess.PIPE,
            text=True,
            cwd=Path(__file__).parents[2],
        )
        try:
            assert child.stdout is not None
            line = child.stdout.readline().split()
            assert line[:1] == ["connected"], line
            session = int(line[1])
            probe.wait_for(lambda ms: any(b'"online"' in m.payload for m in ms))
            child.kill()  # SIGKILL: no graceful offline; only the broker's Last Will can tell
            child.wait(timeout=patient(10))
        finally:
            if child.poll() is None:
                child.kill()
        probe.wait_for(lambda ms: any(b'"offline"' in m.payload for m in ms))
    offline = [s for s in _statuses(probe, status_topic) if s.state == "offline"]
    assert offline[0].session == session


def test_oversize_payload_is_refused_and_never_sent(
    broker: Broker, make_link: LinkFactory, device_id: str
) -> None:
    link = make_link(fast_settings(broker, max_payload_bytes=1000), client_id=device_id)
    link.start()
    wait_until(lambda: link.connected, what="connect")
    topic = f"fleet/v1/{device_id}/up/results/cam0"
    with Probe(broker.host, broker.port) as probe:
        probe.subscribe(topic)
        with pytest.raises(TransportError, match=r"1001 bytes .*limit of 1000"):
            link.publish(topic, b"x" * 1001, qos=1)
        with pytest.raises(TransportError):
            link.publish(topic, b"x" * 1001, durable=True)
        link.publish(topic, b"y" * 1000, qos=1)
        probe.wait_for_count(topic, 1)
        probe.settle()
        assert [len(m.payload) for m in probe.on_topic(topic)] == [1000]
    assert link.stats()["refused_oversize"] == 2
    assert link.stats()["spool_depth"] == 0


def test_broker_max_packet_size_lowers_the_limit(
    broker_factory: Callable[[Sequence[str]], Broker], make_link: LinkFactory, device_id: str
) -> None:
    """paho ignores the broker's Maximum Packet Size (paho#760); the link reads it from CONNACK."""
    small = broker_factory(["max_packet_size 2000"])
    topic = f"fleet/v1/{device_id}/up/jobs/j1"
    link = make_link(fast_settings(small), client_id=device_id)
    # Spooled under an earlier, larger limit: it can never be delivered and must not block the spool.
    link._spool.add(topic, b"z" * 5000, 1, False)
    link.start()
    wait_until(lambda: link.connected, what="connect")
    assert link.payload_limit(topic) < 2000
    with Probe(small.host, small.port) as probe:
        probe.subscribe(topic)
        with pytest.raises(TransportError, match="broker maximum packet size=2000"):
            link.publish(topic, b"x" * 5000, qos=1)
        link.publish(topic, b"small", durable=True)
        probe.wait_for_count(topic, 1)
    assert link.connected  # not kicked by the broker for a too-large packet
    assert link.stats()["refused_oversize"] == 2
    wait_until(lambda: link.stats()["spool_depth"] == 0, what="spool drained")


def test_qos0_while_offline_is_dropped_and_counted(make_link: LinkFactory, device_id: str) -> None:
    link = make_link(fast_settings(None, port=free_port()), client_id=device_id)  # nobody listens there
    link.start()
    for _ in range(3):
        link.publish(f"fleet/v1/{device_id}/up/telemetry", b"{}", qos=0)
    assert not link.connected
    assert link.stats()["dropped_offline"] == 3
    assert link.healthy()  # broker down is not a dead link


def test_qos1_while_offline_is_bounded_by_max_queued(make_link: LinkFactory, device_id: str) -> None:
    link = make_link(fast_settings(None, port=free_port(), max_queued=5, max_inflight=1), client_id=device_id)
    link.start()
    for _ in range(10):
        link.publish(f"fleet/v1/{device_id}/up/results/cam0", b"{}", qos=1)  # never raises
    # paho holds max_queued + max_inflight (the durable window's share) in memory; the rest is counted.
    assert link.stats()["dropped_queue_full"] == 4


def test_qos2_is_refused(broker: Broker, make_link: LinkFactory, device_id: str) -> None:
    link = make_link(fast_settings(broker), client_id=device_id)
    with pytest.raises(ValueError, match="QoS 2"):
        link.publish("fleet/v1/x/up/telemetry", b"{}", qos=2)


def test_a_raising_handler_does_not_stop_later_deliveries(
    broker: Broker, make_link: LinkFactory, device_id: str
) -> None:
    seen: list[bytes] = []

    def handler(msg: InboundMessage) -> None:
        seen.append(msg.payload)
        if msg.payload == b"boom":
            raise RuntimeError("handler bug")

    link = make_link(fast_settings(broker), client_id=device_id)
    link.subscribe(f"fleet/v1/{device_id}/down/cmd/+", handler)
    link.start()
    with Probe(broker.host, broker.port) as probe:
        wait_subscribed(probe, link)
        for payload in (b"boom", b"after-1", b"after-2"):
            probe.publish(f"fleet/v1/{device_id}/down/cmd/x", payload)
    wait_until(lambda: len(seen) == 3, what="three deliveries")
    assert seen == [b"boom", b"after-1", b"after-2"]
    assert link.stats()["handler_errors"] == 1
    assert link.healthy()


def test_a_handler_subscribed_later_gets_the_next_message_of_a_topic_already_delivered(
    broker: Broker, make_link: LinkFactory, device_id: str
) -> None:
    """The dispatcher remembers which handlers a topic goes to; a new subscription must count at once."""
    first: list[bytes] = []
    second: list[bytes] = []
    topic = f"fleet/v1/{device_id}/down/cmd/x"
    link = make_link(fast_settings(broker), client_id=device_id)
    link.subscribe(f"fleet/v1/{device_id}/down/cmd/+", lambda msg: first.append(msg.payload))
    link.start()
    with Probe(broker.host, broker.port) as probe:
        wait_subscribed(probe, link)
        probe.publish(topic, b"one")
        wait_until(lambda: first == [b"one"], what="the first delivery")
        # The same filter: the broker holds one subscription, and delivers each message once.
        link.subscribe(f"fleet/v1/{device_id}/down/cmd/+", lambda msg: second.append(msg.payload))
        probe.publish(topic, b"two")
    wait_until(lambda: len(first) == 2 and len(second) == 1, what="the second delivery to both")
    assert first == [b"one", b"two"]
    assert second == [b"two"]


def test_a_failing_paho_callback_does_not_kill_the_link(
    broker: Broker, make_link: LinkFactory, device_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An exception inside on_message would kill paho's loop (see test_paho_traps); ours is contained."""
    seen: list[bytes] = []
    link = make_link(fast_settings(broker), client_id=device_id)
    link.subscribe(f"fleet/v1/{device_id}/down/cmd/+", lambda m: seen.append(m.payload))
    link.start()
    wait_until(lambda: link.connected, what="connect")
    real_offer = link._inbox.offer
    calls = {"n": 0}

    def offer_failing_once(message: InboundMessage) -> bool:
        calls["n"] += 1
        if calls["n"] == 1:
            raise MemoryError("simulated failure inside the paho callback")
        return real_offer(message)

    monkeypatch.setattr(link._inbox, "offer", offer_failing_once)
    with Probe(broker.host, broker.port) as probe:
        probe.publish(f"fleet/v1/{device_id}/down/cmd/x", b"lost")
        probe.publish(f"fleet/v1/{device_id}/down/cmd/x", b"delivered")
    wait_until(lambda: seen == [b"delivered"], what="delivery after the failure")
    wait_until(lambda: link.stats()["callback_errors"] == 1, what="error counted")
    assert link.connected
    assert link.healthy()


def test_inbox_overflow_is_counted(broker: Broker, make_link: LinkFactory, device_id: str) -> None:
    release = threading.Event()
    entered = threading.Event()
    seen: list[bytes] = []

    def slow(msg: InboundMessage) -> None:
        entered.set()
        release.wait(patient(10))
        seen.append(msg.payload)

    link = make_link(fast_settings(broker, inbox_size=2), client_id=device_id)
    link.subscribe(f"fleet/v1/{device_id}/down/cmd/+", slow)
    link.start()
    with Probe(broker.host, broker.port) as probe:
        wait_subscribed(probe, link)
        probe.publish(f"fleet/v1/{device_id}/down/cmd/x", b"0")
        assert entered.wait(patient(10))  # the dispatcher is busy with message 0
        for i in range(1, 6):
            probe.publish(f"fleet/v1/{device_id}/down/cmd/x", str(i).encode())
    # One in the handler, two waiting, three dropped.
    wait_until(lambda: link.stats()["inbox_dropped"] == 3, what="overflow counted")
    release.set()
    wait_until(lambda: len(seen) == 3, what="the rest delivered")


def test_resubscribes_after_broker_restart(
    private_broker: Broker, make_link: LinkFactory, device_id: str
) -> None:
    seen: list[bytes] = []
    sessions: list[int] = []
    link = make_link(fast_settings(private_broker), client_id=device_id, on_connected=sessions.append)
    link.subscribe(f"fleet/v1/{device_id}/down/cmd/+", lambda m: seen.append(m.payload))
    link.start()
    wait_until(lambda: len(sessions) == 1, what="connect")
    private_broker.restart(hard=True)  # no persistence: the broker forgot every subscription
    wait_until(lambda: len(sessions) == 2, what="reconnect")
    with Probe(private_broker.host, private_broker.port) as probe:
        probe.publish(f"fleet/v1/{device_id}/down/cmd/x", b"after-restart")
    wait_until(lambda: seen == [b"after-restart"], what="delivery after resubscription")
    assert sessions[1] > sessions[0]
    assert link.stats()["reconnects"] == 1


def test_queued_commands_survive_an_agent_restart(
    broker: Broker, make_link: LinkFactory, device_id: str
) -> None:
    """clean_start=False + session expiry: QoS 1 commands sent while the agent was down are delivered."""
    cmd_filter = f"fleet/v1/{device_id}/down/cmd/+"
    settings = fast_settings(broker)
    first = make_link(settings, client_id=device_id)
    first.subscribe(cmd_filter, lambda m: None)
    first.start()
    wait_until(lambda: first.connected, what="connect")
    first.stop()
    with Probe(broker.host, broker.port) as probe:
        probe.publish(f"fleet/v1/{device_id}/down/cmd/rollback", b"while-down")
    seen: list[bytes] = []
    second = make_link(settings, client_id=device_id)
    second.subscribe(cmd_filter, lambda m: seen.append(m.payload))
    second.start()
    wait_until(lambda: seen == [b"while-down"], what="queued command")


def test_durable_messages_survive_a_broker_restart_mid_run(
    broker_factory: Callable[[Sequence[str]], Broker], make_link: LinkFactory, device_id: str, tmp_path: Path
) -> None:
    """Every durable message arrives (duplicates allowed, removed by msg_id) while the broker restarts."""
    persist = tmp_path / "persist"
    persist.mkdir()
    b = broker_factory(["persistence true", f"persistence_location {persist}/"])
    topic = f"fleet/v1/{device_id}/up/jobs/j1"
    total = 150
    with Probe(b.host, b.port, client_id=f"op-{device_id}", session_expiry_s=300) as probe:
        probe.subscribe(topic)
        link = make_link(fast_settings(b), client_id=device_id)
        link.start()
        wait_until(lambda: link.connected, what="connect")
        stopper = threading.Timer(0.2, lambda: b.restart(hard=False))
        stopper.start()
        for i in range(total):
            link.publish(topic, json.dumps({"msg_id": f"m{i}", "i": i}).encode(), durable=True)
            threading.Event().wait(0.004)
        stopper.join()

        def ids(ms: list[Received]) -> set[str]:
            return {json.loads(m.payload)["msg_id"] for m in ms if m.topic == topic}

        probe.wait_for(lambda ms: len(ids(ms)) == total, timeout=30)
    assert ids(probe.snapshot()) == {f"m{i}" for i in range(total)}
    wait_until(lambda: link.stats()["spool_depth"] == 0, what="spool drained")
    assert link.stats()["reconnects"] >= 1


def test_a_new_link_on_the_same_spool_replays_what_is_left(
    private_broker: Broker, make_link: LinkFactory, device_id: str, tmp_path: Path
) -> None:
    topic = f"fleet/v1/{device_id}/up/jobs/j2"
    spool = Spool(tmp_path / "agent.sqlite")
    private_broker.stop()
    offline = make_link(fast_settings(private_broker), client_id=device_id, spool=spool)
    offline.start()
    for i in range(5):
        offline.publish(topic, f"m{i}".encode(), durable=True)
    offline.stop(timeout=0.5)  # the agent stops (or dies) before the broker comes back
    assert spool.count() == 5

    private_broker.start()
    with Probe(private_broker.host, private_broker.port) as probe:
        probe.subscribe(topic)
        restarted = make_link(fast_settings(private_broker), client_id=device_id, spool=spool)
        restarted.start()
        probe.wait_for_count(topic, 5)
    assert [m.payload for m in probe.on_topic(topic)] == [f"m{i}".encode() for i in range(5)]
    wait_until(lambda: spool.count() == 0, what="spool drained")
    restarted.stop()
    spool.close()


def test_acl_denied_durable_message_is_dropped_not_retried(
    broker_factory: Callable[[Sequence[str]], Broker], make_link: LinkFactory, tmp_path: Path
) -> None:
    acl = tmp_path / "acl"
    acl.write_text("topic readwrite allowed/#\n")
    b = broker_factory([f"acl_file {acl}"])
    link = make_link(fast_settings(b, prefix="allowed"), client_id="dev-acl")
    link.start()
    wait_until(lambda: link.connected, what="connect")
    link.publish("forbidden/dev-acl/up/jobs/j", b"denied", durable=True)
    link.publish("allowed/dev-acl/up/jobs/j", b"ok", durable=True)
    wait_until(lambda: link.stats()["spool_depth"] == 0, what="spool empty")
    stats = link.stats()
    assert stats["acl_denied"] == 1
    assert stats["published"] >= 2  # online status + the allowed one
    assert link.connected


def test_password_auth(
    broker_factory: Callable[[Sequence[str]], Broker], make_link: LinkFactory, tmp_path: Path
) -> None:
    passwd = tmp_path / "passwd"
    subprocess.run(["mosquitto_passwd", "-c", "-b", str(passwd), "dev-pw", "s3cret"], check=True)
    b = broker_factory(["allow_anonymous false", f"password_file {passwd}"])
    good_file = tmp_path / "good"
    good_file.write_text("s3cret\n")
    bad_file = tmp_path / "bad"
    bad_file.write_text("wrong\n")

    bad = make_link(fast_settings(b, username="dev-pw", password_file=bad_file), client_id="dev-pw-bad")
    bad.start()
    good = make_link(fast_settings(b, username="dev-pw", password_file=good_file), client_id="dev-pw")
    good.start()
    wait_until(lambda: good.connected, what="connect with the right password")
    wait_until(lambda: bad.stats()["session"] >= 3, what="refused connection retried")
    assert not bad.connected  # a refused CONNACK is never "connected"
    assert bad.healthy()


def test_concurrent_publishers_and_handlers_do_not_deadlock(
    broker: Broker, make_link: LinkFactory, device_id: str
) -> None:
    """Publishing from many threads (and from a handler) while acks flow back (paho#226, #354, #603)."""
    topic = f"fleet/v1/{device_id}/up/results/cam"
    link = make_link(fast_settings(broker, max_inflight=5), client_id=device_id)
    link.subscribe(
        f"fleet/v1/{device_id}/down/cmd/+",
        lambda m: link.publish(f"fleet/v1/{device_id}/up/cmd/echo", m.payload, qos=1),
    )
    link.start()
    with Probe(broker.host, broker.port) as probe:
        probe.subscribe(f"fleet/v1/{device_id}/up/#")
        wait_subscribed(probe, link)

        def publisher(n: int) -> None:
            for i in range(100):
                link.publish(f"{topic}{n}", f"{i}".encode(), qos=1, durable=i % 2 == 0)

        threads = [threading.Thread(target=publisher, args=(n,)) for n in range(4)]
        for t in threads:
            t.start()
        for i in range(20):
            probe.publish(f"fleet/v1/{device_id}/down/cmd/echo", str(i).encode(), qos=0)
        for t in threads:
            t.join(patient(30))
            assert not t.is_alive()
        probe.wait_for(lambda ms: sum(1 for m in ms if m.topic.startswith(topic)) >= 400, timeout=30)
        probe.wait_for_count(f"fleet/v1/{device_id}/up/cmd/echo", 20)
    assert link.healthy()


def arrived(payload: bytes) -> Callable[[list[Received]], bool]:
    return lambda messages: any(m.payload == payload for m in messages)


def test_publishes_from_other_threads_wake_the_loop_once_per_turn_and_none_is_left_behind(
    broker: Broker, make_link: LinkFactory, device_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CoalescedWake skips wake bytes while one is pending; a publish must still never wait for the
    loop's select() timeout, nor a durable (spooled) one, which the loop sends from the spool. The
    timeout is raised to 5 s so that waiting for it would fail here."""
    monkeypatch.setattr(link_module, "_IDLE_LOOP_S", 5.0)
    topic = f"fleet/v1/{device_id}/up/results/cam"
    link = make_link(fast_settings(broker), client_id=device_id)
    link.start()
    wait_until(lambda: link.connected, what="connect")
    with Probe(broker.host, broker.port) as probe:
        probe.subscribe(f"fleet/v1/{device_id}/up/#")
        probe.wait_for_count(f"fleet/v1/{device_id}/up/status", 1)
        wait_until(
            lambda: isinstance(link._core._client._sockpairW, CoalescedWake), what="the wake to be wrapped"
        )
        for round_ in range(3):
            # A lone QoS 0 publish while the loop sleeps in select(): the wake byte must go out.
            threading.Event().wait(0.3)
            lone = f"lone-{round_}".encode()
            link.publish(topic, lone, qos=0)
            probe.wait_for(arrived(lone), timeout=2.0)
            threading.Event().wait(0.3)
            spooled = f"spooled-{round_}".encode()
            link.publish(topic, spooled, durable=True)
            probe.wait_for(arrived(spooled), timeout=2.0)
            threading.Event().wait(0.3)
            batch = [f"many-{round_}-{i}".encode() for i in range(3)]
            assert link.publish_durable([(topic, b) for b in batch], kind="result") == [None] * 3
            probe.wait_for(arrived(batch[-1]), timeout=2.0)
        # Bursts from two threads: most wake bytes are skipped, every message arrives, none twice.
        sent = [f"b{n}-{i}".encode() for n in range(2) for i in range(500)]

        def burst(n: int) -> None:
            for i in range(500):
                link.publish(topic, f"b{n}-{i}".encode(), qos=0)

        threads = [threading.Thread(target=burst, args=(n,)) for n in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(patient(30))
        got = probe.wait_for(
            lambda ms: sum(1 for m in ms if m.payload.startswith(b"b")) >= len(sent), timeout=4.0
        )
    burst_payloads = [m.payload for m in got if m.topic == topic and m.payload.startswith(b"b")]
    assert sorted(burst_payloads) == sorted(sent)
    # Per publisher thread, order is kept (one writer, one socket).
    for n in range(2):
        mine = [p for p in burst_payloads if p.startswith(f"b{n}-".encode())]
        assert mine == [f"b{n}-{i}".encode() for i in range(500)]


class _CountingSocket:
    """paho's wake socket with every send counted by the thread that made it."""

    def __init__(self, sock: object) -> None:
        self.sock = sock
        self.senders: list[int] = []

    def send(self, data: bytes) -> int:
        self.senders.append(threading.get_ident())
        sent: int = self.sock.send(data)  # type: ignore[attr-defined]
        return sent

    def close(self) -> None:
        self.sock.close()  # type: ignore[attr-defined]


def test_acknowledgements_the_loop_queues_itself_go_out_on_its_next_turn_without_a_wake_byte(
    broker: Broker, make_link: LinkFactory, device_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The PUBACK for each received QoS 1 message is queued by the network thread itself: it writes
    no wake byte for it (a send and a receive per message saved), and the acknowledgement still
    leaves on the loop's next turn, not after its select() timeout (5 s here). The broker keeps at
    most 20 unacknowledged messages in flight to a client, so 300 messages arrive only if every
    acknowledgement goes out promptly."""
    monkeypatch.setattr(link_module, "_IDLE_LOOP_S", 5.0)
    topic = f"fleet/v1/{device_id}/down/cmd/burst"
    received: list[InboundMessage] = []
    link = make_link(fast_settings(broker), client_id=device_id)
    link.subscribe(f"fleet/v1/{device_id}/down/cmd/+", received.append, qos=1)
    link.start()
    wait_until(lambda: link.connected, what="connect")
    wait_until(lambda: isinstance(link._core._client._sockpairW, CoalescedWake), what="the wake wrapped")
    # paho types its wake socket as a socket; the core put its own wrapper there (waited for above)
    wake = cast(CoalescedWake, link._core._client._sockpairW)
    counting = _CountingSocket(wake._sock)
    wake._sock = counting
    with Probe(broker.host, broker.port) as probe:
        wait_subscribed(probe, link)
        for i in range(300):
            probe.publish(topic, f"m{i}".encode(), qos=1)
        wait_until(lambda: len(received) >= 300, timeout=20, what="300 QoS 1 messages through the link")
    assert sorted(m.payload for m in received) == sorted(f"m{i}".encode() for i in range(300))
    assert link._net_thread is not None
    assert link._net_thread.ident not in counting.senders


def test_a_half_open_connection_is_detected_and_durable_messages_arrive_after_the_reconnect(
    broker: Broker, make_link: LinkFactory, device_id: str
) -> None:
    """The reference's half-open trap: the link goes silent with both ends open. paho notices after
    ~1.5x keepalive (5 s here); the link reconnects and replays unacknowledged durable messages,
    which may then arrive twice, so each carries an id to deduplicate by."""
    proxy = FreezableProxy(broker.host, broker.port).start()
    topic = f"fleet/v1/{device_id}/up/results/cam"
    sessions: list[int] = []
    try:
        link = make_link(
            fast_settings(broker, port=proxy.port, keepalive_s=5),
            client_id=device_id,
            on_connected=sessions.append,
        )
        link.start()
        wait_until(lambda: link.connected, what="connect through the proxy")
        with Probe(broker.host, broker.port) as probe:  # straight to the broker
            probe.subscribe(topic)
            for i in range(5):
                link.publish(topic, f"before-{i}".encode(), qos=1, durable=True)
            probe.wait_for(lambda ms: len({m.payload for m in ms}) >= 5, timeout=10)
            proxy.freeze()
            for i in range(10):
                link.publish(topic, f"during-{i}".encode(), qos=1, durable=True)
            wait_until(lambda: not link.connected, timeout=15.0, what="the dead link to be noticed")
            wait_until(lambda: link.connected and len(sessions) == 2, timeout=15.0, what="a reconnect")
            expected = {f"before-{i}".encode() for i in range(5)} | {
                f"during-{i}".encode() for i in range(10)
            }
            got = probe.wait_for(lambda ms: {m.payload for m in ms} >= expected, timeout=15)
        assert {m.payload for m in got} == expected  # after dedupe: each exactly once, none lost
        assert sessions[1] > sessions[0]
        assert proxy.accepted == 2
        # Each leaves the spool on its PUBACK, which may come just after the subscriber saw it.
        wait_until(lambda: link.stats()["spool_depth"] == 0, what="the spool to drain")
    finally:
        proxy.close()


def test_on_a_full_disk_the_link_reconnects_and_job_states_still_arrive(
    tmp_path: Path, broker_factory: Callable[[Sequence[str]], Broker], make_link: LinkFactory, device_id: str
) -> None:
    """Issue 8: a full disk (real tmpfs, 0 bytes free) with the broker stopped and started."""
    from structlog.testing import capture_logs

    from tests.small_disk import small_disk

    persist = tmp_path / "mosquitto-db"
    persist.mkdir()
    broker = broker_factory(["persistence true", f"persistence_location {persist}/", "autosave_interval 1"])
    prefix = f"fleet/v1/{device_id}"
    probe = Probe(broker.host, broker.port, client_id=f"probe-{device_id}", session_expiry_s=600)
    commands: list[bytes] = []
    with small_disk(tmp_path / "disk", "4m") as disk, Spool(disk.path / "spool.sqlite") as spool:
        probe.subscribe(f"{prefix}/up/#")
        link = make_link(fast_settings(broker), client_id=device_id, spool=spool)
        link.subscribe(f"{prefix}/down/cmd/+", lambda m: commands.append(m.payload))
        link.start()
        wait_until(lambda: link.connected, what="connect")
        disk.fill()
        with capture_logs() as logs:
            broker.stop()
            wait_until(lambda: not link.connected, what="disconnect")
            for i in range(300):  # results while the broker is down and the disk full: dropped, counted
                link.publish(f"{prefix}/up/results/cam", f"r{i}".encode(), qos=1, durable=True, kind="result")
            link.publish_durable([(f"{prefix}/up/results/cam", b"batch")] * 10, kind="result")
            # A job state nothing can take now is refused, for the caller to hold (the delivery
            # service does: tests/delivery/test_disk_full.py).
            with pytest.raises(TransportError, match="hold it and publish it again"):
                link.publish(f"{prefix}/up/jobs/j1", b"FAILED", qos=1, durable=True)
            session_down = link.session
            broker.start()
            wait_until(lambda: link.connected, timeout=15.0, what="reconnect on a full disk")
            link.publish(f"{prefix}/up/jobs/j1", b"FAILED", qos=1, durable=True)  # connected: from memory
            probe.wait_for_count(f"{prefix}/up/jobs/j1", 1, timeout=15.0)
            link.publish(f"{prefix}/up/telemetry", b'{"ts": 1}', qos=0)
            probe.wait_for_count(f"{prefix}/up/telemetry", 1)
            probe.publish(f"{prefix}/down/cmd/status", b"{}")
            wait_until(lambda: commands == [b"{}"], what="a command on a full disk")
            # Connected on a full disk: a durable result goes out from memory instead of being lost.
            link.publish_durable([(f"{prefix}/up/results/cam", b"connected")], kind="result")
            [result] = probe.wait_for_count(f"{prefix}/up/results/cam", 1)
            assert result.payload == b"connected"
        assert disk.free_bytes() == 0
    probe.close()
    statuses = [s for s in _statuses(probe, f"{prefix}/up/status") if s.state == "online"]
    assert statuses[-1].session > session_down  # the new connection announced itself
    stats = link.stats()
    assert stats["callback_errors"] == 0  # no "mqtt.network.failed: database or disk is full"
    assert stats["spool_fallback_memory"] == 2
    assert spool.stats()["dropped_write_failed"] == 310
    problems = [
        e
        for e in logs
        if e["log_level"] in ("warning", "error")
        and e["event"].startswith(("spool", "mqtt.network", "mqtt.session"))
    ]
    assert [e["event"] for e in problems] == ["spool.write.failed"], problems
    assert not any("exc_info" in e or "exception" in e for e in logs)


def test_durable_results_carry_their_remaining_time_to_live_and_job_states_none(
    broker: Broker, tmp_path: Path, make_link: LinkFactory, device_id: str
) -> None:
    from agent.spool.settings import SpoolSettings

    spool = Spool(tmp_path / "ttl.sqlite", SpoolSettings(results_ttl_s=600.0))
    link = make_link(fast_settings(broker), client_id=device_id, spool=spool)
    prefix = f"fleet/v1/{device_id}"
    with Probe(broker.host, broker.port) as probe:
        probe.subscribe(f"{prefix}/up/#")
        link.start()
        link.publish_durable([(f"{prefix}/up/results/cam", b"r")], kind="result")
        link.publish(f"{prefix}/up/jobs/j", b"s", qos=1, durable=True)
        [result] = probe.wait_for_count(f"{prefix}/up/results/cam", 1)
        [job] = probe.wait_for_count(f"{prefix}/up/jobs/j", 1)
    link.stop()
    spool.close()
    assert result.message_expiry_s is not None
    assert 590 <= result.message_expiry_s <= 600
    assert job.message_expiry_s is None


def test_while_connected_durable_publishers_wait_for_the_link_instead_of_filling_the_spool(
    broker: Broker, make_link: LinkFactory, device_id: str
) -> None:
    settings = fast_settings(broker, max_inflight=10)
    link = make_link(settings, client_id=device_id)
    link.start()
    wait_until(lambda: link.connected, what="connect")
    depths = []
    for i in range(200):  # 6,400 results as fast as the caller can hand them in
        link.publish_durable([(f"fleet/v1/{device_id}/up/results/cam", b"%d" % i)] * 32, kind="result")
        depths.append(link.stats()["spool_depth"])
    # The backlog stays within a few windows (4 x max_inflight, plus the batch handed in last; a
    # margin for a loaded machine, where a wait may run out): without the wait it reaches thousands.
    assert max(depths) <= 500, max(depths)
    wait_until(lambda: link.stats()["spool_depth"] == 0, timeout=30.0, what="drained")


def test_a_batch_of_durable_results_refuses_only_its_oversized_message(
    broker: Broker, make_link: LinkFactory, device_id: str
) -> None:
    link = make_link(fast_settings(broker, max_payload_bytes=100), client_id=device_id)
    topic = f"fleet/v1/{device_id}/up/results/cam"
    with Probe(broker.host, broker.port) as probe:
        probe.subscribe(topic)
        link.start()
        refused = link.publish_durable([(topic, b"a"), (topic, b"x" * 101), (topic, b"c")], kind="result")
        probe.wait_for_count(topic, 2)
        probe.settle()
    assert refused[0] is None
    assert refused[1] is not None
    assert "exceeds the limit of 100 bytes" in refused[1]
    assert refused[2] is None
    assert [m.payload for m in probe.on_topic(topic)] == [b"a", b"c"]
    assert link.stats()["refused_oversize"] == 1


def test_qos0_results_are_counted_when_queued_and_only_acknowledgements_reach_the_core(
    broker: Broker, make_link: LinkFactory, device_id: str
) -> None:
    """The link's paho client leaves ``on_publish`` unset (so paho builds no PUBACK objects per QoS 0
    write); QoS 0 messages are counted as they are queued, and QoS 1 acknowledgements still arrive
    (the durable one leaves the spool, the status is acknowledged)."""
    topic = f"fleet/v1/{device_id}/up/results/cam"
    link = make_link(fast_settings(broker), client_id=device_id)
    acks: list[int] = []
    client = link._core._client
    assert isinstance(client, AckedOnlyClient)
    assert client.on_publish is None
    report = client.on_ack
    assert report is not None

    def counted(c: object, userdata: object, mid: int, code: object, props: object) -> None:
        acks.append(mid)
        report(c, userdata, mid, code, props)

    client.on_ack = counted
    link.start()
    wait_until(lambda: link.connected, what="connect")
    with Probe(broker.host, broker.port) as probe:
        probe.subscribe(f"fleet/v1/{device_id}/up/results/#")
        wait_until(lambda: link.stats()["published"] >= 1, what="the online status acknowledged")
        before, acked_before = link.stats()["published"], len(acks)
        for i in range(20):
            link.publish(topic, f"r{i}".encode(), qos=0)
        # Counted at once, on the publishing thread: not when (or whether) paho reports the write.
        assert link.stats()["published"] == before + 20
        probe.wait_for_count(topic, 20)
        assert len(acks) == acked_before  # no QoS 0 write reached the core
        link.publish(topic, b"durable", durable=True)
        wait_until(lambda: link.stats()["spool_depth"] == 0, what="the durable one acknowledged")
        assert len(acks) == acked_before + 1
        assert link.stats()["published"] == before + 21


def test_an_inbox_taken_without_a_timeout_waits_for_the_next_item() -> None:
    """The dispatcher takes without a timeout (an idle one sleeps): the next item still wakes it."""
    inbox = Inbox(4)
    taken: list[object] = []
    taker = threading.Thread(target=lambda: taken.append(inbox.take(timeout=None)), daemon=True)
    taker.start()
    inbox.put_control(Connected(3))
    taker.join(patient(10))
    assert taken == [Connected(3)]
