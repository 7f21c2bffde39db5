"""The Python SDK (MeshClient) under concurrency and caller-side cancellation (review S18a).

Real nats-server; a real edge node and a real worker on the deterministic backend. The tests
whose comment begins "Before the fix" failed on the code before it (the comment says what
happened then); the others are guards: they passed there too and keep what was found sound.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from cloud_node.worker import Worker
from edge_node.node import EdgeNode
from edge_node.router import HeuristicRouter
from mesh.backends.deterministic import DeterministicBackend
from mesh.client import MeshClient, Via
from mesh.config import MeshSettings, ModelSettings
from mesh.connection import Connection
from mesh.testing.chaos import expected_text, prompt
from protocol.errors import DeadlineExceededError, MeshError
from protocol.messages import EndEvent, RestartEvent, TokenEvent
from tests.helpers import eventually, holds, serving, still_running, tasks_now


def backend(slots: int = 256, delay_ms: int = 10, prefill_ms: int = 0) -> DeterministicBackend:
    return DeterministicBackend(
        ModelSettings(
            backend="deterministic",
            slots=slots,
            token_delay_ms=delay_ms,
            prefill_delay_ms=prefill_ms,
            faults=False,
        )
    )


async def read_all(client: MeshClient, tag: str, n: int, **kw: Any) -> str:
    text = ""
    async for event in client.stream(prompt(tag), max_tokens=n, **kw):
        if isinstance(event, RestartEvent):
            text = ""
        elif isinstance(event, TokenEvent):
            text += event.text
        elif isinstance(event, EndEvent):
            return text
    raise AssertionError("no end")


@pytest.mark.parametrize("via", ["edge", "cloud"])
async def test_many_concurrent_streams_each_get_their_own_answer(
    settings: MeshSettings, conn: Connection, via: Via
) -> None:
    """Guard (passes): 200 concurrent streams on one client, each its own exact answer, every
    event under its own id."""
    settings.edge.max_concurrent = 256
    engine = backend(delay_ms=10)
    node, kw = serving(via, settings, conn, engine)
    async with (
        node,
        MeshClient(settings=settings, first_event_timeout=10, idle_timeout=10) as client,
    ):

        async def one(i: int) -> str:
            text, rid = "", f"m{i}"
            async for event in client.stream(
                prompt(rid), max_tokens=20, via=via, request_id=rid, **kw
            ):
                assert event.id == rid, (rid, event)
                if isinstance(event, RestartEvent):
                    text = ""
                elif isinstance(event, TokenEvent):
                    text += event.text
                elif isinstance(event, EndEvent):
                    return text
            return "no end"

        got = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(200))), 30)
        assert got == [expected_text(f"m{i}", 20) for i in range(200)]


async def cancel_some(client: MeshClient, n: int, via: Via, **kw: Any) -> dict[str, Any]:
    """n streams; a third of them left mid-stream (task.cancel, break, aclose), round robin."""
    rng = random.Random(7)
    ways = ["cancel", "break", "aclose"]
    leave = {i: ways[k % 3] for k, i in enumerate(rng.sample(range(n), n // 3))}
    results: dict[int, Any] = {}
    got_token: dict[int, asyncio.Event] = {i: asyncio.Event() for i in range(n)}

    async def one(i: int) -> None:
        tag = f"k{i}"
        text = ""
        how = leave.get(i)
        gen = client.stream(prompt(tag), max_tokens=40, via=via, **kw)
        try:
            async for event in gen:
                if isinstance(event, TokenEvent):
                    text += event.text
                    got_token[i].set()
                    if how == "break" and len(text.split()) >= 3:
                        break
                    if how == "aclose" and len(text.split()) >= 3:
                        await gen.aclose()
                        results[i] = "closed"
                        return
                elif isinstance(event, RestartEvent):
                    text = ""
                elif isinstance(event, EndEvent):
                    results[i] = text
                    return
            results[i] = "left"
        except MeshError as err:
            results[i] = err

    tasks = {i: asyncio.ensure_future(one(i)) for i in range(n)}
    for i, how in leave.items():
        if how == "cancel":
            await asyncio.wait_for(got_token[i].wait(), 10)
            tasks[i].cancel()
    await asyncio.wait_for(asyncio.gather(*tasks.values(), return_exceptions=True), 20)
    return {"leave": leave, "results": results, "tasks": tasks}


@pytest.mark.parametrize("via", ["edge", "cloud"])
async def test_cancelling_a_third_of_many_streams_leaves_the_rest_whole_and_frees_all(
    settings: MeshSettings, conn: Connection, via: Via
) -> None:
    """Guard: 90 streams on one client, 30 left mid-stream three ways; the others are exact,
    the generator stops for the left ones, and nothing stays behind on the client."""
    settings.edge.max_concurrent = 256
    engine = backend(delay_ms=30)
    node, kw = serving(via, settings, conn, engine)
    async with (
        node,
        MeshClient(settings=settings, first_event_timeout=10, idle_timeout=10) as client,
    ):
        await read_all(client, "warm", 2, via=via, **kw)  # inbox subscription, served models
        before_tasks = await tasks_now(client.conn)
        subs_before = len(client.conn.nc._subs)
        out = await cancel_some(client, 90, via, **kw)
        leave, results = out["leave"], out["results"]
        for i in range(90):
            if i in leave:
                continue
            assert results[i] == expected_text(f"k{i}", 40), (i, results.get(i))
        for i, how in leave.items():
            if how == "cancel":
                assert out["tasks"][i].cancelled(), (i, results.get(i))
        # the engine stops generating the left ones: each counted cancelled where it ran
        await eventually(lambda: holds(engine._busy == 0), timeout=3, what="engine idle")
        stats: Any = node.stats
        cancelled = stats.cancelled if via == "cloud" else stats.snapshot().get("cancelled")
        assert cancelled == 30, (cancelled, stats)
        await eventually(
            lambda: holds(len(client.conn.nc._subs) == subs_before), timeout=3, what="subs back"
        )
        await eventually(lambda: holds(not still_running(before_tasks)), timeout=3, what="tasks")
        if client._inboxes is not None:
            assert len(client._inboxes._handlers) == 0
        assert client._tries._open == {}


# -- close while streams are in flight -----------------------------------------------------
# Before the fix (typed): MeshClient.close() set Connection._nc to None with calls in flight;
# every stream still reading then touched `self.conn.nc` (AnswerReader.next's is_closed check,
# the edge repair's request) and got a raw RuntimeError("not connected"), not a MeshError.
@pytest.mark.parametrize("via", ["edge", "cloud"])
async def test_close_with_streams_in_flight_ends_each_in_one_typed_error(
    settings: MeshSettings, conn: Connection, via: Via
) -> None:
    settings.edge.max_concurrent = 256
    engine = backend(delay_ms=50)
    node, kw = serving(via, settings, conn, engine)
    outcomes: dict[int, Any] = {}
    started = [asyncio.Event() for _ in range(30)]

    async with node:
        client = await MeshClient(
            settings=settings, first_event_timeout=10, idle_timeout=10
        ).connect()

        async def one(i: int) -> None:
            text = ""
            try:
                async for event in client.stream(prompt(f"z{i}"), max_tokens=100, via=via, **kw):
                    if isinstance(event, TokenEvent):
                        text += event.text
                        started[i].set()
                    elif isinstance(event, EndEvent):
                        outcomes[i] = ("end", text)
                        return
                outcomes[i] = ("no end", text)
            except BaseException as exc:  # what reaches the caller, whatever it is
                outcomes[i] = ("raised", exc)

        tasks = [asyncio.ensure_future(one(i)) for i in range(30)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 10)
        began = time.monotonic()
        await asyncio.wait_for(client.close(), 5)
        closed_in = time.monotonic() - began
        _done, pending = await asyncio.wait(tasks, timeout=5)
        for task in pending:
            task.cancel()
        assert not pending, f"{len(pending)} streams still hang 5 s after close()"
    assert closed_in < 3.0, f"close took {closed_in:.1f}s"
    kinds = {
        i: (o[0], type(o[1]).__name__)
        for i, o in outcomes.items()
        if o[0] != "raised" or not isinstance(o[1], MeshError)
    }
    assert not kinds, f"not one typed error each: {sorted(kinds.items())[:5]}"


# Before the fix (heal/resource): close() with answers in flight did not withdraw them. The
# cloud withdraw ran after the connection was gone (RuntimeError in CloudCall._cancel_at), and
# the edge's cancel went out on a closed connection: the engine generated every abandoned answer
# to its end (here 30 answers x 100 tokens x 50 ms: 5 s of 30 slots for nobody).
@pytest.mark.parametrize("via", ["edge", "cloud"])
async def test_close_with_streams_in_flight_withdraws_them(
    settings: MeshSettings, conn: Connection, via: Via
) -> None:
    settings.edge.max_concurrent = 256
    engine = backend(delay_ms=50)
    node, kw = serving(via, settings, conn, engine)
    started = [asyncio.Event() for _ in range(30)]
    async with node:
        client = await MeshClient(
            settings=settings, first_event_timeout=10, idle_timeout=10
        ).connect()

        async def one(i: int) -> None:
            async for event in client.stream(prompt(f"w{i}"), max_tokens=100, via=via, **kw):
                if isinstance(event, TokenEvent):
                    started[i].set()

        tasks = [asyncio.ensure_future(one(i)) for i in range(30)]
        try:
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 10)
            assert engine._busy == 30
            await asyncio.wait_for(client.close(), 5)
            await asyncio.wait(tasks, timeout=5)
            # nobody reads them any more: the engine stops well before their natural end (5 s)
            await eventually(
                lambda: holds(engine._busy == 0),
                timeout=2,
                what=f"the engine to stop the abandoned answers (busy {engine._busy})",
            )
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


# Before the fix (typed): a call on a client that was closed raised a raw RuntimeError ("not
# connected to NATS: call connect() ...") from Connection.nc, not a MeshError: stream() via
# the edge and via the cloud, complete(), answer().
@pytest.mark.parametrize("call", ["edge", "cloud", "complete", "answer"])
async def test_a_call_after_close_is_a_typed_error(
    settings: MeshSettings, conn: Connection, call: str
) -> None:
    engine = backend()
    async with EdgeNode(settings, conn, engine, HeuristicRouter()), Worker(settings, conn, engine):
        client = MeshClient(settings=settings, first_event_timeout=5, idle_timeout=5)
        async with client:
            await read_all(client, "warm", 2, route="local")
        kw: dict[str, Any] = {"route": "local"} if call == "edge" else {}
        work: Callable[[], Awaitable[object]] = {
            "answer": lambda: client.answer("some-id"),
            "complete": lambda: client.complete(prompt("after"), max_tokens=3, route="local"),
            "edge": lambda: read_all(client, "after", 3, via="edge", **kw),
            "cloud": lambda: read_all(client, "after", 3, via="cloud", **kw),
        }[call]
        began = time.monotonic()
        with pytest.raises(MeshError):
            await asyncio.wait_for(work(), 8)
        assert time.monotonic() - began < 2


@pytest.mark.parametrize("via", ["edge", "cloud"])
async def test_the_same_id_from_two_concurrent_calls_one_leaving(
    settings: MeshSettings, conn: Connection, via: Via
) -> None:
    """Guard: two calls under one request id on one client: both get the one answer; one that
    leaves early (break) does not cut the other short."""
    engine = backend(delay_ms=30)
    node, kw = serving(via, settings, conn, engine)
    async with (
        node,
        MeshClient(settings=settings, first_event_timeout=10, idle_timeout=10) as client,
    ):
        both = await asyncio.wait_for(
            asyncio.gather(
                read_all(client, "same", 20, via=via, request_id="same-1", **kw),
                read_all(client, "same", 20, via=via, request_id="same-1", **kw),
            ),
            10,
        )
        assert list(both) == [expected_text("same", 20)] * 2
        assert engine.started == 1

        async def leave_early() -> None:
            async for event in client.stream(
                prompt("two"), max_tokens=30, via=via, request_id="same-2", **kw
            ):
                if isinstance(event, TokenEvent):
                    break

        full, _ = await asyncio.wait_for(
            asyncio.gather(
                read_all(client, "two", 30, via=via, request_id="same-2", **kw), leave_early()
            ),
            10,
        )
        assert full == expected_text("two", 30)
        # the one that leaves asked first (the other joined it)
        _, full = await asyncio.wait_for(
            asyncio.gather(
                leave_early3(client, via, kw),
                read_all(client, "three", 30, via=via, request_id="same-3", **kw),
            ),
            10,
        )
        assert full == expected_text("three", 30)


async def leave_early3(client: MeshClient, via: Via, kw: dict[str, Any]) -> None:
    async for event in client.stream(
        prompt("three"), max_tokens=30, via=via, request_id="same-3", **kw
    ):
        if isinstance(event, TokenEvent):
            break


@pytest.mark.parametrize("via", ["edge", "cloud"])
async def test_two_calls_of_one_id_both_cancelled_withdraw_it(
    settings: MeshSettings, conn: Connection, via: Via
) -> None:
    """Guard: two calls under one id, both cancelled in the same loop turn: the request is
    withdrawn (one of them sees itself alone, TryIds.alone), the engine stops."""
    engine = backend(delay_ms=50)
    node, kw = serving(via, settings, conn, engine)
    async with (
        node,
        MeshClient(settings=settings, first_event_timeout=10, idle_timeout=10) as client,
    ):
        got = [asyncio.Event(), asyncio.Event()]

        async def one(k: int) -> None:
            async for event in client.stream(
                prompt("both"), max_tokens=100, via=via, request_id="both-1", **kw
            ):
                if isinstance(event, TokenEvent):
                    got[k].set()

        tasks = [asyncio.ensure_future(one(0)), asyncio.ensure_future(one(1))]
        await asyncio.wait_for(asyncio.gather(got[0].wait(), got[1].wait()), 10)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await eventually(
            lambda: holds(engine._busy == 0), timeout=2, what="the engine to stop the answer"
        )
        assert engine.started == 1
        assert client._tries._open == {}


@pytest.mark.parametrize("via", ["edge", "cloud"])
async def test_a_call_whose_deadline_is_past_is_never_started(
    settings: MeshSettings, conn: Connection, via: Via
) -> None:
    """A deadline already past: ``deadline_exceeded`` at once, the request never started."""
    engine = backend()
    node, kw = serving(via, settings, conn, engine)
    async with node, MeshClient(settings=settings, first_event_timeout=5, idle_timeout=5) as client:
        await read_all(client, "warm", 2, via=via, **kw)
        for past in (time.time() - 5, time.time()):
            began = time.monotonic()
            with pytest.raises(DeadlineExceededError):
                await client.complete(prompt("late"), max_tokens=5, via=via, deadline=past, **kw)
            assert time.monotonic() - began < 0.5
        await asyncio.sleep(0.3)  # anything queued or sent would have started by now
        assert engine.started == 1


@pytest.mark.parametrize("via", ["edge", "cloud"])
async def test_a_whole_answer_call_cancelled_midway_withdraws(
    settings: MeshSettings, conn: Connection, via: Via
) -> None:
    """Guard: complete() cancelled while tokens flow: the engine stops, nothing stays behind,
    and the same id asked again is answered whole."""
    engine = backend(delay_ms=40)
    node, kw = serving(via, settings, conn, engine)
    async with node, MeshClient(settings=settings, first_event_timeout=5, idle_timeout=5) as client:
        await read_all(client, "warm", 2, via=via, **kw)
        before = await tasks_now(client.conn)
        call = asyncio.ensure_future(
            client.complete(prompt("whole"), max_tokens=100, via=via, request_id="whole-1", **kw)
        )
        await eventually(lambda: holds(engine._busy == 1), what="under way")
        await asyncio.sleep(0.2)  # some tokens in
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        await eventually(lambda: holds(engine._busy == 0), timeout=2, what="the engine stopped")
        await eventually(lambda: holds(not still_running(before)), timeout=2, what="tasks")
        again = await client.complete(
            prompt("whole"), max_tokens=10, via=via, request_id="whole-1", **kw
        )
        assert again.text == expected_text("whole", 10)


async def test_a_slow_reader_does_not_slow_the_others(
    settings: MeshSettings, conn: Connection
) -> None:
    """Guard: one caller sleeps 50 ms per token while 20 others read 60 tokens at 5 ms: the
    others end as fast as alone; the slow one still gets its whole answer."""
    settings.edge.max_concurrent = 256
    engine = backend(delay_ms=5)
    async with (
        EdgeNode(settings, conn, engine, HeuristicRouter()),
        MeshClient(settings=settings, first_event_timeout=5, idle_timeout=5) as client,
    ):

        async def slow() -> str:
            text = ""
            async for event in client.stream(prompt("slow"), max_tokens=60, route="local"):
                if isinstance(event, TokenEvent):
                    text += event.text
                    await asyncio.sleep(0.05)
                elif isinstance(event, EndEvent):
                    return text
            return "no end"

        slow_task = asyncio.ensure_future(slow())
        began = time.monotonic()
        fast = await asyncio.gather(
            *(read_all(client, f"f{i}", 60, route="local") for i in range(20))
        )
        fast_took = time.monotonic() - began
        assert fast == [expected_text(f"f{i}", 60) for i in range(20)]
        assert not slow_task.done() and fast_took < 2.0
        assert await asyncio.wait_for(slow_task, 10) == expected_text("slow", 60)


# Before the fix (first rule: silent hang): a MeshClient on a shared connection (connection=...)
# closed with edge streams in flight: Inboxes.close() dropped their handlers and unsubscribed
# the inbox wildcard, but nothing woke or ended the readers; the connection stayed up, so no
# is_closed check tripped. Each stream hung, silent, until its idle timeout (60 s by default;
# 10 s here), and the edge generated each answer to its end for nobody.
async def test_close_of_a_client_on_a_shared_connection_ends_its_edge_streams(
    settings: MeshSettings, conn: Connection
) -> None:
    engine = backend(delay_ms=50)
    started = [asyncio.Event() for _ in range(5)]
    outcomes: dict[int, Any] = {}
    async with EdgeNode(settings, conn, engine, HeuristicRouter()):
        client = MeshClient(
            settings=settings, connection=conn, first_event_timeout=10, idle_timeout=10
        )
        await client.connect()

        async def one(i: int) -> None:
            try:
                async for event in client.stream(prompt(f"s{i}"), max_tokens=100, route="local"):
                    if isinstance(event, TokenEvent):
                        started[i].set()
                    elif isinstance(event, EndEvent):
                        outcomes[i] = "end"
                        return
            except BaseException as exc:
                outcomes[i] = exc

        tasks = [asyncio.ensure_future(one(i)) for i in range(5)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 10)
        await asyncio.wait_for(client.close(), 3)
        began = time.monotonic()
        _done, pending = await asyncio.wait(tasks, timeout=3)
        for task in pending:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert not pending, (
            f"{len(pending)} of 5 streams still silent {time.monotonic() - began:.1f}s after "
            f"close() (ended: {outcomes})"
        )
        assert all(isinstance(o, MeshError) or o == "end" for o in outcomes.values()), outcomes


@pytest.mark.parametrize("via", ["edge", "cloud"])
async def test_a_slow_reader_past_its_pending_limit_gets_the_whole_answer(
    settings: MeshSettings, conn: Connection, via: Via
) -> None:
    """Guard: a reader whose buffer (pending_limit=4) overflows while it sleeps per token, beside
    fast ones: what was dropped is fetched again; every answer whole and in order."""
    settings.edge.max_concurrent = 256
    engine = backend(delay_ms=3)
    node, kw = serving(via, settings, conn, engine)
    async with (
        node,
        MeshClient(
            settings=settings, first_event_timeout=10, idle_timeout=10, pending_limit=4
        ) as client,
    ):

        async def reader(tag: str, pause: float) -> str:
            text = ""
            async for event in client.stream(prompt(tag), max_tokens=80, via=via, **kw):
                if isinstance(event, RestartEvent):
                    text = ""
                elif isinstance(event, TokenEvent):
                    text += event.text
                    if pause:
                        await asyncio.sleep(pause)
                elif isinstance(event, EndEvent):
                    return text
            return "no end"

        got = await asyncio.wait_for(
            asyncio.gather(
                *(reader(f"slow{i}", 0.02) for i in range(3)),
                *(reader(f"fast{i}", 0) for i in range(10)),
            ),
            15,
        )
        tags = [f"slow{i}" for i in range(3)] + [f"fast{i}" for i in range(10)]
        assert got == [expected_text(t, 80) for t in tags]


# Before the fix (heal/resource): the commonest early exit, `break` as the last thing inside
# `async with MeshClient(...)`: the generator's aclose (which withdraws the request) runs a loop
# turn later, from asyncio's async-generator finalizer, after close() took the connection away;
# via the cloud the withdraw died in CloudCall._cancel_at (RuntimeError) and the worker
# generated the whole answer for nobody (the edge's variant passed: a guard).
@pytest.mark.parametrize("via", ["edge", "cloud"])
async def test_break_then_leaving_the_client_still_withdraws(
    settings: MeshSettings, conn: Connection, via: Via
) -> None:
    engine = backend(delay_ms=50)
    node, kw = serving(via, settings, conn, engine)
    async with node:
        async with MeshClient(settings=settings, first_event_timeout=10, idle_timeout=10) as client:
            async for event in client.stream(prompt("brk"), max_tokens=100, via=via, **kw):
                if isinstance(event, TokenEvent):
                    break
        assert engine._busy == 1 or engine.started == 1
        await eventually(
            lambda: holds(engine._busy == 0),
            timeout=2,
            what="the engine to stop the answer left (100 tokens x 50 ms would take 5 s)",
        )


@pytest.mark.parametrize("via", ["edge", "cloud"])
async def test_one_id_two_different_requests_at_once(
    settings: MeshSettings, conn: Connection, via: Via
) -> None:
    """Guard: two concurrent calls under one id with different prompts: one gets its own exact
    answer, the other a typed error; never the other's answer. Which one is first to the queue
    is the race's: under load (``-n 2``) the second call's publish once went first."""
    from protocol.errors import DuplicateRequestError

    engine = backend(delay_ms=20)
    node, kw = serving(via, settings, conn, engine)
    async with node, MeshClient(settings=settings, first_event_timeout=5, idle_timeout=5) as client:
        got = await asyncio.wait_for(
            asyncio.gather(
                read_all(client, "one", 20, via=via, request_id="dup-1", **kw),
                read_all(client, "other", 20, via=via, request_id="dup-1", **kw),
                return_exceptions=True,
            ),
            10,
        )
        own = [expected_text("one", 20), expected_text("other", 20)]
        answered = [i for i in (0, 1) if got[i] == own[i]]
        assert len(answered) == 1, got  # never the other's answer, never both
        assert isinstance(got[1 - answered[0]], DuplicateRequestError), got


@pytest.mark.parametrize("via", ["edge", "cloud"])
async def test_streams_cancelled_at_every_early_point_leave_nothing_behind(
    settings: MeshSettings, conn: Connection, via: Via
) -> None:
    """60 streams, each cancelled after 0..29 loop turns (while subscribing, sending, queueing,
    waiting for its start): nothing stays behind on the client, and nothing is generated
    for nobody (the engine ends idle, the queue empty)."""
    settings.edge.max_concurrent = 256
    engine = backend(delay_ms=50)
    node, kw = serving(via, settings, conn, engine)
    async with (
        node,
        MeshClient(settings=settings, first_event_timeout=10, idle_timeout=10) as client,
    ):
        await read_all(client, "warm", 2, via=via, **kw)
        before = await tasks_now(client.conn)
        subs = len(client.conn.nc._subs)

        async def one(i: int) -> None:
            async for _event in client.stream(prompt(f"e{i}"), max_tokens=100, via=via, **kw):
                pass

        tasks = [asyncio.ensure_future(one(i)) for i in range(60)]
        for turn in range(30):
            tasks[2 * turn].cancel()
            tasks[2 * turn + 1].cancel()
            await asyncio.sleep(0)
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)
        assert all(isinstance(r, asyncio.CancelledError) for r in results), results
        await eventually(lambda: holds(engine._busy == 0), timeout=3, what="engine idle")
        await asyncio.sleep(0.5)  # a request left in the queue would be taken by now
        assert engine._busy == 0, f"{engine._busy} generated for nobody"
        await eventually(lambda: holds(len(client.conn.nc._subs) == subs), timeout=2, what="subs")
        await eventually(lambda: holds(not still_running(before)), timeout=2, what="tasks")
        assert client._tries._open == {}
        if client._inboxes is not None:
            assert client._inboxes._handlers == {}


@pytest.mark.parametrize("via", ["edge", "cloud"])
@pytest.mark.parametrize("shared", [False, True])
async def test_close_as_calls_begin_ends_each_typed_or_whole(
    settings: MeshSettings, conn: Connection, via: Via, shared: bool
) -> None:
    """A close that comes while calls are beginning (their served-model look, subscription,
    publish: 0 to 12 loop turns after they were made): each call ends in one typed error or its
    whole answer, none in a raw exception, none silent. Written with the fix's second step:
    without it, a call closed before it was in flight met the closed connection raw (via the
    cloud on its own connection: RuntimeError "not connected", at 0 turns)."""
    settings.edge.max_concurrent = 256
    engine = backend(delay_ms=5)
    node, kw = serving(via, settings, conn, engine)
    async with node:
        for turns in range(13):
            client = await MeshClient(
                settings=settings,
                connection=conn if shared else None,
                first_event_timeout=5,
                idle_timeout=5,
            ).connect()
            calls = [
                asyncio.ensure_future(read_all(client, f"b{turns}x{i}", 5, via=via, **kw))
                for i in range(6)
            ]
            for _ in range(turns):
                await asyncio.sleep(0)
            await asyncio.wait_for(client.close(), 5)
            ended = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 8)
            for i, outcome in enumerate(ended):
                if isinstance(outcome, BaseException):
                    assert isinstance(outcome, MeshError), (turns, i, repr(outcome))
                else:
                    assert outcome == expected_text(f"b{turns}x{i}", 5), (turns, i)
