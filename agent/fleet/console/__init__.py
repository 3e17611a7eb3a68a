"""The fleet console: a web page of the controller showing devices and rollouts, updated live.

Only ``agent.fleet`` uses it (the controller serves it next to ``/metrics``); it is the one place
that imports Starlette and uvicorn, which come with the ``fleet`` extra, so a device installs none
of them. See docs/console.md.
"""

from agent.fleet.console.app import ConsoleActions, make_console_app
from agent.fleet.console.server import ConsoleServer, console_token, serve_console

__all__ = ["ConsoleActions", "ConsoleServer", "console_token", "make_console_app", "serve_console"]
