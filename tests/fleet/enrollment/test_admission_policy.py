"""The admission policy, pure (agent/fleet/enrollment/admission.py): each rule and its order."""

from __future__ import annotations

from agent.fleet.enrollment.admission import Known, admit
from agent.fleet.enrollment.book import Enrolled, Pending, Registration

NOBODY = Known(None, None, None, None, None)


def _enrolled(fingerprint: str) -> Enrolled:
    return Enrolled("cam-1", fingerprint, "ab", 2e9, 1e9, "batch", None, "r1", "CERT", "CHAIN")


def _pending(fingerprint: str, code: str = "pending") -> Pending:
    return Pending("cam-1", "batch", None, fingerprint, "CSR", "r1", code, 1e9, 1e9, 1, 0, "enroll:cam-1")


def test_an_unknown_id_waits_and_a_second_request_with_its_key_only_counts() -> None:
    assert admit("cam-1", None, "k1", NOBODY).action == "wait"
    again = admit("cam-1", None, "k1", Known(None, _pending("k1"), None, None, None))
    assert (again.action, again.code) == ("touch", "pending")


def test_a_waiting_id_asked_with_another_key_is_contested_not_replaced() -> None:
    verdict = admit("cam-1", None, "k2", Known(None, _pending("k1"), None, None, None))
    assert (verdict.action, verdict.code) == ("refuse", "id_contested")


def test_an_id_registered_with_a_serial_is_issued_only_for_that_serial() -> None:
    by_id = Registration("cam-1", "SN-1", "cli")
    assert admit("cam-1", "SN-1", "k1", Known(None, None, None, by_id, None)).action == "issue"
    for serial in ("SN-2", None):
        verdict = admit("cam-1", serial, "k1", Known(None, None, None, by_id, None))
        assert (verdict.action, verdict.code) == ("refuse", "serial_mismatch")


def test_a_registered_serial_admits_whatever_id_names_it() -> None:
    by_serial = Registration(None, "SN-9", "file")
    assert admit("cam-7", "SN-9", "k1", Known(None, None, None, None, by_serial)).action == "issue"


def test_an_enrolled_id_gets_its_certificate_again_for_its_key_and_waits_for_an_operator_for_another() -> (
    None
):
    assert admit("cam-1", None, "k1", Known(_enrolled("k1"), None, None, None, None)).action == "resend"
    other = admit(
        "cam-1", None, "k2", Known(_enrolled("k1"), None, None, Registration("cam-1", None, "cli"), None)
    )
    assert (other.action, other.code) == ("wait", "already_enrolled")
    assert "--reenroll" in other.message


def test_a_rejected_id_stays_rejected_even_when_its_serial_is_registered() -> None:
    verdict = admit(
        "cam-1", "SN-9", "k1", Known(None, None, "stolen", None, Registration(None, "SN-9", "cli"))
    )
    assert (verdict.action, verdict.code) == ("rejected", "rejected")
    assert "stolen" in verdict.message


def test_a_revoked_id_waits_for_an_operator_whatever_key_it_asks_with() -> None:
    for key in ("k1", "k2"):
        verdict = admit("cam-1", None, key, Known(_enrolled("k1"), None, None, None, None, revoked=True))
        assert (verdict.action, verdict.code) == ("wait", "revoked")
