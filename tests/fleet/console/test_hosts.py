"""The console's Host check over a real uvicorn (agent/fleet/console/hosts.py): a request naming
another site (what a DNS-rebinding page sends) is refused on every route, /metrics included, and
costs the app nothing; localhost, IP literals, the bind address and the configured names pass."""

from __future__ import annotations

import http.client
import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.config import read_yaml
from agent.errors import ConfigError
from agent.fleet.console import ConsoleServer, make_console_app, serve_console
from agent.fleet.console.hosts import host_name
from agent.fleet.controller.config import ControllerConfig, load_controller_config
from agent.fleet.metrics.exposition import fleet_metrics
from agent.fleet.metrics.serving import metrics_asgi_app
from agent.fleet.rollout.store import RolloutStore
from agent.fleet.view.live import FleetView
from tests.fleet.console_rig import StoreActions, feed, fleet_messages, make_rollout, new_store
from tests.waiting import patient

REPO = Path(__file__).resolve().parents[3]
PREFIX = "fleet/v1"
TOKEN = "host-check-token-for-tests"
#: Every route the console serves (an action with the right token: the Host check comes first).
ROUTES = [
    ("GET", "/"),
    ("GET", "/device/jet-01"),
    ("GET", "/rollouts"),
    ("GET", "/static/console.js"),
    ("GET", "/api/devices"),
    ("GET", "/api/device/jet-01"),
    ("GET", "/api/rollouts"),
    ("GET", "/api/rollout/r-1"),
    ("GET", "/events?want=devices,rollouts"),
    ("GET", "/metrics"),
    ("POST", "/api/rollouts/r-1/pause"),
]


@pytest.fixture
def store(tmp_path: Path) -> Iterator[RolloutStore]:
    s = new_store(tmp_path)
    make_rollout(s, "r-1", [["jet-01", "jet-02"]])
    yield s
    s.close()


def _serve(
    store: RolloutStore,
    host: str = "127.0.0.1",
    allowed: tuple[str, ...] = (),
    actions: StoreActions | None = None,
) -> ConsoleServer:
    view = FleetView(PREFIX)
    feed(view, fleet_messages(PREFIX, ["jet-01", "jet-02"]))
    registry = fleet_metrics(view, lambda: store.rollouts(limit=50), store.device_counts, store.change_mark)
    app = make_console_app(
        view, store, actions or StoreActions(store), token=TOKEN, metrics_app=metrics_asgi_app(registry)
    )
    return serve_console(app, host, 0, allowed_hosts=allowed)


def _ask(server: ConsoleServer, method: str, path: str, host: str | None) -> tuple[int, bytes]:
    """One request with ``Host: host`` (None: no Host header at all); the status and the start of the
    body (/events never ends: only its first line is read)."""
    connection = http.client.HTTPConnection(server.host, server.port, timeout=patient(10))
    try:
        connection.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
        if host is not None:
            connection.putheader("Host", host)
        connection.putheader("Authorization", f"Bearer {TOKEN}")
        connection.putheader("Content-Length", "0")
        connection.endheaders()
        response = connection.getresponse()
        body = (
            response.readline() if path.startswith("/events") and response.status == 200 else response.read()
        )
        return response.status, body
    finally:
        connection.close()


def test_a_foreign_host_is_refused_on_every_route_and_reaches_nothing(store: RolloutStore) -> None:
    actions = StoreActions(store)
    server = _serve(store, allowed=("fleet.example.com",), actions=actions)
    try:
        refused = {path: _ask(server, method, path, f"evil.example:{server.port}") for method, path in ROUTES}
        calls_refused = list(actions.calls)
        allowed = {path: _ask(server, method, path, f"127.0.0.1:{server.port}") for method, path in ROUTES}
    finally:
        server.stop()

    for path, (code, body) in refused.items():
        assert code == 403, path
        message = json.loads(body)["error"]
        assert f"'evil.example:{server.port}'" in message, message
        assert "http.allowed_hosts" in message, message
    assert calls_refused == []  # the refused pause never reached the app
    for path, (code, _) in allowed.items():
        assert code == 200, path
    assert actions.calls == [("pause", "r-1")]  # the allowed one did


@pytest.mark.parametrize(
    "host",
    [
        "localhost",
        "localhost:{port}",
        "LocalHost.:{port}",
        "127.0.0.1",
        "127.0.0.1:{port}",
        "10.1.2.3:9090",  # an IP literal: no DNS answer can change where it leads
        "[::1]:{port}",
        "fleet.example.com",  # configured: a proxy's `proxy_set_header Host $host` sends it bare
        "Fleet.Example.COM:443",
        "prometheus-target.internal:{port}",
    ],
)
def test_localhost_ip_literals_and_configured_names_are_answered(store: RolloutStore, host: str) -> None:
    server = _serve(store, allowed=("fleet.example.com", "prometheus-target.internal"))
    try:
        code, body = _ask(server, "GET", "/api/devices", host.format(port=server.port))
        metrics, _ = _ask(server, "GET", "/metrics", host.format(port=server.port))
    finally:
        server.stop()

    assert code == 200, body
    assert json.loads(body)["total"] == 2
    assert metrics == 200


@pytest.mark.parametrize(
    "host",
    [
        "evil.example",
        "fleet.example.com.evil.example",  # a configured name as a prefix is not that name
        "127.0.0.1.evil.example",
        "localhost.evil.example",
        "::1",  # IPv6 without brackets: not a valid Host
        "[::1",
        "fleet.example.com:https",
        "",
    ],
)
def test_other_hosts_and_malformed_ones_are_refused(store: RolloutStore, host: str | None) -> None:
    server = _serve(store, allowed=("fleet.example.com",))
    try:
        code, body = _ask(server, "GET", "/api/devices", host)
    finally:
        server.stop()

    assert code == 403
    assert "Host" in json.loads(body)["error"]


def test_a_request_without_host_is_refused_before_the_app(store: RolloutStore) -> None:
    server = _serve(store)
    try:
        code, _ = _ask(server, "GET", "/api/devices", None)
    finally:
        server.stop()

    assert code == 400  # HTTP/1.1 requires Host: uvicorn refuses it before the check even runs


def test_a_console_bound_to_a_name_or_ipv6_answers_that_name(store: RolloutStore) -> None:
    named = _serve(store, host="localhost")
    v6 = _serve(store, host="::1")
    try:
        by_name = _ask(named, "GET", "/api/devices", f"localhost:{named.port}")[0]
        by_v6 = _ask(v6, "GET", "/api/devices", f"[::1]:{v6.port}")[0]
        foreign = _ask(v6, "GET", "/api/devices", f"evil.example:{v6.port}")[0]
    finally:
        named.stop()
        v6.stop()

    assert v6.url == f"http://[::1]:{v6.port}"
    assert (by_name, by_v6, foreign) == (200, 200, 403)


def test_host_name_strips_port_brackets_and_case() -> None:
    assert host_name("Fleet.Example.com:8080") == "fleet.example.com"
    assert host_name("[::1]:8080") == "::1"
    assert host_name("[::1]") == "::1"
    assert host_name("fleet.example.com.") == "fleet.example.com"
    assert host_name("a:1:2") is None
    assert host_name("fleet.example.com:99999x") is None


def test_allowed_hosts_are_names_and_a_url_or_port_is_refused_by_key(tmp_path: Path) -> None:
    path = tmp_path / "controller.yaml"
    path.write_text(
        "unsigned: true\nhttp: {port: 8080, allowed_hosts: [fleet.example.com, 10.0.0.5, '::1']}\n"
    )
    assert load_controller_config(path).http.allowed_hosts == ["fleet.example.com", "10.0.0.5", "::1"]
    for bad in ("https://fleet.example.com", "fleet.example.com:8443", "fleet example", "*"):
        path.write_text(f"unsigned: true\nhttp: {{port: 8080, allowed_hosts: ['{bad}']}}\n")
        with pytest.raises(ConfigError) as refused:
            load_controller_config(path)
        (problem,) = refused.value.problems
        assert problem.startswith(f"http.allowed_hosts: {bad!r} is not a host name"), problem
        assert "without scheme, port or path" in problem


def test_the_commented_example_in_controller_yaml_parses_when_uncommented(tmp_path: Path) -> None:
    text = (REPO / "configs" / "controller.yaml").read_text()
    assert "  # allowed_hosts: [fleet.example.com]\n" in text
    path = tmp_path / "controller.yaml"
    path.write_text(
        text.replace("  # allowed_hosts:", "  allowed_hosts:").replace("port: null", "port: 8080")
    )
    config = ControllerConfig.model_validate(read_yaml(path))
    assert config.http.allowed_hosts == ["fleet.example.com"]


def test_the_documented_refusal_is_what_the_console_answers(store: RolloutStore) -> None:
    doc = (REPO / "docs" / "console.md").read_text()
    section = doc.split("## Which Host it answers", 1)[1].split("\n## ", 1)[0]
    (example,) = re.findall(r"```json\n(.*?)\n```", section, re.S)
    server = _serve(store)
    try:
        code, body = _ask(server, "GET", "/api/devices", "evil.example:8080")
    finally:
        server.stop()

    assert code == 403
    assert json.loads(body) == json.loads(example)


def test_the_documented_prometheus_target_is_scraped_once_its_name_is_allowed(store: RolloutStore) -> None:
    """docs/operations.md scrapes the controller by name: refused until http.allowed_hosts lists it."""
    ops = (REPO / "docs" / "operations.md").read_text()
    (target,) = re.findall(r'job_name: edge-fleet\n.*?targets: \["([^"]+)"\]', ops, re.S)
    name = target.rsplit(":", 1)[0]
    assert f"`http.allowed_hosts: [{name}]`" in ops
    without, allowed = _serve(store), _serve(store, allowed=(name,))
    try:
        refused = _ask(without, "GET", "/metrics", target)[0]
        scraped, body = _ask(allowed, "GET", "/metrics", target)
    finally:
        without.stop()
        allowed.stop()

    assert refused == 403
    assert scraped == 200
    assert b"edge_device_online" in body
