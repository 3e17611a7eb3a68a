"""An RTSP camera: gst-rtsp-server serving live H.264/H.265 with a frame counter burnt into each frame.

Run with the system python3 (PyGObject and gst-rtsp-server come from Debian packages, see
tools/os-deps.sh); tests start it through :class:`tests.camera.rtsp_camera.RtspCamera`. The
password, when there is one, comes in the environment variable ``RTSP_PASSWORD``, never in argv.

Every frame is gray with three rows of 32 blocks at the top (:func:`frame_bytes`): the frame's
number since this camera started, the wall clock in milliseconds modulo 2**32 when the frame was
made, and the number's bitwise inverse (a damaged frame rarely keeps the two consistent).

Prints ``ready <port>`` once listening, and one ``client <n>`` line per RTSP connection accepted.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import gi

gi.require_version("Gst", "1.0")
gi.require_version("GstRtspServer", "1.0")
gi.require_version("GstRtsp", "1.0")
from gi.repository import GLib, Gst, GstRtsp, GstRtspServer  # noqa: E402

BITS = 32
ROWS = 3
ZERO, ONE = 16, 235


def frame_bytes(width: int, height: int, counter: int, wall_ms: int) -> bytes:
    """A GRAY8 frame carrying ``counter`` and ``wall_ms`` as blocks (see the module docstring)."""
    block_w, block_h = width // BITS, max(8, height // 15)
    pad = b"\x80" * (width - block_w * BITS)
    rows = []
    for value in (counter, wall_ms, ~counter):
        bits = (value >> (BITS - 1 - i) & 1 for i in range(BITS))
        line = b"".join(bytes([ONE if bit else ZERO]) * block_w for bit in bits)
        rows.append((line + pad) * block_h)
    background = bytes([60 + counter % 120]) * width
    return b"".join(rows) + background * (height - ROWS * block_h)


def _launch(args: argparse.Namespace) -> str:
    caps = f"video/x-raw,format=GRAY8,width={args.width},height={args.height},framerate={args.fps}/1"
    if args.codec == "h264":
        encode = (
            f"x264enc tune=zerolatency speed-preset=ultrafast key-int-max={args.gop} bitrate={args.kbps} "
            "! rtph264pay config-interval=1 pt=96"
        )
    else:
        encode = (
            f"x265enc tune=zerolatency speed-preset=ultrafast key-int-max={args.gop} bitrate={args.kbps} "
            "! rtph265pay config-interval=1 pt=96"
        )
    # The element named pay0 is what the server streams. With loss, packets are dropped after the
    # payloader, which is what a lossy network does to them.
    tail = f" ! identity name=pay0 drop-probability={args.loss}" if args.loss > 0 else " name=pay0"
    return (
        f"( appsrc name=src is-live=true format=time do-timestamp=true caps={caps} "
        f"! videoconvert ! video/x-raw,format=I420 ! {encode}{tail} )"
    )


class Camera:
    """One mount, ``/stream``; every client gets its own pipeline fed from a shared frame clock."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.started = time.monotonic()
        self.clients = 0

    def media_configure(self, _factory: Any, media: Any) -> None:
        appsrc = media.get_element().get_by_name("src")
        state: dict[str, int | None] = {"n": None}

        def push() -> bool:
            if self.args.silent and state["n"] is not None:
                return True  # answered DESCRIBE with the first frame; never another
            n = round((time.monotonic() - self.started) * self.args.fps)
            state["n"] = n
            data = frame_bytes(self.args.width, self.args.height, n, int(time.time() * 1000) % 2**BITS)
            return bool(appsrc.emit("push-buffer", Gst.Buffer.new_wrapped(data)) == Gst.FlowReturn.OK)

        GLib.timeout_add(max(1, round(1000 / self.args.fps)), push)

    def client_connected(self, _server: Any, _client: Any) -> None:
        self.clients += 1
        print(f"client {self.clients}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--codec", choices=("h264", "h265"), default="h264")
    parser.add_argument("--width", type=int, default=320)
    parser.add_argument("--height", type=int, default=240)
    parser.add_argument("--fps", type=int, default=25)
    parser.add_argument("--gop", type=int, default=10, help="Frames between keyframes.")
    parser.add_argument("--kbps", type=int, default=800)
    parser.add_argument("--protocols", choices=("tcp", "udp", "both"), default="both")
    parser.add_argument("--loss", type=float, default=0.0, help="Probability of dropping each RTP packet.")
    parser.add_argument("--user", default="", help="Require this user (password in $RTSP_PASSWORD).")
    parser.add_argument("--silent", action="store_true", help="Answer RTSP, then send no frame.")
    args = parser.parse_args()

    Gst.init(None)
    camera = Camera(args)
    server = GstRtspServer.RTSPServer()
    server.set_address("127.0.0.1")
    server.set_service(str(args.port))
    factory = GstRtspServer.RTSPMediaFactory()
    factory.set_launch(_launch(args))
    factory.connect("media-configure", camera.media_configure)
    protocols = {
        "tcp": GstRtsp.RTSPLowerTrans.TCP,
        "udp": GstRtsp.RTSPLowerTrans.UDP,
        "both": GstRtsp.RTSPLowerTrans.TCP | GstRtsp.RTSPLowerTrans.UDP,
    }
    factory.set_protocols(protocols[args.protocols])
    if args.user:
        auth = GstRtspServer.RTSPAuth()
        token = GstRtspServer.RTSPToken()
        token.set_string(GstRtspServer.RTSP_TOKEN_MEDIA_FACTORY_ROLE, "viewer")
        auth.add_basic(GstRtspServer.RTSPAuth.make_basic(args.user, os.environ["RTSP_PASSWORD"]), token)
        server.set_auth(auth)
        factory.add_role_from_structure(
            Gst.Structure.new_from_string(
                "viewer, media.factory.access=(boolean)true, media.factory.construct=(boolean)true"
            )
        )
    server.get_mount_points().add_factory("/stream", factory)
    server.connect("client-connected", camera.client_connected)
    if server.attach(None) == 0:
        sys.exit(f"cannot listen on 127.0.0.1:{args.port}")
    print(f"ready {args.port}", flush=True)
    GLib.MainLoop().run()


if __name__ == "__main__":
    main()
