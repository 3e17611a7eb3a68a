"""The console's enrollment page and a device's certificate expiry, in a real headless Chromium over a
real controller process (its enrollment desk on, a console token made here) and a real mosquitto:
devices enroll as an agent does (tests/fleet/enrollment/enroll_rig.py), the operator accepts one
and rejects another with the token, and the device page says when a certificate runs out."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography import x509
from playwright.sync_api import Page, expect

from agent.demo.broker import Broker
from agent.protocol.messages import CertificateInfo, InfoMessage, StatusMessage, encode
from agent.protocol.topics import Topics
from tests.fleet.console import test_browser
from tests.fleet.enrollment.enroll_rig import EnrollRig, csr_pem, new_key, signed_request, start_rig

pytestmark = pytest.mark.slow

#: test_browser.py's fixtures: one Chromium per module, a page that fails the test on a script error.
browser = test_browser.browser
page = test_browser.page


@pytest.fixture
def token() -> str:
    return secrets.token_urlsafe(24)


@pytest.fixture
def rig(tmp_path: Path, broker: Broker, token: str) -> Iterator[EnrollRig]:
    running = start_rig(tmp_path, broker, token=token)
    yield running
    running.probe.close()
    running.controller.kill()


def test_the_operator_accepts_one_waiting_device_and_rejects_another_with_the_token(
    rig: EnrollRig, page: Page, token: str
) -> None:
    claim = rig.claim()
    first = signed_request("cam-a", claim, csr_pem(new_key(), "cam-a"), serial="SN-A")
    assert rig.ask(first)["outcome"] == "pending"
    assert rig.ask(signed_request("cam-b", claim, csr_pem(new_key(), "cam-b")))["outcome"] == "pending"
    page.goto(rig.controller.url + "/enrollment")
    page.wait_for_selector("#enrollment[data-rendered='1']")
    expect(page.locator("#pending tr.pending")).to_have_count(2)
    expect(page.locator("#pending tr[data-device='cam-a']")).to_contain_text("SN-A")
    page.click("#pending tr[data-device='cam-a'] button.accept")
    page.wait_for_selector("#token-box:not([hidden])")
    page.fill("#token-input", token)
    page.click("#token-save")
    page.wait_for_selector("#message.ok")
    assert "cam-a accepted: certificate" in page.inner_text("#message")
    issued = rig.reply("enroll:cam-a", first.request_id, nth=2)
    assert issued["outcome"] == "issued"
    expect(page.locator("#enrolled tr[data-device='cam-a'] .expiry")).to_have_text("expires in 29 days")
    page.click("#pending tr[data-device='cam-b'] button.reject")  # the token is kept for the tab
    expect(page.locator("#pending tr.pending")).to_have_count(0)
    expect(page.locator("#no-pending")).to_be_visible()
    again = rig.ask(signed_request("cam-b", claim, csr_pem(new_key(), "cam-b")))
    assert again["outcome"] == "rejected"


def test_a_wrong_token_accepts_nothing(rig: EnrollRig, page: Page) -> None:
    assert rig.ask(signed_request("cam-c", rig.claim(), csr_pem(new_key(), "cam-c")))["outcome"] == "pending"
    page.goto(rig.controller.url + "/enrollment")
    page.click("#pending tr[data-device='cam-c'] button.accept")
    page.fill("#token-input", secrets.token_urlsafe(24))
    page.click("#token-save")
    page.wait_for_selector("#message.error")
    assert "refused (401)" in page.inner_text("#message")
    assert [p["device_id"] for p in rig.operator("pending")["pending"]] == ["cam-c"]


def test_the_device_page_says_when_its_certificate_expires(rig: EnrollRig, page: Page) -> None:
    rig.operator("register", {"device_id": "cam-d"})
    reply = rig.ask(signed_request("cam-d", rig.claim(), csr_pem(new_key(), "cam-d")))
    cert = x509.load_pem_x509_certificate(reply["cert_pem"].encode())
    topics = Topics(rig.prefix, "cam-d")
    rig.probe.publish(
        topics.status, encode(StatusMessage(state="online", session=1, agent_version="t")), retain=True
    )
    certificate = CertificateInfo(
        serial=f"{cert.serial_number:x}", not_after=cert.not_valid_after_utc.timestamp(), issuer="devices"
    )
    info = InfoMessage(
        device_id="cam-d", agent_version="t", platform={}, labels={}, backends={}, slots={}, streams=[],
        certificate=certificate,
    )  # fmt: skip
    rig.probe.publish(topics.info, encode(info), retain=True)
    page.goto(rig.controller.url + "/device/cam-d")
    page.wait_for_selector("body[data-device=rendered]")
    expect(page.locator("#facts")).to_contain_text("expires in 29 days")
