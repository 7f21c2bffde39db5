"""Whether a worker pool serves a model: a consumer exists for it on the queue.

The edge and the SDK ask it before they queue a request, so that a model nobody serves fails
at once, typed, rather than waiting in a queue no worker reads. The answer is remembered, and
looked up again behind a request where something else can tell when it went out of date: the
edge's registry of workers, or (the SDK) JetStream's word that the consumer was deleted.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import nats.errors
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.errors import APIError, NotFoundError
from nats.js.manager import JetStreamManager

from mesh.config import StreamSettings
from mesh.logs import get_logger
from mesh.stream_deleted import consumer_deleted, stream_deleted
from protocol.subjects import consumer_name

if TYPE_CHECKING:
    from mesh.connection import Connection

log = get_logger(__name__)


async def model_is_served(
    jsm: JetStreamManager, settings: StreamSettings, model: str
) -> bool | None:
    """True when a consumer exists for ``model`` (some worker pool was deployed for it), False
    when none does, None when JetStream cannot say now (no answer in time, a leader election,
    no quorum, a dropped link): then callers let the publish decide, which fails typed if the
    queue cannot take the request. :class:`ServedModels` is how the edge and the SDK ask it."""
    try:
        await jsm.consumer_info(settings.name, consumer_name(model))
    except NotFoundError:
        return False
    except (APIError, asyncio.TimeoutError, nats.errors.Error) as exc:
        log.info("cannot tell whether a pool serves the model now", model=model, error=repr(exc))
        return None
    return True


class ServedModels:
    """Whether a worker pool serves a model: the one rule for the edge and the SDK alike.

    :func:`model_is_served`, remembered for a while: a yes for ``yes_for`` seconds (a JetStream
    API round trip per request would cost ~1 ms of every answer's time to first token), a no for
    ``no_for`` (an edge answering many clients asks once for a burst of requests naming a model
    nobody serves; the SDK passes 0: its own caller may be deploying the pool). When JetStream
    cannot tell now, the answer is yes, whatever was known before, and nothing is remembered:
    the publish decides, and fails typed if the queue cannot take the request.

    ``stale_yes`` (the edge): for a model it holds for, a yes older than ``yes_for`` still
    answers at once, and a look in the background brings it up to date. Waited for, that look
    cost each request that came more than ``yes_for`` after the last one a round trip to the hub
    before it was queued: on a site's edge, a round trip over its uplink. The edge holds it for
    the models whose workers its registry view can tell live or gone: a pool whose workers are
    gone shows none live there, and the edge answers locally at once.

    ``hear`` (the SDK, which has no registry): a stale yes answers at once for every model
    while this hears JetStream say a consumer (or the queue) was deleted on that connection;
    the word forgets the model's yes at once, and a loss on the connection (a reconnect, dropped
    messages: a word may have been missed) forgets every yes. Subscribed at the first ask;
    :meth:`close` ends it."""

    def __init__(
        self,
        jsm: Callable[[], JetStreamManager],
        settings: StreamSettings,
        *,
        yes_for: float = 30.0,
        no_for: float = 3.0,
        stale_yes: Callable[[str], bool] = lambda _model: False,
        hear: Connection | None = None,
    ) -> None:
        self._jsm = jsm
        self._settings = settings
        self._for = {True: yes_for, False: no_for}
        self._stale_yes = stale_yes
        self._hear = hear
        self._heard: list[Subscription] = []
        """The deletion words subscribed to (empty: none heard, or not asked to)."""
        self._undo_loss: Callable[[], None] | None = None
        self._known: dict[str, tuple[bool, float]] = {}
        self._looking: dict[str, asyncio.Task[bool]] = {}
        """The background looks under way, by model."""

    def forget(self, model: str) -> None:
        """Ask JetStream again next time (what is known of ``model`` is out of date)."""
        self._known.pop(model, None)

    async def __call__(self, model: str) -> bool:
        if self._hear is not None:
            await self._listen(self._hear)
        now = time.monotonic()
        known = self._known.get(model)
        if known is not None and known[1] > now:
            return known[0]
        if known is not None and known[0] and (self._heard or self._stale_yes(model)):
            if model not in self._looking:
                look = asyncio.get_running_loop().create_task(self._look(model))
                self._looking[model] = look
                look.add_done_callback(functools.partial(self._looked, model))
            return True
        return await self._look(model)

    async def _listen(self, conn: Connection) -> None:
        self._hear = None
        name = self._settings.name
        self._undo_loss = conn.on_loss(self._known.clear)
        try:
            for subject in (consumer_deleted(name, "*"), stream_deleted(name)):
                self._heard.append(await conn.nc.subscribe(subject, cb=self._deleted))
        except (nats.errors.Error, RuntimeError) as exc:  # a stale yes is looked up, waited for
            log.warning("cannot hear a pool's consumer deleted", error=repr(exc))
            await self.close()

    async def _deleted(self, msg: Msg) -> None:
        if msg.subject == stream_deleted(self._settings.name):
            self._known.clear()
            return
        gone = msg.subject.rpartition(".")[2]
        for model in [m for m in self._known if consumer_name(m) == gone]:
            del self._known[model]

    async def close(self) -> None:
        """Stop hearing deletions (the SDK's connection stays with its owner)."""
        heard, self._heard = self._heard, []
        if self._undo_loss is not None:
            self._undo_loss()
            self._undo_loss = None
        for sub in heard:
            with contextlib.suppress(nats.errors.Error, RuntimeError):
                await sub.unsubscribe()

    def _looked(self, model: str, look: asyncio.Task[bool]) -> None:
        del self._looking[model]
        failed = None if look.cancelled() else look.exception()
        if failed is not None:  # the next request asks again
            log.info("cannot tell whether a pool serves the model now", error=repr(failed))

    async def _look(self, model: str) -> bool:
        served = await model_is_served(self._jsm(), self._settings, model)
        if served is None:
            return True
        if self._for[served] > 0:
            self._known[model] = (served, time.monotonic() + self._for[served])
        else:
            self._known.pop(model, None)  # a stale yes must not stand for it
        return served
