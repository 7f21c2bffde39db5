"""Whether a worker pool serves a model: a consumer exists for it on the queue.

The edge and the SDK ask it before they queue a request, so that a model nobody serves fails
at once, typed, rather than waiting in a queue no worker reads. The answer is remembered, and
looked up again behind a request where something else can tell when it went out of date: the
edge's registry of workers, or (the SDK) JetStream's word that the consumer was deleted.
"""

from __future__ import annotations

import asyncio
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
from mesh.stream_deleted import consumer_deleted, listen, models_named, unlisten
from mesh.tasks import cancel_and_wait
from protocol.errors import UnauthorizedError
from protocol.subjects import consumer_name

if TYPE_CHECKING:
    from mesh.connection import Connection

log = get_logger(__name__)


LOOK_S = 1.0
"""The longest wait for JetStream's word on a model (it answers in milliseconds): past it, or
when the link drops meanwhile, it cannot say now, and the publish decides. A look asked into a
link that dropped or went silent held the request 5 s before it was queued."""


async def model_is_served(
    jsm: JetStreamManager,
    settings: StreamSettings,
    model: str,
    conn: Connection | None = None,
) -> bool | None:
    """True when a consumer exists for ``model`` (some worker pool was deployed for it), False
    when none does, None when JetStream cannot say now (no answer within :data:`LOOK_S`, a
    leader election, no quorum, a dropped link: ``conn``'s drop ends the look at once): then
    callers let the publish decide, which fails typed if the queue cannot take the request.
    :class:`ServedModels` is how the edge and the SDK ask it."""
    look = jsm.consumer_info(settings.name, consumer_name(model), timeout=LOOK_S)
    try:
        if conn is None:
            await look
        else:  # credentials that may not look: the server's refusal ends it at once
            asked = f"{conn.api_prefix}.CONSUMER.INFO.{settings.name}.{consumer_name(model)}"
            with conn.refusals.until_refused(asked):
                await conn.while_linked(look, LOOK_S + 1)
    except NotFoundError:
        return False
    except (APIError, asyncio.TimeoutError, nats.errors.Error, UnauthorizedError) as exc:
        log.info("cannot tell whether a pool serves the model now", model=model, error=repr(exc))
        return None
    return True


KNOWN_MAX = 1000
"""The most models :class:`ServedModels` remembers an answer for."""


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
    once the server has taken this one's subscription to JetStream's word that a consumer of the
    queue was deleted (a deleted queue deletes its consumers, each with its word). The word
    forgets the model's yes at once, a loss on the connection (a reconnect, dropped messages: a
    word may have been missed) forgets every yes, and a look under way across either is not
    remembered. Subscribed at the first ask, in the background; credentials that may not hear
    it leave the stale yes waited for, as before. :meth:`close` ends it."""

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
        self._conn = hear
        self._listening: asyncio.Task[None] | None = None
        self._heard: Subscription | None = None
        """The word's subscription, once the server took it."""
        self._undo_loss: Callable[[], None] | None = None
        self._generation = 0
        """Moved by every word and loss: a look under way across one is out of date."""
        self._known: dict[str, tuple[bool, float, bool]] = {}
        """By model: the answer, until when it holds, and whether the word was heard from
        before its look began (only such a yes may answer stale: a deletion before the server
        took the subscription was never heard)."""
        self._looking: dict[str, asyncio.Task[bool]] = {}
        """The background looks under way, by model."""

    def forget(self, model: str) -> None:
        """Ask JetStream again next time (what is known of ``model`` is out of date)."""
        self._known.pop(model, None)

    async def __call__(self, model: str) -> bool:
        if self._conn is not None and self._listening is None:
            self._listening = asyncio.get_running_loop().create_task(self._listen(self._conn))
        now = time.monotonic()
        known = self._known.get(model)
        if known is not None and known[1] > now:
            return known[0]
        if known is not None and known[0] and (self._hearing(known) or self._stale_yes(model)):
            if model not in self._looking:
                look = asyncio.get_running_loop().create_task(self._look(model))
                self._looking[model] = look
                look.add_done_callback(functools.partial(self._looked, model))
            return True
        return await self._look(model)

    async def _listen(self, conn: Connection) -> None:
        if self._undo_loss is None:
            self._undo_loss = conn.on_loss(self._forget_all)
        subject = consumer_deleted(self._settings.name, "*")
        self._heard, again = await listen(conn, subject, self._word, "a pool's consumer deleted")
        if again:
            self._listening = None  # the next ask tries again

    def _hearing(self, known: tuple[bool, float, bool]) -> bool:
        """Whether the word that would have forgotten ``known`` was sure to be heard."""
        if self._heard is None or not known[2] or self._conn is None:
            return False
        return self._heard.subject.lower() not in self._conn.refused_subscriptions

    def _forget_all(self) -> None:
        self._generation += 1
        self._known.clear()
        if self._heard is None and self._listening is not None and self._listening.done():
            self._listening = None  # refused before: the next ask tries again (new rights)

    async def _word(self, msg: Msg) -> None:
        self._generation += 1
        for model in models_named(msg, self._known):
            del self._known[model]

    async def close(self) -> None:
        """Stop hearing deletions and looking (the SDK's connection stays with its owner)."""
        listening, self._listening = self._listening, None
        heard, self._heard = self._heard, None
        if self._undo_loss is not None:
            self._undo_loss()
            self._undo_loss = None
        await cancel_and_wait(list(self._looking.values()))
        await unlisten(listening, heard)

    def _prune(self) -> None:
        """Room for one more answer: the noes that have run out go, then the oldest answers.
        Clients name the models: one naming a new one each request grew this for ever."""
        now = time.monotonic()
        for model, (served, until, _heard) in list(self._known.items()):
            if not served and until <= now:
                del self._known[model]
        while len(self._known) >= KNOWN_MAX:
            del self._known[next(iter(self._known))]

    def _looked(self, model: str, look: asyncio.Task[bool]) -> None:
        self._looking.pop(model, None)
        failed = None if look.cancelled() else look.exception()
        if failed is not None:  # the next request asks again
            log.info("cannot tell whether a pool serves the model now", error=repr(failed))

    async def _look(self, model: str) -> bool:
        generation, heard = self._generation, self._heard is not None
        served = await model_is_served(self._jsm(), self._settings, model, self._conn)
        if served is None:
            return True
        if generation != self._generation:  # a word or a loss came meanwhile: not for later
            return served
        if self._for[served] > 0:
            self._known.pop(model, None)  # to the end: the oldest go first (_prune)
            if len(self._known) >= KNOWN_MAX:
                self._prune()
            self._known[model] = (served, time.monotonic() + self._for[served], heard)
        else:
            self._known.pop(model, None)  # a stale yes must not stand for it
        return served
