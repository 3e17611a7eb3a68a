"""The claim signs what the controller checks (the real ``verify_claim``); a bad claim file is named."""

from __future__ import annotations

from pathlib import Path

import pytest
from cryptography import x509

from agent.enrollment.claim import Claim
from agent.enrollment.keys import certificate_request, load_or_make_key
from agent.errors import ConfigError
from agent.fleet.ca.claims import make_claim, verify_claim
from agent.fleet.ca.csr import check_csr
from agent.protocol.enrollment import EnrollRequest
from agent.protocol.messages import decode, encode
from tests.fleet.ca.ca_rig import make_ca


def test_a_request_signed_by_the_claim_passes_the_controllers_checks_after_the_wire(tmp_path: Path) -> None:
    done = make_ca(tmp_path)
    bundle = make_claim(done.ca.path, "batch-9", uses=1, days=1, out_dir=tmp_path / "claim")
    claim = Claim.load(bundle.cert_file, bundle.key_file)
    key = load_or_make_key(tmp_path / "dev" / "device.key")
    request = decode(EnrollRequest, encode(claim.request("jet-9", certificate_request(key, "jet-9"), "SN-9")))
    claims_ca = x509.load_pem_x509_certificate(done.ca.claims_cert.read_bytes())
    proof = verify_claim(
        request.claim_cert_pem.encode(),
        bytes.fromhex(request.claim_signature),
        request.signed_bytes(),
        claims_ca,
    )
    assert proof.name == "batch-9"
    assert check_csr(request.csr_pem.encode(), "jet-9").device_id == "jet-9"
    assert request.serial == "SN-9"


def test_a_claim_file_that_is_missing_or_wrong_is_named_by_its_key(tmp_path: Path) -> None:
    cert, key = tmp_path / "claim.crt", tmp_path / "claim.key"
    with pytest.raises(ConfigError, match=r"enrollment\.claim_cert_file"):
        Claim.load(cert, key)
    cert.write_text("not pem\n")
    with pytest.raises(ConfigError, match=r"enrollment\.claim_cert_file: .* holds no PEM certificate"):
        Claim.load(cert, key)
    cert.write_text("-----BEGIN CERTIFICATE-----\n")
    key.write_text("not a key\n")
    with pytest.raises(ConfigError, match=r"enrollment\.claim_key_file: cannot read the private key"):
        Claim.load(cert, key)
