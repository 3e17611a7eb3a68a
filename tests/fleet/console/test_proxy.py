"""docs/console.md's nginx TLS reverse proxy, run for real: the documented server block (with a
throw-away certificate, free ports and the console's address put in) in front of a real console
that lists the proxy's name in ``allowed_hosts``, as the doc says: the page and the API through
HTTPS, the live stream's first frame arriving through the proxy without waiting in a buffer, and a
request naming another host refused on every location (the proxy passes the Host on)."""

from __future__ import annotations

import datetime
import http.client
import re
import shutil
import ssl
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from agent.demo.broker import free_port
from agent.fleet.console.app import make_console_app
from agent.fleet.console.server import ConsoleServer, serve_console
from agent.fleet.view.live import FleetView
from tests.fleet.console_rig import StoreActions, feed, fleet_messages, new_store
from tests.waiting import patient, wait_until

DOC = Path(__file__).resolve().parents[3] / "docs" / "console.md"
NGINX = shutil.which("nginx") or "/usr/sbin/nginx"
pytestmark = pytest.mark.skipif(not Path(NGINX).exists(), reason="nginx is not installed (tools/os-deps.sh)")


def _documented_server_block() -> str:
    (block,) = re.findall(r"```nginx\n(.*?)```", DOC.read_text(), re.S)
    return str(block)


def _certificate(folder: Path) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fleet.example.com")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .sign(key, hashes.SHA256())
    )
    crt, pem = folder / "fleet.crt", folder / "fleet.key"
    crt.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    pem.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return crt, pem


@pytest.fixture
def console(tmp_path: Path) -> Iterator[ConsoleServer]:
    view = FleetView("fleet/v1")
    feed(view, fleet_messages("fleet/v1", ["jet-01", "jet-02"]))
    store = new_store(tmp_path)
    app = make_console_app(view, store, StoreActions(store), token=None)
    server = serve_console(app, "127.0.0.1", 0, allowed_hosts=["fleet.example.com"])
    yield server
    server.stop()
    store.close()


def test_the_documented_tls_proxy_serves_the_console_and_streams_its_events(
    tmp_path: Path, console: ConsoleServer
) -> None:
    crt, key = _certificate(tmp_path)
    port = free_port()
    block = (
        _documented_server_block()
        .replace("listen 443 ssl;", f"listen 127.0.0.1:{port} ssl;")
        .replace("/etc/ssl/fleet.example.com.crt", str(crt))
        .replace("/etc/ssl/fleet.example.com.key", str(key))
        .replace("http://127.0.0.1:8080", console.url.rstrip("/"))
    )
    conf = tmp_path / "nginx.conf"
    conf.write_text(
        f"pid {tmp_path / 'nginx.pid'};\nerror_log {tmp_path / 'error.log'};\nevents {{}}\n"
        f"http {{\n access_log off;\n client_body_temp_path {tmp_path};\n proxy_temp_path {tmp_path};\n"
        f" fastcgi_temp_path {tmp_path};\n uwsgi_temp_path {tmp_path};\n scgi_temp_path {tmp_path};\n"
        f"{block}}}\n"
    )
    checked = subprocess.run(
        [NGINX, "-t", "-c", str(conf), "-p", str(tmp_path)], check=False, capture_output=True, text=True
    )
    assert checked.returncode == 0, checked.stderr
    nginx = subprocess.Popen([NGINX, "-c", str(conf), "-p", str(tmp_path), "-g", "daemon off;"])
    try:
        context = ssl.create_default_context(cafile=str(crt))
        context.check_hostname = False  # the throw-away certificate names fleet.example.com

        def connect() -> http.client.HTTPSConnection:
            return http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=patient(10))

        named = {"Host": "fleet.example.com"}  # what a browser opening https://fleet.example.com/ sends

        def api_answers() -> bool:
            try:
                conn = connect()
                conn.request("GET", "/api/devices", headers=named)
                return conn.getresponse().status == 200
            except OSError:
                time.sleep(0.1)
                return False

        wait_until(api_answers, timeout=15, what="nginx in front of the console")
        conn = connect()
        conn.request("GET", "/api/devices", headers=named)
        assert b"jet-02" in conn.getresponse().read()
        conn = connect()
        conn.request("GET", "/", headers=named)
        assert b"<html" in conn.getresponse().read().lower()
        # A page of another site whose name was pointed at this proxy: refused behind every location.
        for path in ("/", "/api/devices", "/events"):
            conn = connect()
            conn.request("GET", path, headers={"Host": "evil.example"})
            refused = conn.getresponse()
            assert refused.status == 403, path
            assert "http.allowed_hosts" in refused.read().decode()
        # The live stream: its first frame arrives through the proxy at once, not when a buffer fills.
        stream = connect()
        stream.request("GET", "/events", headers={**named, "Accept": "text/event-stream"})
        response = stream.getresponse()
        assert response.status == 200
        assert response.getheader("content-type", "").startswith("text/event-stream")
        started = time.monotonic()
        first = response.readline()
        assert first.startswith((b"event:", b"data:", b"id:", b"retry:", b":")), first
        assert time.monotonic() - started < 5
        stream.close()
    finally:
        nginx.terminate()
        nginx.wait(patient(10))
