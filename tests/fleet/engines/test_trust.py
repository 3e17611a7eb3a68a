"""The controller's trust rules for shared engines, as the pure decisions they are."""

from __future__ import annotations

import hashlib

import pytest

from agent.engines.sharing.trust import EngineRefusedError, verified_record
from agent.fleet.engines.trust import (
    JobFacts,
    missing_files,
    offer_refusal,
    sharing_for,
    sign_record,
    withdraws,
)
from agent.protocol.engines import EngineDrop
from agent.signing import Ed25519PrivateKey
from tests.fleet.engines.records import KEY, offer, record_of

ACTIVE = JobFacts("ACTIVE", shadow=True, probation=True)


@pytest.mark.parametrize(
    ("flag", "setting", "can_sign", "shared"),
    [
        (None, True, True, True),  # the controller's default
        (None, False, True, False),
        (True, False, True, True),  # the rollout's flag wins
        (False, True, True, False),
        (True, True, False, False),  # never without a key: devices accept no unsigned engine
        (None, True, False, False),
    ],
)
def test_a_rollout_shares_engines_by_its_flag_else_the_setting_and_never_unsigned(
    flag: bool | None, setting: bool, can_sign: bool, shared: bool
) -> None:
    assert sharing_for(flag, setting, can_sign=can_sign) is shared


def refusal(job: JobFacts | None = ACTIVE, data: bytes = b"engine bytes", **changes: object) -> str | None:
    found = offer_refusal(
        offer(KEY, data, **changes), sharing=True, job=job, max_engine_bytes=1024, withdrawn={(KEY, "b" * 64)}
    )
    return None if found is None else found.code


def test_an_engine_is_taken_only_after_its_job_ran_to_active_through_shadow_and_probation() -> None:
    assert refusal() is None
    assert refusal(shadow=False) == "not_guarded"
    assert refusal(probation_s=0.0) == "not_guarded"
    assert refusal(JobFacts("PROBATION", shadow=True, probation=True)) == "not_active"
    assert refusal(None) == "not_active"
    assert refusal(JobFacts("ACTIVE", shadow=True, probation=False)) == "not_guarded"
    assert refusal(JobFacts("ACTIVE", shadow=False, probation=True)) == "not_guarded"


def test_an_offer_not_active_yet_may_be_repeated_and_other_refusals_may_not() -> None:
    waiting = offer_refusal(offer(), sharing=True, job=None, max_engine_bytes=1024, withdrawn=())
    assert waiting is not None
    assert waiting.retry
    off = offer_refusal(offer(), sharing=False, job=ACTIVE, max_engine_bytes=1024, withdrawn=())
    assert off is not None
    assert (off.code, off.retry) == ("sharing_off", False)


def test_an_offer_over_the_size_bound_or_withdrawn_is_refused() -> None:
    assert refusal(data=b"x" * 2048) == "too_large"
    bad = b"bad engine"
    withdrawn = {(KEY, hashlib.sha256(bad).hexdigest())}
    found = offer_refusal(
        offer(data=bad), sharing=True, job=ACTIVE, max_engine_bytes=1024, withdrawn=withdrawn
    )
    assert found is not None
    assert found.code == "withdrawn"
    # The same key with other bytes (a sound rebuild elsewhere) is taken.
    assert (
        offer_refusal(offer(), sharing=True, job=ACTIVE, max_engine_bytes=1024, withdrawn=withdrawn) is None
    )


def test_a_drop_withdraws_only_the_engine_it_is_about() -> None:
    stored = record_of(offer(data=b"stored"))
    stored_sha = hashlib.sha256(b"stored").hexdigest()

    def drop(key: str = KEY, sha: str | None = stored_sha) -> EngineDrop:
        return EngineDrop(key=key, engine_sha256=sha, stage="load", reason="did not load")

    assert withdraws(drop(), stored)
    assert withdraws(drop(sha=None), stored)  # refused before download: about the stored one
    assert not withdraws(drop(sha="c" * 64), stored)  # about bytes since replaced
    assert not withdraws(drop(key="d" * 64), stored)
    assert not withdraws(drop(), None)


def test_the_controller_vouches_with_the_operator_key_and_a_device_checks_it() -> None:
    key = Ed25519PrivateKey.generate()
    record = record_of(offer())
    signed = sign_record(record, key, "ops")
    assert verified_record(signed, {"ops": key.public_key()}) == record
    with pytest.raises(EngineRefusedError, match="does not trust"):
        verified_record(signed, {"other": key.public_key()})
    with pytest.raises(EngineRefusedError, match="does not match"):
        verified_record(signed, {"ops": Ed25519PrivateKey.generate().public_key()})
    with pytest.raises(EngineRefusedError, match="not signed"):
        verified_record(signed.model_copy(update={"signature": ""}), {"ops": key.public_key()})
    altered = signed.model_copy(update={"record": signed.record.replace("dev-a", "dev-z")})
    with pytest.raises(EngineRefusedError, match="does not match"):
        verified_record(altered, {"ops": key.public_key()})


def test_only_the_files_the_store_lacks_are_uploaded() -> None:
    made = offer()
    assert missing_files(made, []) == [made.files[0].sha256]
    assert missing_files(made, [made.files[0].sha256]) == []
