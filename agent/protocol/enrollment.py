"""Enrollment and renewal: what a device and the controller say to give the device its certificate.

A device that holds only a claim (a certificate of the fleet's claims CA, shared by a batch of
devices) connects to the broker's enrollment listener with the client id ``enroll:{device_id}`` and
asks for a certificate of its own (:class:`EnrollRequest`, a PKCS#10 request for a key it made and
never sends). The controller admits it by policy and answers (:class:`EnrollReply`): ``issued``
with the certificate, ``pending`` until an operator accepts, ``rejected`` by an operator, or
``refused`` with a code naming what was wrong. From then on the device is an ordinary device on the
devices listener, and renews over its own connection (:class:`CertRenewal` on ``up/cert``, answered
on ``down/cert``). Every field is bounded: the controller keeps what a claim holder sends.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import Field

from agent.names import NAME_PATTERN
from agent.protocol.messages import Envelope, FiniteTime

#: The client id a claim connects with: ``enroll:`` and the device id, after the connecting client's
#: ``mqtt.client_id_prefix`` (``fleet:`` under configs/mosquitto/, whose ``clientid_prefixes`` holds
#: on every listener). No device id holds ``:``, so a claim holder can never take over the session of
#: an enrolled device (whose client id is its device id). The enrollment topics' client id level is
#: that whole client id (the broker's ACL matches it as ``%c``).
ENROLL_CLIENT_PREFIX = "enroll:"
#: Longest client id prefix before ``enroll:`` (as ``mqtt.client_id_prefix`` allows).
MAX_CLIENT_ID_PREFIX_CHARS = 32
#: Largest PEM text a message carries (a certificate request, a certificate, a short chain).
MAX_PEM_CHARS = 16 * 1024
#: Longest serial number or hardware id a device names itself by.
MAX_SERIAL_CHARS = 128
#: Longest one-line explanation in a reply.
MAX_MESSAGE_CHARS = 300
#: Longest request id (the device's correlation of a reply to its request).
MAX_REQUEST_ID_CHARS = 64

_REQUEST_ID = r"^[A-Za-z0-9_-]{1,64}$"
_HEX_SIGNATURE = r"^[0-9a-f]{2,512}$"
_CLIENT_ID_PREFIX = re.compile(rf"^[^\s/+#]{{0,{MAX_CLIENT_ID_PREFIX_CHARS}}}$")


def enroll_client_id(device_id: str, client_id_prefix: str = "") -> str:
    """The MQTT client id a device enrolls with (``{client_id_prefix}enroll:{device_id}``)."""
    return client_id_prefix + ENROLL_CLIENT_PREFIX + device_id


def device_of_enroll_client(client_id: str) -> str | None:
    """The device id an enrollment client id names (``[prefix]enroll:{device id}``), or None."""
    prefix, found, device_id = client_id.rpartition(ENROLL_CLIENT_PREFIX)
    if not found or not _CLIENT_ID_PREFIX.match(prefix):
        return None
    return device_id if NAME_PATTERN.match(device_id) else None


class EnrollRequest(Envelope):
    """``{prefix}/enroll/enroll:{device}/request``: a device with a claim asks for its certificate.

    ``claim_signature`` is the claim key's ECDSA-SHA256 signature (hex of the DER) over
    :meth:`signed_bytes`: the controller cannot see which broker credential published, so the
    request proves which claim it spends.
    """

    device_id: str = Field(max_length=64, description="The id the certificate is for (its CN).")
    request_id: str = Field(pattern=_REQUEST_ID, description="Echoed by the reply it gets.")
    serial: str | None = Field(
        None,
        max_length=MAX_SERIAL_CHARS,
        description="A hardware serial the operator may have registered the device by.",
    )
    csr_pem: str = Field(max_length=MAX_PEM_CHARS, description="PKCS#10 request, PEM.")
    claim_cert_pem: str = Field(max_length=MAX_PEM_CHARS, description="The claim certificate, PEM.")
    claim_signature: str = Field(pattern=_HEX_SIGNATURE, description="Claim key's signature, hex.")

    def signed_bytes(self) -> bytes:
        """The bytes the claim key signs: every field but the signature, as sorted compact JSON."""
        return signed_request_bytes(self.model_dump(mode="json", exclude={"claim_signature"}))


def signed_request_bytes(fields: dict[str, Any]) -> bytes:
    """Canonical bytes of a request's fields (the device signs these before the model exists)."""
    body = {key: value for key, value in fields.items() if value is not None and key != "claim_signature"}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


class CertRenewal(Envelope):
    """``{prefix}/{device}/up/cert``: an enrolled device asks for a new certificate before expiry.

    Only the device's own certificate can publish here (the devices listener's ACL), so the request
    needs no other proof; the key may be the same or a new one.
    """

    request_id: str = Field(pattern=_REQUEST_ID, description="Echoed by the reply it gets.")
    csr_pem: str = Field(max_length=MAX_PEM_CHARS, description="PKCS#10 request, PEM.")


EnrollOutcome = Literal["issued", "pending", "rejected", "refused"]


class EnrollReply(Envelope):
    """``.../enroll/enroll:{device}/reply`` or ``{prefix}/{device}/down/cert``: the controller's answer.

    ``issued`` carries the certificate and its chain up to (not including) the root; ``pending``,
    ``rejected`` and ``refused`` carry ``code`` and a one-line ``message`` naming what was wrong, and
    ``retry_after_s``: the device waits at least that long before asking again.
    """

    request_id: str = Field(pattern=_REQUEST_ID)
    outcome: EnrollOutcome
    code: str | None = Field(None, max_length=64, description="Why, for every outcome but issued.")
    message: str = Field("", max_length=MAX_MESSAGE_CHARS, description="One line for the operator.")
    retry_after_s: FiniteTime | None = Field(None, ge=0, description="Wait at least this long.")
    cert_pem: str | None = Field(None, max_length=MAX_PEM_CHARS, description="The device certificate.")
    chain_pem: str | None = Field(None, max_length=MAX_PEM_CHARS, description="Intermediates, PEM.")
