"""Child process for the Last Will test: run a link until killed.

Usage: python link_child.py HOST PORT SPOOL_PATH DEVICE_ID. Prints ``connected <session>`` once
connected, then sleeps; the test kills it with SIGKILL.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import structlog

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from agent.mqtt.link import MqttLink
from agent.mqtt.settings import MqttSettings
from agent.spool.queue import Spool
from tests.waiting import patient


def main() -> None:
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))  # stdout is for the test
    host, port, spool_path, device = sys.argv[1:5]
    connected = threading.Event()
    sessions: list[int] = []

    def on_connected(session: int) -> None:
        sessions.append(session)
        connected.set()

    link = MqttLink(
        MqttSettings(host=host, port=int(port), reconnect_min_s=0.05, reconnect_max_s=0.3, keepalive_s=5),
        client_id=device,
        status_topic=f"fleet/v1/{device}/up/status",
        agent_version="0.0.test",
        spool=Spool(Path(spool_path)),
        on_connected=on_connected,
    )
    link.start()
    if not connected.wait(patient(10)):
        sys.exit("not connected within 10 s")
    print(f"connected {sessions[0]}", flush=True)
    while True:
        time.sleep(60)


if __name__ == "__main__":
    main()
