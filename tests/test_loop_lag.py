"""A worker that cannot keep up with its engine says so: its event loop runs late.

The loop is made late on purpose, as a worker relaying more tokens than its core can publish
makes it: stretches of blocking work, back to back. ``mesh status`` (through the worker's
micro service), its Prometheus page and the log say it; it clears once the loop catches up.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time

from cloud_node.progress import LoopStalls
from cloud_node.worker import Worker
from edge_node.node import EdgeNode
from edge_node.router import HeuristicRouter
from mesh.backends.deterministic import DeterministicBackend
from mesh.client import MeshClient
from mesh.config import MeshSettings, ModelSettings
from mesh.connection import Connection
from mesh.loop_lag import BEHIND_S, IDLE_INTERVAL_S, LoopLag
from mesh.metrics import exposition
from mesh.status import collect_status, render
from tests.helpers import eventually, holds


def _hog(seconds: float) -> None:
    """Work that holds the loop, as publishing a burst of tokens does (not a sleep)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def test_the_lag_is_the_worst_lateness_of_the_window_and_clears_after_it() -> None:
    lag = LoopLag("test", window=5.0, behind_s=0.05)
    lag.note(0.002, now=100.0)
    lag.note(0.120, now=101.0)
    lag.note(0.010, now=102.0)
    assert lag._late[0][1] == 0.120 and len(lag._late) == 2  # the worst, then what may follow it
    lag.note(0.003, now=106.5)  # 0.120 (at 101) is out of the window now
    assert lag._late[0][1] == 0.010
    lag.note(0.001, now=120.0)
    assert [late for _when, late in lag._late] == [0.001]


async def test_a_worker_whose_loop_runs_late_says_it_cannot_keep_up(
    settings: MeshSettings, conn: Connection
) -> None:
    backend = DeterministicBackend(ModelSettings(backend="deterministic", slots=2))
    async with Worker(settings, conn, backend) as worker:
        worker.loop_lag.window = 3.0
        assert worker.status()["behind"] is False
        for _ in range(6):  # 0.12 s stretches: tokens 20 ms apart would wait 100 ms
            _hog(0.12)
            await asyncio.sleep(0)

        async def behind() -> bool:
            return bool(worker.status()["behind"])

        await eventually(behind, timeout=5, what="the worker to say it is behind")
        assert worker.status()["loop_lag_ms"] >= 50
        page = exposition.text().decode()
        lag_line = next(
            line for line in page.splitlines() if line.startswith("mesh_worker_loop_lag_seconds")
        )
        assert float(lag_line.split()[-1]) >= 0.05
        status = await collect_status(conn, settings)
        (mine,) = [w for w in status["workers"] if w["node_id"] == worker.node_id]
        assert mine["behind"] is True
        assert any("BEHIND" in line and worker.node_id in line for line in render(status))

        async def caught_up() -> bool:
            return not worker.status()["behind"]

        await eventually(caught_up, timeout=10, what="the worker to keep up again")


async def test_an_edge_whose_loop_runs_late_says_so_too(
    settings: MeshSettings, conn: Connection
) -> None:
    """HTTP, NATS intake, relays and the local model share the edge's one loop."""
    backend = DeterministicBackend(ModelSettings(backend="deterministic", slots=2))
    async with EdgeNode(settings, conn, backend, HeuristicRouter()) as edge:
        edge.loop_lag.window = 3.0
        assert edge.stats_data()["behind"] is False
        for _ in range(6):
            _hog(0.12)
            await asyncio.sleep(0)

        async def behind() -> bool:
            return bool(edge.stats_data()["behind"])

        await eventually(behind, timeout=5, what="the edge to say it is behind")
        status = await collect_status(conn, settings)
        assert any("BEHIND" in line for line in render(status)), render(status)


async def test_the_ticks_go_on_to_a_listener_and_a_listener_that_raises_stops_nothing() -> None:
    """One ticker per process: the worker's stand-still count listens to its ticks."""
    seen: list[float] = []

    def listener(now: float) -> None:
        seen.append(now)
        if len(seen) == 2:
            raise RuntimeError("a listener that fails once")

    loop = asyncio.get_running_loop()
    errors: list[object] = []
    loop.set_exception_handler(lambda _loop, context: errors.append(context.get("exception")))
    lag = LoopLag("test", interval=0.01, on_tick=listener)
    ticking = loop.create_task(lag.run())
    try:

        async def ticked() -> bool:
            return len(seen) >= 5

        await eventually(ticked, timeout=5, what="five ticks")
        assert seen == sorted(seen)
        assert len(errors) == 1 and isinstance(errors[0], RuntimeError)
    finally:
        ticking.cancel()
        loop.set_exception_handler(None)
    count = len(seen)
    await asyncio.sleep(0.05)
    assert len(seen) == count  # a cancelled ticker ticks no more


def test_a_gap_between_ticks_counts_as_a_stand_still() -> None:
    stood: list[int] = []
    stalls = LoopStalls(on_stall=lambda: stood.append(1))
    for now in (10.0, 10.05, 10.1, 10.6, 10.65):  # 0.5 s between 10.1 and 10.6
        stalls.tick(now)
    assert stalls.stalls == 1 and stood == [1]


async def test_an_idle_ticker_waits_its_idle_interval_and_comes_back_at_once_with_work() -> None:
    """With nothing to do (``busy`` False) the next tick is ``idle_interval`` away: an idle
    edge woke 23 times a second, 20 of them for its ticker. ``wake`` (work came) brings the
    next tick back within ``interval``; while busy the ticks keep that pace. Stopped, a wake
    sets nothing. Before the change every tick came ``interval`` after the last."""
    loop = asyncio.get_running_loop()
    ticks: list[float] = []
    busy = False
    lag = LoopLag(
        "test", interval=0.01, idle_interval=30.0, on_tick=ticks.append, busy=lambda: busy
    )
    ticking = loop.create_task(lag.run())
    try:
        await eventually(lambda: holds(len(ticks) >= 1), timeout=5, what="the first tick")
        due = lag.next_due
        assert due is not None and due - ticks[0] >= 29.0, (due, ticks)  # idle: 30 s on
        busy = True
        lag.wake()
        assert lag.next_due is not None and lag.next_due - loop.time() <= 0.011
        await eventually(lambda: holds(len(ticks) >= 6), timeout=5, what="ticks while busy")
        assert max(b - a for a, b in itertools.pairwise(ticks)) < 5.0, ticks
        busy = False
        seen = len(ticks)
        await eventually(lambda: holds(len(ticks) > seen), timeout=5, what="a tick once idle")
        due = lag.next_due
        assert due is not None and due - ticks[-1] >= 29.0, (due, ticks[-1])
        lag.wake()
        lag.wake()  # a second wake while one is near moves nothing
        assert lag.next_due is not None and lag.next_due - loop.time() <= 0.011
    finally:
        ticking.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await ticking
    assert lag.next_due is None
    lag.wake()
    assert lag.next_due is None


async def test_an_idle_edge_ticks_four_times_a_second_and_every_50_ms_while_it_serves(
    settings: MeshSettings, conn: Connection
) -> None:
    """The edge's ticker follows its requests: idle, a tick every 0.25 s; from the moment a
    request comes until its answer ends, every ``interval`` (its lag is measured while it
    matters); idle again after."""
    slow = DeterministicBackend(
        ModelSettings(backend="deterministic", slots=2, token_delay_ms=50, faults=False)
    )
    async with EdgeNode(settings, conn, slow, HeuristicRouter(threshold=1.0)) as edge:
        loop = asyncio.get_running_loop()
        lag = edge.loop_lag
        assert lag.idle_interval == IDLE_INTERVAL_S > lag.interval

        async def idle_pace() -> bool:
            due = lag.next_due
            return due is not None and due - loop.time() > lag.interval + 0.05

        await eventually(idle_pace, timeout=5, what="the idle edge's ticks 0.25 s apart")
        async with MeshClient(settings=settings, connection=conn) as client:
            answer = asyncio.create_task(client.complete("[tag:idle] hi", max_tokens=20))
            try:
                await eventually(lambda: holds(edge._serving == 1), timeout=10, what="serving")
                due = lag.next_due
                assert due is not None and due - loop.time() <= lag.interval + 0.01
                paces = []
                while edge._serving:  # until serve() ends (the client reads the end after)
                    due = lag.next_due
                    if due is not None:
                        paces.append(due - loop.time())
                    await asyncio.sleep(0.02)
                assert (await answer).end.path == "local"
                assert len(paces) >= 10 and max(paces) <= lag.interval + 0.01, paces
            finally:
                answer.cancel()
        await eventually(idle_pace, timeout=5, what="the ticks 0.25 s apart again")


def _hold(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


class _OtherClient:
    """A client on an event loop (and connection) of its own, in a thread: it sends while the
    edge's loop is held, and times its answer."""

    def __init__(self, settings: MeshSettings) -> None:
        self.settings = settings
        self.ready = threading.Event()
        self.go = threading.Event()
        self.result: tuple[float, str] | BaseException | None = None
        self.thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _main(self) -> None:
        try:
            async with MeshClient(settings=self.settings) as client:
                await client.complete("[tag:warm] hi", max_tokens=2)  # connected, warm
                self.ready.set()
                await asyncio.to_thread(self.go.wait, 10)
                began = time.monotonic()
                answer = await client.complete("[tag:held] hi", max_tokens=2)
                self.result = (time.monotonic() - began, answer.end.path)
        except BaseException as exc:
            self.result = exc
            self.ready.set()


async def test_a_request_that_waits_for_an_idle_edges_held_loop_shows_in_its_lag(
    settings: MeshSettings, conn: Connection
) -> None:
    """A request that reaches an idle edge while its loop is held (work outside serve(): the
    intake decoding a burst, a collection, a metrics scrape) waits for the loop, and nothing can
    wake the ticker before the hold ends. The idle ticks must see the hold themselves: held 0.4 s
    from just after a tick, the edge says it is behind. Before the fix (review S23a, idle ticks
    1 s apart) the next tick came after the hold, and the edge said loop_lag_ms=0.1,
    behind=False, for an answer 0.4 s late."""
    backend = DeterministicBackend(ModelSettings(backend="deterministic", slots=2, faults=False))
    async with EdgeNode(settings, conn, backend, HeuristicRouter(threshold=1.0)) as edge:
        lag = edge.loop_lag
        loop = asyncio.get_running_loop()
        other = _OtherClient(settings)
        other.thread.start()
        await eventually(lambda: holds(other.ready.is_set()), timeout=10, what="the client")
        assert not isinstance(other.result, BaseException), other.result

        async def just_ticked_idle() -> bool:  # the whole idle interval ahead of the hold
            due = lag.next_due
            return due is not None and due - loop.time() >= lag.idle_interval - 0.1

        await eventually(just_ticked_idle, timeout=5, what="an idle tick")
        assert edge.stats_data()["behind"] is False
        other.go.set()
        _hold(0.4)  # the loop is held as the request comes in
        await eventually(lambda: holds(other.result is not None), timeout=10, what="the answer")
        assert not isinstance(other.result, BaseException), other.result
        took, path = other.result  # type: ignore[misc]
        assert path == "local" and took >= 0.25, took  # the answer was late by about the hold
        stats = edge.stats_data()
        assert stats["behind"] is True, (
            f"the answer took {took * 1000:.0f} ms, yet the edge says "
            f"loop_lag_ms={stats['loop_lag_ms']}, behind={stats['behind']}"
        )
        other.thread.join(timeout=5)


async def _idle_trial(hold_s: float, phase: float, *, wake_after: bool = False) -> float:
    """An idle ticker (ticks 0.05 s, idle 0.25 s); the loop held ``hold_s`` from ``phase``
    after an idle tick (its second: the idle pace is in place). The lag it reports after."""
    loop = asyncio.get_running_loop()
    ticks: list[float] = []
    lag: LoopLag

    def held() -> None:
        _hold(hold_s)
        if wake_after:  # as serve() does for a request that waited out the hold
            lag.wake()

    def on_tick(now: float) -> None:
        if len(ticks) == 1:
            loop.call_later(phase, held)
        ticks.append(now)

    lag = LoopLag("test", interval=0.05, idle_interval=0.25, busy=lambda: False, on_tick=on_tick)
    ticking = loop.create_task(lag.run())
    try:
        await asyncio.sleep(0.05 + 0.25 + phase + hold_s + 0.1)  # the trial's own span
    finally:
        ticking.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await ticking
    return lag.lag


async def test_an_idle_hold_of_0_3_s_is_seen_at_every_phase_of_the_idle_schedule() -> None:
    """Any hold of 0.3 s or more is seen while idle, whenever it begins. The worst is a hold
    that begins just after a tick: the tick due 0.25 s later runs at the hold's end, 0.05 s
    late (BEHIND_S). Review S23c."""
    for phase in (0.0, 0.06, 0.12, 0.18, 0.24):
        late = await _idle_trial(0.3, phase)
        assert late >= BEHIND_S, (phase, late)


async def test_a_wake_after_a_hold_keeps_the_overdue_ticks_lateness() -> None:
    """The loop held past an idle tick's due time, then ``wake`` (a request's serve()) before
    the overdue tick runs: only a tick due later than ``interval`` from now moves, so the
    overdue one keeps its due time and its lateness is noted. Review S23c."""
    late = await _idle_trial(0.4, 0.0, wake_after=True)
    assert late >= 0.14, late
