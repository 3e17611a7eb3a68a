"""Build claims (agent/fleet/engines/claims.py): one builder per key; the others wait; a claim ends
when stored, released, its job ended, or its builder went quiet; everything bounded. Pure: the
clock is passed in."""

from __future__ import annotations

from agent.fleet.engines.claims import MAX_RETRY_S, Claim, ClaimBook

KEY = "a" * 64
OTHER = "b" * 64


def book(**kw: float) -> ClaimBook:
    args = {"quiet_s": 60.0, "max_claims": 10, "retry_s": 5.0} | kw
    return ClaimBook(quiet_s=args["quiet_s"], max_claims=int(args["max_claims"]), retry_s=args["retry_s"])


def test_the_first_asker_builds_and_every_other_asker_waits_for_it() -> None:
    claims = book()
    first = claims.ask(KEY, "d1", job_id="j1", fingerprint="fp", now=0.0)
    assert first.kind == "build"
    assert first.claim is not None
    assert first.claim.device == "d1"
    for device in ("d2", "d3", "d2"):
        wait = claims.ask(KEY, device, job_id="j1", fingerprint="fp", now=1.0)
        assert (wait.kind, wait.claim is not None and wait.claim.device, wait.retry_s) == ("wait", "d1", 5.0)
    claim = claims.get(KEY)
    assert claim is not None
    assert claim.waiters == {"d2", "d3"}
    # Another key is claimed on its own.
    assert claims.ask(OTHER, "d2", job_id="j1", fingerprint="fp", now=1.0).kind == "build"


def test_the_holder_asking_again_keeps_its_claim_and_renews_it() -> None:
    claims = book(quiet_s=10.0)
    claims.ask(KEY, "d1", job_id=None, fingerprint="fp", now=0.0)
    assert claims.ask(KEY, "d1", job_id="j2", fingerprint="fp", now=8.0).kind == "build"
    assert claims.renew(KEY, "d1", now=16.0)
    assert not claims.renew(KEY, "d2", now=16.0)  # only the holder renews
    assert claims.ask(KEY, "d2", job_id=None, fingerprint="fp", now=25.0).kind == "wait"  # 9 s quiet
    claim = claims.get(KEY)
    assert claim is not None
    assert claim.job_id == "j2"


def test_a_quiet_builder_loses_its_claim_to_the_next_asker() -> None:
    claims = book(quiet_s=10.0)
    claims.ask(KEY, "d1", job_id=None, fingerprint="fp", now=0.0)
    assert claims.ask(KEY, "d2", job_id=None, fingerprint="fp", now=10.0).kind == "wait"
    taken = claims.ask(KEY, "d2", job_id=None, fingerprint="fp", now=10.5)
    assert taken.kind == "build"
    assert taken.claim is not None
    assert taken.claim.device == "d2"
    assert not claims.renew(KEY, "d1", now=11.0)  # the old builder hears it is no longer its claim
    assert claims.stats["expired"] == 1
    assert claims.ended[-1][:2] == (KEY, "d1")
    assert "quiet" in claims.ended[-1][2]


def test_a_release_or_a_stored_engine_ends_the_claim() -> None:
    claims = book()
    claims.ask(KEY, "d1", job_id=None, fingerprint="fp", now=0.0)
    assert not claims.release(KEY, "d2", "not mine")
    assert claims.release(KEY, "d1", "build failed")
    assert claims.ask(KEY, "d2", job_id=None, fingerprint="fp", now=1.0).kind == "build"
    claims.settled(KEY)
    assert claims.get(KEY) is None
    assert len(claims) == 0


def test_a_claim_whose_job_ended_without_active_goes_to_the_next_asker() -> None:
    claims = book()
    claims.ask(KEY, "d1", job_id="j1", fingerprint="fp", now=0.0)

    def ended(claim: Claim) -> str | None:
        return "its job j1 ended ROLLED_BACK" if claim.job_id == "j1" else None

    taken = claims.ask(KEY, "d2", job_id="j9", fingerprint="fp", now=1.0, ended=ended)
    assert taken.kind == "build"
    assert taken.claim is not None
    assert taken.claim.device == "d2"
    assert claims.ended[-1] == (KEY, "d1", "its job j1 ended ROLLED_BACK")


def test_claims_are_bounded_and_the_wait_grows_with_the_waiters() -> None:
    claims = book(max_claims=2)
    for n, key in enumerate(("c" * 64, "d" * 64)):
        assert claims.ask(key, f"d{n}", job_id=None, fingerprint="fp", now=0.0).kind == "build"
    assert claims.ask("e" * 64, "dx", job_id=None, fingerprint="fp", now=0.0).kind == "build_unclaimed"
    assert len(claims) == 2
    many = book()
    many.ask(KEY, "builder", job_id=None, fingerprint="fp", now=0.0)
    for n in range(1000):
        last = many.ask(KEY, f"w{n}", job_id=None, fingerprint="fp", now=1.0)
    assert last.retry_s == 20.0  # 1,000 waiters at about 50 asks a second
    for n in range(1000, 12_000):
        last = many.ask(KEY, f"w{n}", job_id=None, fingerprint="fp", now=1.0)
    claim = many.get(KEY)
    assert claim is not None
    assert len(claim.waiters) == 10_000
    assert last.retry_s == MAX_RETRY_S
    assert len(many.ended) == 0


def test_the_waiters_of_a_released_claim_do_not_wait_for_one_another() -> None:
    """The holder gave up (its INT8 check rejected the engine): the first waiter to ask again takes
    the claim, and every other device that waited builds at once, not one after the other."""
    claims = book()
    claims.ask(KEY, "d1", job_id="j1", fingerprint="fp", now=0.0)
    for device in ("d2", "d3", "d4"):
        assert claims.ask(KEY, device, job_id="j2", fingerprint="fp", now=1.0).kind == "wait"
    assert claims.release(KEY, "d1", "the INT8 check rejected it")
    taken = claims.ask(KEY, "d3", job_id="j2", fingerprint="fp", now=2.0)
    assert taken.kind == "build"
    assert taken.claim is not None
    assert taken.claim.device == "d3"
    for device in ("d2", "d4"):
        freed = claims.ask(KEY, device, job_id="j2", fingerprint="fp", now=2.5)
        assert (freed.kind, freed.freed) == ("build_unclaimed", True)
    # A device that never waited for the one that gave up waits for the new holder, as before.
    assert claims.ask(KEY, "d5", job_id="j2", fingerprint="fp", now=3.0).kind == "wait"
    assert claims.ask(KEY, "d2", job_id="j2", fingerprint="fp", now=3.0).kind == "wait"  # freed once
    # Stored: nothing is left to free.
    claims.settled(KEY)
    assert claims.ask(KEY, "d4", job_id="j2", fingerprint="fp", now=4.0).kind == "build"


def test_the_waiters_of_an_expired_claim_hand_it_on_one_at_a_time() -> None:
    """A quiet holder (killed) may have built all but the offer: its waiters keep waiting for the next
    holder rather than all building at once."""
    claims = book(quiet_s=10.0)
    claims.ask(KEY, "d1", job_id="j1", fingerprint="fp", now=0.0)
    for device in ("d2", "d3"):
        claims.ask(KEY, device, job_id="j2", fingerprint="fp", now=1.0)
    assert claims.ask(KEY, "d2", job_id="j2", fingerprint="fp", now=11.0).kind == "build"
    assert claims.ask(KEY, "d3", job_id="j2", fingerprint="fp", now=11.5).kind == "wait"
