"""The NATS connection every node and client shares: connect with a time limit, reconnect
forever (logged), drain on close."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from typing import Any

import nats
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.manager import JetStreamManager

from mesh.config import NatsSettings
from mesh.lifecycle import Lifecycle
from mesh.logs import get_logger
from protocol.errors import UnavailableError

log = get_logger(__name__)


class Connection(Lifecycle):
    """An open NATS connection; ``nc``/``js``/``jsm`` raise a clear error before ``connect()``."""

    def __init__(self, settings: NatsSettings, name: str) -> None:
        self.settings = settings
        self.name = name
        self._nc: Client | None = None
        self._js: JetStreamContext | None = None
        self._closing = False

    @property
    def nc(self) -> Client:
        if self._nc is None:
            raise RuntimeError("not connected to NATS: call connect() or use 'async with' first")
        return self._nc

    @property
    def js(self) -> JetStreamContext:
        if self._js is None:
            raise RuntimeError("not connected to NATS: call connect() or use 'async with' first")
        return self._js

    def jsm(self) -> JetStreamManager:
        return self.nc.jsm(timeout=self.settings.request_timeout)

    async def connect(self) -> Connection:
        servers = self.settings.servers()
        client = Client()

        async def on_error(exc: Exception) -> None:
            log.warning("nats error", connection=self.name, error=repr(exc))

        async def on_disconnected() -> None:
            if self._closing:
                log.debug("nats connection closed", connection=self.name)
            else:
                log.warning("nats disconnected", connection=self.name)

        async def on_reconnected() -> None:
            log.info("nats reconnected", connection=self.name, server=str(client.connected_url))

        try:
            await asyncio.wait_for(
                client.connect(
                    **_auth(self.settings),
                    servers=servers,
                    name=self.name,
                    connect_timeout=max(1, round(self.settings.connect_timeout)),
                    reconnect_time_wait=self.settings.reconnect_wait,  # type: ignore[arg-type]
                    max_reconnect_attempts=self.settings.max_reconnect_attempts,
                    drain_timeout=max(1, round(self.settings.drain_timeout)),
                    error_cb=on_error,
                    disconnected_cb=on_disconnected,
                    reconnected_cb=on_reconnected,
                ),
                timeout=self.settings.connect_timeout,
            )
        except (asyncio.TimeoutError, OSError, nats.errors.Error) as exc:
            await _close_quietly(client)
            raise UnavailableError(
                f"cannot connect to NATS at {', '.join(servers)} within "
                f"{self.settings.connect_timeout:g}s ({type(exc).__name__}); is nats-server "
                "running? `mesh up` starts a local one"
            ) from None
        self._nc = client
        self._js = client.jetstream(timeout=self.settings.request_timeout)
        log.debug("nats connected", connection=self.name, server=str(client.connected_url))
        return self

    async def close(self) -> None:
        """Drain subscriptions and flush pending publishes, within the drain timeout."""
        client, self._nc, self._js = self._nc, None, None
        if client is None or client.is_closed:
            return
        self._closing = True
        try:
            await asyncio.wait_for(client.drain(), timeout=self.settings.drain_timeout + 1)
        except (asyncio.TimeoutError, nats.errors.Error) as exc:
            log.warning("nats drain incomplete", connection=self.name, error=repr(exc))
        finally:
            await _close_quietly(client)

    start = connect
    stop = close


def _auth(settings: NatsSettings) -> dict[str, Any]:
    """Credentials and TLS options for nats-py, from the settings that are set."""
    options: dict[str, Any] = {}
    if settings.creds_file:
        options["user_credentials"] = settings.creds_file
    if settings.token:
        options["token"] = settings.token
    if settings.user:
        options["user"] = settings.user
        options["password"] = settings.password or ""
    if settings.tls_ca_file or settings.tls_cert_file:
        context = ssl.create_default_context(cafile=settings.tls_ca_file)
        if settings.tls_cert_file:
            context.load_cert_chain(settings.tls_cert_file, settings.tls_key_file)
        options["tls"] = context
    return options


async def _close_quietly(client: Client) -> None:
    if client.is_closed:
        return
    with contextlib.suppress(asyncio.TimeoutError, nats.errors.Error, OSError):
        await asyncio.wait_for(client.close(), timeout=2)
