"""The controller's decisions about shared engines, as pure functions (the trust rules of docs/engines.md).

- :func:`sharing_for` — whether a rollout shares engines: its flag, else the controller's setting,
  and never without a signing key (devices accept no unsigned engine).
- :func:`offer_refusal` — whether an offered engine may be taken: sharing on, a plain upload size,
  the job that ran it seen ACTIVE *with* shadow and probation figures, not a withdrawn engine.
- :func:`withdraws` — whether a device's drop report withdraws the stored engine fleet-wide.
- :func:`sign_record` — the controller vouches: the record's exact JSON signed with the operator key.
"""

from __future__ import annotations

import base64
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from agent.protocol.engines import EngineDrop, EngineOffer, EngineRecord, SignedEngine
from agent.signing import Ed25519PrivateKey, sign


@dataclass(frozen=True)
class JobFacts:
    """What the controller heard of the job an offer names (from the device's ``up/jobs``)."""

    state: str
    shadow: bool  # shadow figures were published
    probation: bool  # probation figures were published


@dataclass(frozen=True)
class Refusal:
    """Why an offer is not taken: a stable code, the words, and whether asking again later may help."""

    code: str
    reason: str
    retry: bool = False


def sharing_for(rollout_flag: bool | None, setting: bool, *, can_sign: bool) -> bool:
    """Whether a rollout's devices share engines: the rollout's flag when given, else the setting;
    never when the controller cannot sign (a device accepts no unsigned engine)."""
    wanted = setting if rollout_flag is None else rollout_flag
    return wanted and can_sign


def offer_refusal(
    offer: EngineOffer,
    *,
    sharing: bool,
    job: JobFacts | None,
    max_engine_bytes: int,
    withdrawn: Collection[tuple[str, str]],
) -> Refusal | None:
    """None when ``offer`` may be uploaded and vouched for; else why not."""
    if not sharing:
        return Refusal("sharing_off", "this controller does not share engines (engines.share: false)")
    size = sum(f.size for f in offer.files)
    if size > max_engine_bytes:
        return Refusal("too_large", f"the engine is {size} bytes, more than engines.max_engine_bytes")
    if not offer.shadow or offer.probation_s <= 0:
        return Refusal("not_guarded", "only an engine that ran through shadow and probation is shared")
    if job is None or job.state != "ACTIVE":
        # The offer may overtake the job's ACTIVE status on the broker: the device asks again.
        seen = "nothing" if job is None else job.state
        return Refusal("not_active", f"job {offer.job_id} is not ACTIVE here yet (heard: {seen})", retry=True)
    if not (job.shadow and job.probation):
        return Refusal("not_guarded", f"job {offer.job_id} published no shadow and probation figures")
    engine = engine_sha256(offer.meta)
    if engine is not None and (offer.key, engine) in withdrawn:
        return Refusal("withdrawn", "this engine was withdrawn after it failed on a device")
    return None


def engine_sha256(meta: dict[str, object]) -> str | None:
    """The engine file's SHA-256 a sidecar records (None when it records none)."""
    value = meta.get("engine_sha256")
    return value if isinstance(value, str) else None


def withdraws(drop: EngineDrop, stored: EngineRecord | None) -> bool:
    """A drop report withdraws the stored engine when it is about that very engine (a report about an
    engine the store has since replaced, or never held, withdraws nothing). One device's report is
    enough: withdrawing costs the fleet one build, serving a bad engine costs every device a failure."""
    if stored is None or stored.key != drop.key:
        return False
    return drop.engine_sha256 is None or drop.engine_sha256 == engine_sha256(stored.meta)


def sign_record(record: EngineRecord, key: Ed25519PrivateKey, key_id: str) -> SignedEngine:
    """The controller's vouching: the record's JSON, signed with the operator's key."""
    text = record.model_dump_json()
    signature = base64.b64encode(sign(key, text.encode("utf-8"))).decode("ascii")
    return SignedEngine(record=text, key_id=key_id, signature=signature)


def missing_files(offer: EngineOffer, have: Sequence[str]) -> list[str]:
    """SHA-256s of the offer's files the store does not hold yet (what the device must upload)."""
    held = set(have)
    return [f.sha256 for f in offer.files if f.sha256 not in held]
