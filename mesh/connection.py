"""The NATS connection every node and client shares: connect with a time limit, reconnect
forever (logged), drain on close.

It also counts the moments after which messages may have been missed: every reconnect, and
every slow-consumer drop. A reader compares :attr:`Connection.losses` before and after a wait;
when it moved, the reader fetches what it missed from where it is kept. Nodes register
:meth:`Connection.on_reconnect` callbacks to put back control state a server restart lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, TypeVar

import nats
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api
from nats.js.manager import JetStreamManager
from nats.micro.service import Service

from mesh.config import NatsSettings
from mesh.credentials import check_creds_file, connect_options, is_auth_error, tls_reason
from mesh.js_acks import Acks, Gone
from mesh.lifecycle import Lifecycle
from mesh.logs import get_logger
from mesh.recovery import Recovery, Step
from mesh.refusals import Refusals
from mesh.safe_client import SafeClient
from mesh.tasks import first_of
from mesh.write_batch import WriteBatch, gap_s
from protocol.errors import UnauthorizedError, UnavailableError
from protocol.subjects import NODES_STREAM

log = get_logger(__name__)

T = TypeVar("T")

NOT_CONNECTED = "not connected to NATS: call connect() or use 'async with' first"
HUB_ANSWERED_S = 0.25
"""How long the hub's answer to :meth:`Connection.hub_answers` is taken to hold (the readers of
one worker that died all hear "no responders" at once)."""
STALE_AFTER_PINGS = 3
"""Pings the server may leave unanswered: at the next tick with none answered, the link is taken
for dead (``ping_interval`` apart: after 3 to 4 s of silence at 1 s; a server paused 2 s is not)."""


class Connection(Lifecycle):
    """An open NATS connection; ``nc``/``js``/``jsm`` raise a clear error before ``connect()``."""

    def __init__(
        self, settings: NatsSettings, name: str, *, patient: bool = True, source: bool = False
    ) -> None:
        """``patient=False`` (one-shot commands): give up as soon as every server has refused
        the connection once, instead of trying again until ``connect_timeout``. ``source``: it
        publishes answers as their engines make them (a worker's), and its write batch waits
        longer between writes unless ``write_gap_ms`` is set (:func:`mesh.write_batch.gap_s`)."""
        self.settings = settings
        self.name = name
        self.patient = patient
        self.source = source
        self._nc: Client | None = None
        self._js: JetStreamContext | None = None
        self._write_batch: WriteBatch | None = None
        self._acks: Acks | None = None
        self._closing = False
        self._dropped = asyncio.Event()
        """Set while the link is down (from the drop to the reconnect): a wait on the server
        (:meth:`while_linked`, the drain at close) ends then."""
        self.reconnects = 0
        """Reconnects since connect()."""
        self.drops = 0
        """Times the connection dropped since connect() (not counting close()): what this
        process published or held meanwhile may be another's now (a worker's delivery handed
        back while it was cut off, see :mod:`cloud_node.orphans`)."""
        self.losses = 0
        """Reconnects plus slow-consumer drops: when this moves, messages may have been lost."""
        self.dropped_at: float | None = None
        """When the connection last dropped (``time.monotonic()``); what this process wrote
        just before may not have reached the server."""
        self._loss_listeners: set[Callable[[], None]] = set()
        self.claims: dict[str, Any] | None = None
        """The user JWT's claims when the connection has a credentials file: its permissions."""
        self.refusals = Refusals()
        """What the server refused this connection (its permissions): it says so after the
        subscription or the publish, not as its answer (:func:`mesh.stream_deleted.hear`)."""
        self.refused_subscriptions = self.refusals.subscriptions
        self.queue_watches: dict[str, Any] = {}
        """This connection's :class:`mesh.queue_watch.QueueWatch` per queue stream, made at its
        first queued request (kept here: the watch lives and goes with its connection)."""
        self.recovery = Recovery(name)
        """What a reconnect may have lost, put back until it is (see :mod:`mesh.recovery`)."""
        self.closed_for_good = asyncio.Event()
        """Set when the server ended the connection and nats-py gave up on it (it does after
        a server error such as an expired JWT's ``User Authentication Expired``, or an
        ``Authorization Violation`` after a config reload): nothing brings it back in this
        process, and a process serving on it stops so that its supervisor starts it again."""

    @property
    def nc(self) -> Client:
        if self._nc is None:
            raise RuntimeError(NOT_CONNECTED)
        return self._nc

    @property
    def write_batch(self) -> WriteBatch:
        """Where answer events that may wait a moment are published (:mod:`mesh.write_batch`)."""
        if self._write_batch is None:
            raise RuntimeError(NOT_CONNECTED)
        return self._write_batch

    def write_behind(self) -> None:
        """:meth:`WriteBatch.behind`; nothing once the connection closed (a reader's message
        may still come in the read loop while it drains)."""
        if self._write_batch is not None:
            self._write_batch.behind()

    async def publish_acked(
        self,
        subject: str,
        payload: bytes,
        *,
        stream: str | None = None,
        headers: Mapping[str, str] | None = None,
        timeout: float | None = None,
        gone: Gone | None = None,
    ) -> api.PubAck:
        """Publish to JetStream and wait for the store's ack (``request_timeout`` by default);
        the outcome and errors of nats-py's ``js.publish``, at less cost (:mod:`mesh.js_acks`;
        ``gone`` there)."""
        if self._acks is None:
            raise RuntimeError(NOT_CONNECTED)
        return await self._acks.publish(
            subject,
            payload,
            timeout=self.settings.request_timeout if timeout is None else timeout,
            stream=stream,
            headers=headers,
            gone=gone,
        )

    async def subscribed(self) -> None:
        """Until the server has every subscription made on this connection so far: a message
        another client sends after this returns finds them. Two flushes: nats-py writes a
        flush's PING at once but a SUB from its buffer a turn later, so the first PONG may
        come before the server read the SUB (a client's request right after an edge started
        then heard "no responders", about one time in 40)."""
        timeout = max(1, round(self.settings.request_timeout))
        await self.nc.flush(timeout=timeout)
        await self.nc.flush(timeout=timeout)

    def stream_gone(self, gone: Gone) -> int:
        """End now the acked publishes given ``gone`` that wait (:meth:`Acks.stream_gone`)."""
        return 0 if self._acks is None else self._acks.stream_gone(gone)

    async def flush_write_batch(self) -> None:
        """Publish what the write batch holds now (nothing to do when not connected)."""
        if self._write_batch is not None:
            await self._write_batch.flush()

    @property
    def js(self) -> JetStreamContext:
        if self._js is None:
            raise RuntimeError(NOT_CONNECTED)
        return self._js

    async def while_linked(self, work: Coroutine[Any, Any, T], timeout: float) -> T:
        """``work``'s result within ``timeout`` seconds (asyncio.TimeoutError past it), or
        nats-py's ConnectionReconnectingError as soon as the link drops meanwhile, or at once
        when it is down: what must come back over the link cannot come then. For a stop's steps
        that ask the server (a registry delete, a look for peers): they go on without it rather
        than wait out their timeout when the server dies as the node stops."""
        if not self.connected:
            work.close()
            raise nats.errors.ConnectionReconnectingError
        ended, result = await first_of(work, self._dropped, timeout)
        if not ended:
            raise nats.errors.ConnectionReconnectingError
        return result  # type: ignore[no-any-return]

    @property
    def connected(self) -> bool:
        """True while connected (not before connect(), not while reconnecting)."""
        return self._nc is not None and self._nc.is_connected

    @property
    def closed(self) -> bool:
        """True before connect() and once closed (for good: not while reconnecting)."""
        return self._nc is None or self._nc.is_closed

    def jsm(self, timeout: float | None = None) -> JetStreamManager:
        """The hub's JetStream (through ``hub_domain`` from an edge site's leaf node); each call
        waits ``timeout`` (default: ``request_timeout``)."""
        wait = self.settings.request_timeout if timeout is None else timeout
        return self.nc.jsm(timeout=wait, prefix=self.api_prefix)

    @property
    def api_prefix(self) -> str:
        """Where the hub's JetStream API answers: ``$JS.API``, or ``$JS.<hub_domain>.API``."""
        domain = self.settings.hub_domain
        return f"$JS.{domain}.API" if domain else "$JS.API"

    async def hub_answers(self, timeout: float) -> bool:
        """Whether the hub answers through this connection, for a caller about to take "no
        responders" for proof that something of the hub's is gone. Always True on a connection
        to the hub itself. Through an edge site's leaf node (``hub_domain``), the leaf says "no
        responders" to everything of the hub's while its uplink is down: then only a JetStream
        API call that gets an answer (the registry's stream, which every edge may look up)
        shows that the word was the hub's. Before, a 0.4 s uplink blip made an edge give up every
        cloud answer it relayed, as if its worker had died."""
        if not self.settings.hub_domain:
            return True
        if time.monotonic() - self._hub_answered_at < HUB_ANSWERED_S:
            return True  # one look serves every reader that heard "no responders" just now
        if self._hub_look is None or self._hub_look.done():  # else: one look at a time
            self._hub_look = asyncio.ensure_future(self._look_at_hub(timeout))
        return await asyncio.shield(self._hub_look)  # a caller's cancel is its own

    async def _look_at_hub(self, timeout: float) -> bool:
        try:
            await self.nc.request(f"{self.api_prefix}.STREAM.INFO.{NODES_STREAM}", b"", timeout)
        except (nats.errors.Error, asyncio.TimeoutError, RuntimeError):
            return False
        self._hub_answered_at = time.monotonic()
        return True

    _hub_answered_at = -float("inf")
    """When the hub last answered :meth:`hub_answers` (``time.monotonic()``)."""
    _hub_look: asyncio.Future[bool] | None = None
    """The look at the hub under way: the readers that heard "no responders" while the uplink
    is down wait on one (each sent its own before)."""

    def site_js(self) -> JetStreamContext:
        """The JetStream of the server this process is connected to (an edge site's own)."""
        return self.nc.jetstream(timeout=self.settings.request_timeout)

    def site_jsm(self) -> JetStreamManager:
        return self.nc.jsm(timeout=self.settings.request_timeout)

    def on_reconnect(self, name: str, step: Step) -> Callable[[], None]:
        """Run ``step`` (a coroutine function) after every reconnect, again and again with
        backoff until it succeeds; returns an undo. :attr:`restoring` names it meanwhile."""
        return self.recovery.add(name, step)

    @property
    def restoring(self) -> list[str]:
        """The after-reconnect steps not restored yet: while any is, the node is degraded."""
        return self.recovery.pending

    def on_loss(self, listener: Callable[[], None]) -> Callable[[], None]:
        """Call ``listener`` (plain, quick, in the event loop) whenever ``losses`` moves: a
        reader waiting for a message that may have been lost hears of it at once, not when the
        next message comes or a quiet spell ends (a lost tail has no next message). Returns
        the undo."""
        self._loss_listeners.add(listener)
        return lambda: self._loss_listeners.discard(listener)

    def _lost(self) -> None:
        self.losses += 1
        for listener in list(self._loss_listeners):
            try:
                listener()
            except Exception:  # one reader's fault must not keep the others from hearing
                log.exception("a loss listener failed", connection=self.name)

    async def connect(self) -> Connection:
        servers = self.settings.servers()
        if self.settings.creds_file:
            self.claims = check_creds_file(self.settings.creds_file)
        client = SafeClient()  # a message it cannot read is dropped, not its connection
        refused: list[str] = []
        failures: list[str] = []
        turned_away = 0
        nobody_listens = asyncio.Event()
        last_error = ""

        async def on_error(exc: Exception) -> None:
            nonlocal turned_away, last_error
            last_error = repr(exc)
            if isinstance(exc, ConnectionRefusedError) and not self.connected:
                turned_away += 1
                if not self.patient and turned_away >= len(servers):
                    nobody_listens.set()
            if isinstance(exc, nats.errors.SlowConsumerError):
                self._lost()
            self.refusals.heard(exc)
            if is_auth_error(exc):
                refused.append(str(exc))
            elif isinstance(exc, ssl.SSLError) and not self.connected:
                failures.append(tls_reason(exc))
            log.warning("nats error", connection=self.name, error=repr(exc))

        async def on_disconnected() -> None:
            if not client.is_closed:  # the link dropped (not this process closing it)
                self._dropped.set()
            if self._closing:
                log.debug("nats connection closed", connection=self.name)
            else:
                self.drops += 1
                self.dropped_at = time.monotonic()
                log.warning("nats disconnected", connection=self.name)

        async def on_closed() -> None:
            if not self._closing and self._nc is client:  # not this process's close
                log.error("nats connection closed for good", connection=self.name, error=last_error)
                self.closed_for_good.set()

        async def on_reconnected() -> None:
            self._dropped.clear()
            self.reconnects += 1
            # What the credentials allow, as nats-py read them again to reconnect (a rotated
            # file): refusals the server makes again are heard again.
            self.refusals.clear()
            if self.settings.creds_file:
                with contextlib.suppress(UnauthorizedError):
                    self.claims = check_creds_file(self.settings.creds_file)
            again = 0
            if self._acks is not None:  # before the readers' repairs: a request first
                with contextlib.suppress(nats.errors.Error):
                    again = await self._acks.again()
            self._lost()
            log.info(
                "nats reconnected",
                connection=self.name,
                server=_server_url(client),
                **({"published_again": again} if again else {}),
            )
            self.recovery.reconnected()

        try:
            connected, _ = await first_of(
                client.connect(
                    **connect_options(self.settings),
                    servers=servers,
                    name=self.name,
                    connect_timeout=max(1, round(self.settings.connect_timeout)),
                    reconnect_time_wait=self.settings.reconnect_wait,  # type: ignore[arg-type]
                    ping_interval=self.settings.ping_interval,  # type: ignore[arg-type]
                    max_outstanding_pings=STALE_AFTER_PINGS,
                    max_reconnect_attempts=self.settings.max_reconnect_attempts,
                    drain_timeout=max(1, round(self.settings.drain_timeout)),
                    error_cb=on_error,
                    disconnected_cb=on_disconnected,
                    reconnected_cb=on_reconnected,
                    closed_cb=on_closed,
                ),
                nobody_listens,
                timeout=self.settings.connect_timeout,
            )
            if not connected:
                raise ConnectionRefusedError("every server refused the connection")
        except (asyncio.TimeoutError, OSError, nats.errors.Error) as exc:
            await _close_quietly(client)
            if nobody_listens.is_set():
                raise UnavailableError(
                    f"cannot connect to NATS at {', '.join(servers)}: nothing accepts "
                    "connections there; is nats-server running? `mesh up` starts a local one"
                ) from None
            if is_auth_error(exc) or refused:
                raise UnauthorizedError(
                    f"NATS at {', '.join(servers)} refused this process's credentials "
                    f"({(refused or [str(exc)])[0]}): wrong, expired or revoked, or none were "
                    "given (MESH_NATS_CREDS_FILE)"
                ) from None
            if failures:  # the server answered, but TLS failed: say so
                raise UnavailableError(
                    f"cannot connect to NATS at {', '.join(servers)}: {failures[-1]}"
                ) from None
            raise UnavailableError(
                f"cannot connect to NATS at {', '.join(servers)} within "
                f"{self.settings.connect_timeout:g}s ({type(exc).__name__}); is nats-server "
                "running? `mesh up` starts a local one"
            ) from None
        self._nc = client
        self._write_batch = WriteBatch(
            client, gap_s(self.settings.write_gap_ms, source=self.source)
        )
        began = time.monotonic()  # the link's round trip: a slow one's acks come late
        with contextlib.suppress(asyncio.TimeoutError, nats.errors.Error):
            await client.flush(timeout=max(1, round(self.settings.connect_timeout)))
        self._acks = Acks(
            client, round_trip=time.monotonic() - began, on_leaf=bool(self.settings.hub_domain)
        )
        self._js = client.jetstream(
            timeout=self.settings.request_timeout, domain=self.settings.hub_domain
        )
        log.debug("nats connected", connection=self.name, server=_server_url(client))
        return self

    async def close(self) -> None:
        """Drain subscriptions and flush pending publishes, within the drain timeout."""
        client, self._nc, self._js = self._nc, None, None
        write_batch, self._write_batch = self._write_batch, None
        if self._acks is not None:
            self._acks.close()
        self._acks = None
        if self._hub_look is not None:
            self._hub_look.cancel()
        await self.recovery.close()
        for watch in list(self.queue_watches.values()):
            await watch.close()
        if client is None or client.is_closed:
            return
        if write_batch is not None:
            await write_batch.close()
        self._closing = True
        try:
            # Cut off, or cut off while draining, nothing more can reach the server: the close
            # goes on at once rather than waiting out the drain's timeout (6 s).
            self._dropped.clear()
            drained = False
            if client.is_connected:
                drained, _ = await first_of(
                    client.drain(), self._dropped, timeout=self.settings.drain_timeout + 1
                )
            if not drained:
                log.info("closing a connection cut off from its server", connection=self.name)
        except (asyncio.TimeoutError, nats.errors.Error) as exc:
            log.warning("nats drain incomplete", connection=self.name, error=repr(exc))
        finally:
            await _close_quietly(client)

    start = connect
    stop = close


NOBODY_AGAIN_S = 0.05
"""A subject the server says nobody listens on is asked once more this much later before that
is believed (a process moving to another server is away for a few milliseconds)."""


async def request_or_nobody(nc: Client, subject: str, data: bytes, timeout: float) -> Msg | None:
    """The reply to a request; None when the server says nobody listens on ``subject``, twice,
    ``NOBODY_AGAIN_S`` apart (the process behind it is gone, or its link is down). Any other
    failure raises, as ``nc.request`` does: no word in time proves nothing."""
    for ask in range(2):
        if ask:
            await asyncio.sleep(NOBODY_AGAIN_S)
        try:
            return await nc.request(subject, data, timeout=timeout)
        except nats.errors.NoRespondersError:
            continue
    return None


async def stop_service(conn: Connection, service: Service | None, timeout: float) -> None:
    """Stop a NATS micro service within ``timeout`` seconds. nats-py drains each of its
    subscriptions, and a drain waits for the subscription's queued messages with no limit of
    its own: one whose message task ended early (a cancelled handler) would hold a node's
    shutdown for ever. Past the limit, or as soon as the link is down (a drain's flush would
    wait for it), the node goes on stopping; the connection's close removes what is left."""
    if service is None:
        return
    try:
        await conn.while_linked(service.stop(), timeout)
    except nats.errors.ConnectionReconnectingError:
        log.info("micro service left to the connection's close: cut off from NATS")
    except (asyncio.TimeoutError, nats.errors.Error) as exc:
        log.warning("micro service not stopped cleanly", error=repr(exc))


async def _close_quietly(client: Client) -> None:
    if client.is_closed:
        return
    await _stop_reconnecting(client)
    with contextlib.suppress(asyncio.TimeoutError, nats.errors.Error, OSError):
        await asyncio.wait_for(client.close(), timeout=2)


async def _stop_reconnecting(client: Client) -> None:
    """End a reconnect attempt in progress before the close. nats-py's close cancels it and
    waits up to ``reconnect_time_wait`` (0.5 s) for it to end; a cancel that lands as the
    attempt's connect fails is lost (Python 3.11's ``wait_for`` returns the connect's error
    instead), the attempt goes on to its next wait, and the close waits all of it. Cancelled
    here again until it ends (the second cancel finds it waiting). Leans on nats-py's private
    ``_reconnection_task``; without one, nothing to do."""
    task = getattr(client, "_reconnection_task", None)
    for _ in range(5):
        if not isinstance(task, asyncio.Task) or task.done():
            return
        task.cancel()
        await asyncio.wait({task}, timeout=0.01)


def _server_url(client: Any) -> str:
    """The server a client is connected to, as a person writes it (``nats://host:port``):
    nats-py keeps it as a ``urllib`` ``ParseResult``, whose ``str`` is its repr. A user and
    password in the URL are left out."""
    url = client.connected_url
    return f"{url.scheme}://{url.hostname}:{url.port}" if url is not None else "none"
