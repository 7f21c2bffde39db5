"""Library manners: the SDK writes nothing to stdout or stderr on its own.

Run in a fresh interpreter, as an application would use it: nobody has configured structlog or
the standard library's logging. The SDK's lines then go to the ``mesh`` logger (a
``NullHandler`` only), and appear, readable, once the application configures logging.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from mesh.nats_server import NatsServer

ROOT = Path(__file__).resolve().parent.parent

APP = """
import asyncio, logging, sys
from mesh.client import MeshClient
from protocol.errors import MeshError

if sys.argv[2] == "configured":
    logging.basicConfig(level=logging.DEBUG, stream=sys.stderr)

async def main():
    async with MeshClient(sys.argv[1], edge_id="nobody-here") as client:
        try:  # no edge answers: a typed error, and a warning or two inside the SDK
            await client.complete("hi", max_tokens=4)
        except MeshError as exc:
            print("error:", exc.code.value)

asyncio.run(main())
"""


def _run(url: str, mode: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", APP, url, mode],
        cwd=ROOT,
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )


async def test_the_sdk_prints_nothing_of_its_own(nats_server: NatsServer) -> None:
    quiet = _run(nats_server.url, "quiet")
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stdout == "error: unavailable\n"  # the application's own line, nothing else
    assert quiet.stderr == ""


async def test_the_sdk_logs_readably_once_the_app_configures_logging(
    nats_server: NatsServer,
) -> None:
    loud = _run(nats_server.url, "configured")
    assert loud.returncode == 0, loud.stderr
    assert loud.stdout == "error: unavailable\n"
    # Through the application's handler, on its stream, with the server as a URL.
    assert f"nats connected connection=mesh-client server={nats_server.url}" in loud.stderr
    assert "ParseResult" not in loud.stderr
    assert "DEBUG:mesh.connection:" in loud.stderr
