"""The edge's one rule for whether the cloud serves a model, asked two ways:

- :meth:`CloudModels.deployed`: a worker pool was deployed for the model (its consumer exists):
  the mesh knows the model. :class:`mesh.provision.ServedModels` answers, the rule the SDK
  follows too (a yes remembered 30 s, a no 3 s; when JetStream cannot tell, yes: the publish
  decides). A request naming a model nobody deployed is ``unknown_model``.
- :meth:`CloudModels.live`: the registry shows a live worker serving it (None: it cannot tell,
  not yet, or not for a model outside the edge's pool). The edge's readiness says "cloud
  reachable" by it.

:meth:`CloudModels.cannot_serve` puts the two together for an escalation: the cloud cannot take
a request for a model without a pool, nor for one the registry shows no live worker for.

The registry learns of a worker killed outright only when its entry ages out (``node_ttl``, 3 s):
meanwhile the edge would queue for a dead fleet and wait. So while a request waits unstarted,
:meth:`CloudModels.ask_workers` asks each worker the registry shows for its model whether it is
there (``mesh.v1.worker.<node>.alive...``, at most one round a second per model). A dead
worker's subscriptions are gone, and the server itself answers "no responders": the view forgets
it at once (:meth:`mesh.node_view.NodeView.gone`), and with no worker left the edge answers
locally. A worker that is merely busy answers, or says nothing in time: nothing is concluded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from typing import Protocol

import nats.errors

from mesh.config import StreamSettings
from mesh.connection import Connection, request_or_nobody
from mesh.logs import get_logger
from mesh.queue import ALIVE_WAIT_S
from mesh.registry import NodeInfo
from mesh.served_models import ServedModels
from protocol.subjects import model_token, worker_alive_subject

log = get_logger(__name__)
ASK_EVERY_S = 1.0
"""The least time between two rounds of questions to a model's workers (see the module)."""
RECHECK_EVERY_S = 0.1
"""On an edge site's leaf: the least time between two rounds of questions a request or a
readiness probe waits on (:meth:`CloudModels.live_now`)."""
RECHECK_WAIT_S = 0.05
"""How long a request or a readiness probe waits on such a round; it goes on beside them, for
the next one, when slower (a hub far away, or an uplink gone silent)."""
UNSURE_S = 2 * ASK_EVERY_S
"""How long a pool's round that learnt nothing keeps the next rounds in the background."""
PROBE_ID = "anyone-there"
"""The request id the questions name: no answer has it, so a worker only says it is there."""


class RegistryView(Protocol):
    """What the edge reads of the node registry (:class:`mesh.node_view.NodeView`)."""

    def live(self, role: str = "worker") -> list[NodeInfo]: ...

    def askable(self) -> list[NodeInfo]: ...

    def aged(self, model: str) -> list[str]: ...

    @property
    def quiet(self) -> bool: ...

    @property
    def silent(self) -> bool: ...

    def heard_from(self, node_id: str) -> None: ...

    def no_answer(self, node_id: str) -> None: ...

    def follows(self, model: str) -> bool: ...

    def serves(self, model: str) -> bool | None: ...

    def is_live(self, node_id: str, model: str | None = None) -> bool | None: ...

    def gone(self, node_id: str) -> None: ...


class CloudModels:
    def __init__(
        self, conn: Connection, stream: StreamSettings, nodes: RegistryView, scope: str
    ) -> None:
        self._conn = conn
        self._scope = scope
        # A stale yes stands while a look brings it up to date, for a model whose workers the
        # registry can tell live or gone (no live one: the edge answers locally at once).
        self._deployed = ServedModels(
            conn.jsm, stream, stale_yes=lambda model: nodes.serves(model) is not None
        )
        self._nodes = nodes
        self._seen: set[str] = set()
        """The pools (subject tokens) seen serving (a bounded set, as the edge's pools: names
        that differ only where a token does not, "org/m" and "org.m", are one pool)."""
        self._asked: dict[str, float] = {}
        """When each pool's workers were last asked whether they are there."""
        self._asking: set[asyncio.Task[bool]] = set()
        self._rechecks: dict[str, tuple[asyncio.Task[bool], float]] = {}
        """Each pool's last round of :meth:`live_now`, and when it began."""
        self._unsure: dict[str, float] = {}
        """The pools whose last round learnt nothing, and when it ended (see :meth:`_recheck`):
        the mark holds ``UNSURE_S``, renewed by each such round, so that it ends with its
        cause (a worker that stopped hanging is live again, and no round runs to clear it)."""

    async def deployed(self, model: str) -> bool:
        """Whether a worker pool was deployed for ``model`` (yes when JetStream cannot tell).

        A no while the registry shows a live worker of the pool is the pool's state lost under
        it (its consumer deleted, a hub restarted on an empty store), which that worker puts
        back within a moment: yes, and the no is not remembered. Remembered, it kept every
        request for the pool off the cloud for 3 s after the worker had put it back. While the
        registry cannot tell for a pool it follows (for a while after a reconnect), a no is not
        remembered either, and that pool, seen before, is taken to be on its way back: yes.
        Remembered, the no kept the pool off the cloud for 2.2 s after its worker had put it
        back, and a request naming it got ``unknown_model``."""
        if await self._deployed(model):
            self._seen.add(model_token(model))
            return True
        live = self.live(model)
        if live is True or (live is None and self._nodes.follows(model)):
            self._deployed.forget(model)
            return live is True or model_token(model) in self._seen
        return False

    def live(self, model: str) -> bool | None:
        """Whether the registry shows a live worker serving ``model``; None: it cannot tell.
        A registry silent as a whole cannot tell: its workers are asked then (in the
        background, at most once a second), and those the server says nobody listens for are
        gone, so that a fleet that died says so within a round, whoever asks (a request, a
        readiness probe). So are they while the view cannot tell (for a ``node_ttl`` after a
        reconnect it trusts only what it heard since): one that answers is there. Before, an
        edge said "cannot tell" after every blip of its link until the workers' next
        heartbeats, a whole heartbeat of ``degraded`` readiness (review S27a)."""
        serves = self._nodes.serves(model)
        if (serves is None and self._nodes.follows(model)) or (
            serves is False and self._nodes.quiet
        ):
            self.ask_workers(model)
        return serves

    async def live_now(self, model: str) -> bool | None:
        """:meth:`live`, but where the view shows no live worker for ``model`` from an edge
        site's leaf, the workers it knew are asked first (one round each ``RECHECK_EVERY_S`` at
        most, waited on ``RECHECK_WAIT_S``). There the view never goes quiet, and workers aged
        out while the uplink was down came back only with their next heartbeats: the site
        answered locally for up to a heartbeat after its uplink was back (review S27d). While
        the uplink is down, the leaf itself says "no responders" at once."""
        serves = self.live(model)
        if serves is False and self._conn.settings.hub_domain:
            return await self._recheck(model)
        return serves

    async def _recheck(self, model: str) -> bool | None:
        """One round of :meth:`live_now`. A round that learnt nothing (no answer in time: a
        worker hung, an uplink gone silent) is not waited on again: the next goes in the
        background, ``ASK_EVERY_S`` after it, so that no answer given locally meanwhile waits."""
        token, now = model_token(model), time.monotonic()
        task, began = self._rechecks.get(token, (None, -ASK_EVERY_S))
        undecided = now - self._unsure.get(token, -math.inf) < UNSURE_S
        every = ASK_EVERY_S if undecided else RECHECK_EVERY_S
        if (task is None or task.done()) and now - began >= every:
            nodes = self._nodes.aged(model)
            if not nodes or not self._conn.connected:
                return False
            round_ = self._round(token, nodes)
            task = asyncio.get_running_loop().create_task(round_, name="recheck")
            self._asking.add(task)
            task.add_done_callback(self._asking.discard)
            self._rechecks[token] = (task, now)
        if task is not None and not task.done() and not undecided:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(task), RECHECK_WAIT_S)
        return self._nodes.serves(model)

    async def _round(self, token: str, nodes: list[str]) -> bool:
        """Ask ``nodes`` whether they are there, once the hub answers at all (while the uplink
        is down the leaf refuses that at once: nothing to ask); whether the round learnt what
        it asked (False: a question went unanswered in time, and the pool's rounds are not
        waited on until one learns again)."""
        began = time.monotonic()
        if await self._conn.hub_answers(ALIVE_WAIT_S):
            learnt = await self._ask(nodes)
        else:  # refused at once (the uplink down), or no word in time (a silent uplink)
            learnt = time.monotonic() - began < ALIVE_WAIT_S
        if learnt:
            self._unsure.pop(token, None)
        else:
            self._unsure[token] = time.monotonic()
        return learnt

    async def cannot_serve(self, model: str) -> tuple[str, str] | None:
        """Why the cloud cannot take a request for ``model`` now, and a word for it (``no_pool``,
        ``no_worker``); None when it may."""
        if not await self.deployed(model):
            return f"no worker pool serves {model!r}", "no_pool"
        live = self.live(model)
        if live is False and self._conn.settings.hub_domain:
            live = await self._recheck(model)  # see live_now
        return _no_worker(model) if live is False else None

    def no_live_worker(self, model: str) -> tuple[str, str] | None:
        """``no_worker`` when the registry shows no live worker serving ``model`` (only then:
        not while it cannot tell)."""
        return _no_worker(model) if self.live(model) is False else None

    def ask_workers(self, model: str) -> None:
        """Ask the workers the registry shows serving ``model`` whether they are there, in the
        background, unless a round for it began less than ``ASK_EVERY_S`` ago; those the server
        says nobody listens for are gone from the view."""
        now, token = time.monotonic(), model_token(model)
        if now - self._asked.get(token, -ASK_EVERY_S) < ASK_EVERY_S or not self._conn.connected:
            return
        nodes = [i.node_id for i in self._nodes.askable() if token in map(model_token, i.models)]
        if not nodes:
            return
        self._asked[token] = now
        task = asyncio.get_running_loop().create_task(self._ask(nodes), name="ask-workers")
        self._asking.add(task)
        task.add_done_callback(self._asking.discard)

    async def _ask(self, nodes: list[str]) -> bool:
        """Whether each of ``nodes`` is there; whether every one said (or the server did)."""
        gone = await asyncio.gather(*(self._is_gone(node) for node in nodes))
        for node, is_gone in zip(nodes, gone, strict=True):
            if is_gone:
                log.warning("a worker the registry shows is gone", worker=node)
                self._nodes.gone(node)
        return None not in gone

    async def _is_gone(self, node: str) -> bool | None:
        """True only on the server's word, twice, that nobody listens for ``node``, or on the
        worker's own that it is stopping. A worker that answers otherwise is there: the view
        hears from it, as from a heartbeat (its own may not land while the registry refuses
        writes). None: no answer in time."""
        subject = worker_alive_subject(node, self._scope, PROBE_ID)
        try:
            reply = await request_or_nobody(self._conn.nc, subject, b"", ALIVE_WAIT_S)
            if reply is not None:
                said = _said(reply.data)
                if said.get("stopping") is True:  # there, and taking no more work
                    return True
                if said.get("down") is not True:  # its engine down: there, serving nothing
                    self._nodes.heard_from(node)
                return False
            return await self._conn.hub_answers(ALIVE_WAIT_S)  # not the uplink's word
        except (nats.errors.TimeoutError, asyncio.TimeoutError):
            self._nodes.no_answer(node)  # busy or standing still: proven only if the registry works
            return None
        except nats.errors.Error:
            return False  # our own link is down: nothing proven

    async def close(self) -> None:
        for task in list(self._asking):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def _no_worker(model: str) -> tuple[str, str]:
    return f"no live worker serves {model!r}", "no_worker"


def _said(word: bytes) -> dict[str, object]:
    """A worker's answer to "are you there?" (``stopping``, ``down``: its engine is)."""
    try:
        said = json.loads(word)
    except ValueError:
        return {}
    return said if isinstance(said, dict) else {}
