"""A build claim nobody will settle ends: the holder's job ACTIVE on another engine (the controller's
own check, for an agent that never releases it), and the operator's ``fleet engines release KEY``
(real controller, real mosquitto, the device's requests published as a device does)."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from agent.demo.broker import Broker
from agent.fleet.engines.desk import EngineDesk
from agent.fleet.engines.listing import released_line
from agent.fleet.engines.settings import EngineShareSettings
from agent.fleet.engines.trust import JobFacts
from agent.protocol.engines import EngineAsk, EngineClaim
from agent.protocol.messages import CommandReply, decode
from agent.protocol.topics import Topics
from agent.signing import Ed25519PrivateKey
from tests.engines.fleet_desk import make_desk
from tests.fleet.controller.test_process import Running, controller, keys, prefix
from tests.mqtt_probe import Probe
from tests.waiting import wait_until

#: The controller test module's fixtures, used here by name.
__all__ = ["controller", "keys", "prefix"]

KEY = "c0ffee" + "1" * 58
TWIN = "c0ffee" + "2" * 58


def ask(desk: EngineDesk, device: str, job_id: str = "j1", key: str = KEY) -> dict[str, object]:
    return desk.handle(device, "ask", EngineAsk(key=key, job_id=job_id).model_dump_json().encode(), {})


def test_a_claim_whose_job_went_active_without_offering_ends_after_the_quiet_time(tmp_path: Path) -> None:
    """An agent that kept renewing the claim of an engine its job never ran (the INT8 check rejected it,
    the job went ACTIVE at FP16): the controller ends it ``claim_quiet_s`` after hearing the job ACTIVE."""
    states = {"j1": "BUILDING"}
    desk = make_desk(
        tmp_path,
        Ed25519PrivateKey.generate(),
        settings=EngineShareSettings(claim_quiet_s=0.5, claim_retry_s=0.1),
    )
    desk._job_facts = lambda _device, job: JobFacts(states[job], shadow=True, probation=True)
    assert ask(desk, "d1")["build"] is True
    assert ask(desk, "d2", "j2")["build"] is False  # d1 builds
    states["j1"] = "ACTIVE"
    renew = EngineClaim(key=KEY, action="renew").model_dump_json().encode()

    def taken_over() -> bool:
        desk.handle("d1", "claim", renew, {})  # the holder keeps renewing: not quiet
        return ask(desk, "d2", "j2")["build"] is True

    wait_until(taken_over, timeout=10.0, what="d2 told to build once d1's job is ACTIVE without an offer")
    holder = desk.claims.get(KEY)
    assert holder is not None
    assert holder.device == "d2"
    (why,) = [w for k, d, w in desk.claims.ended if (k, d) == (KEY, "d1")]
    assert "went ACTIVE" in why
    assert "offered no engine" in why
    assert desk.handle("d1", "claim", renew, {}) == {"held": False}  # d1 hears it and stops


def test_a_holder_renewing_the_claim_of_a_job_that_ended_hears_at_once_that_it_is_over(
    tmp_path: Path,
) -> None:
    """A job superseded between its build and its activation: the device's heartbeat still runs, but
    the controller ends the claim at that heartbeat (no one has to ask first) and says so."""
    states = {"j1": "BUILDING"}
    desk = make_desk(tmp_path, Ed25519PrivateKey.generate())
    desk._job_facts = lambda _device, job: JobFacts(states[job], shadow=False, probation=False)
    assert ask(desk, "d1")["build"] is True
    renew = EngineClaim(key=KEY, action="renew").model_dump_json().encode()
    assert desk.handle("d1", "claim", renew, {}) == {"held": True}
    states["j1"] = "SUPERSEDED"
    assert desk.handle("d1", "claim", renew, {}) == {"held": False}
    assert desk.claims.get(KEY) is None
    assert desk.claims.ended[-1] == (KEY, "d1", "its job j1 ended SUPERSEDED")
    assert desk.claims.stats["job_ended"] == 1


def _device_ask(
    probe: Probe, prefix: str, device: str, payload: bytes, verb: str = "ask"
) -> dict[str, object]:
    topics = Topics(prefix, device)
    correlation = uuid.uuid4().hex.encode()
    probe.publish(
        topics.engines_request(verb),
        payload,
        response_topic=topics.engines_reply,
        correlation_data=correlation,
    )
    got = probe.wait_for(lambda seen: any(m.correlation_data == correlation for m in seen), timeout=30)
    replies = [m for m in got if m.correlation_data == correlation]
    answer = decode(CommandReply, replies[-1].payload)
    assert answer.ok, answer
    return answer.result or {}


def test_the_operator_releases_a_stuck_claim_and_the_next_asker_builds(
    broker: Broker, prefix: str, controller: Running, capsys: pytest.CaptureFixture[str]
) -> None:
    from agent.cli import main

    cli = ["--broker", f"{broker.host}:{broker.port}", "--prefix", prefix]
    with Probe(broker.host, broker.port) as probe:
        probe.subscribe(f"{prefix}/+/down/engines/reply")
        for key in (KEY, TWIN):
            claimed = _device_ask(
                probe, prefix, "d1", EngineAsk(key=key, job_id="j1").model_dump_json().encode()
            )
            assert claimed["build"] is True
        waiting = _device_ask(probe, prefix, "d2", EngineAsk(key=KEY, job_id="j2").model_dump_json().encode())
        assert waiting["build"] is False

        # Six characters start both keys: refused, naming them; an unknown key likewise.
        assert main(["fleet", "engines", "release", KEY[:6], "--json", *cli]) == 1
        refused = json.loads(capsys.readouterr().out)
        assert (refused["released"], refused["error_code"]) == (False, "ambiguous_key")
        assert main(["fleet", "engines", "release", "deadbeef", *cli]) == 1
        err = capsys.readouterr().err
        assert "no build claim on key deadbeef" in err
        assert err.rstrip().endswith("(unknown_claim)")

        assert main(["fleet", "engines", "release", KEY[:12], "--reason", "stuck", "--json", *cli]) == 0
        released = json.loads(capsys.readouterr().out)
        assert (released["key"], released["device"], released["waiting"]) == (KEY, "d1", 1)
        assert main(["fleet", "engines", "list", "--json", *cli]) == 0
        assert [c["key"] for c in json.loads(capsys.readouterr().out)["claims"]] == [TWIN]

        # The holder hears it at its next renewal; the waiting device builds now.
        renew = EngineClaim(key=KEY, action="renew").model_dump_json().encode()
        assert _device_ask(probe, prefix, "d1", renew, "claim") == {"held": False}
        taken = _device_ask(probe, prefix, "d2", EngineAsk(key=KEY, job_id="j2").model_dump_json().encode())
        assert taken["build"] is True
        assert main(["fleet", "engines", "release", TWIN[:12], *cli]) == 0
        assert "released the build claim on c0ffee222222 held by d1" in capsys.readouterr().out
    ended = controller.controller.engines.claims.ended
    assert any(k == KEY and "released by the operator: stuck" in why for k, _d, why in ended)


def test_the_release_example_in_docs_fleet_md_is_what_the_command_prints() -> None:
    doc = (Path(__file__).resolve().parents[3] / "docs" / "fleet.md").read_text()
    shown = doc.split("$ edge-agent fleet engines release ", 1)[1].split("\n```", 1)[0].splitlines()[1]
    result = {"key": "7d2c4e6f8a0b" * 5 + "1234", "device": "jet-c4", "since": 1772370300.0, "waiting": 17}
    assert released_line(result) == shown
