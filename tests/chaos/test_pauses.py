"""Fault tests: processes PAUSED by PID (SIGSTOP, then SIGCONT), not killed.

A paused process keeps its connections: nobody sees it leave, and when it comes back it carries
on with the state it had, now stale (a delivery JetStream already gave to another worker, a
lease another worker took over, a progress report for an old delivery). Every request a node
accepted must still end at its client in exactly one complete, correct answer or one typed
error, within its deadline.

Real nats-server (file storage), real ``mesh worker`` and ``mesh edge`` processes on the
deterministic backend; every answer checked exactly, and the worker events themselves watched
on the wire (``mesh.v1.tok.>``) to see who generated what. A pause always ends in a SIGCONT
(:func:`mesh.testing.chaos.paused`), and the cluster fixture stops every process.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from dataclasses import dataclass, field
from typing import Any

import pytest
from nats.aio.msg import Msg

from mesh.answer_store import AnswerStore
from mesh.testing.chaos import (
    MeshProcess,
    Outcome,
    Tally,
    ask,
    expected_text,
    free_port,
    paused,
    prompt,
    wait_for_worker,
)
from protocol.codec import decode_event
from protocol.errors import MeshError, MeshTimeoutError
from protocol.messages import Answer as KeptAnswer
from protocol.messages import EndEvent, ErrorEvent, StartEvent, TokenEvent
from protocol.stream import AnswerState
from protocol.subjects import (
    ANSWERS_STREAM,
    address_of,
    answer_subject,
    worker_status_subject,
)
from tests.chaos.conftest import Cluster
from tests.chaos.test_faults import nats_req, sse
from tests.helpers import eventually, queue_drained, queue_state

pytestmark = pytest.mark.chaos

_TAG = re.compile(r"^ ([A-Za-z]+)\d+")
STALE_TOKENS_MAX = 10
"""Tokens a resumed worker may still generate for a request another worker took over, before
it sees that (its next progress report)."""


# -- the worker events on the wire -----------------------------------------------------------
@dataclass
class Answer:
    """One request's worker events as they passed the server (duplicates included)."""

    subject: str
    events: list[tuple[float, Any]] = field(default_factory=list)

    @property
    def tag(self) -> str:
        for _at, event in self.events:
            if isinstance(event, TokenEvent) and event.seq == 0:
                found = _TAG.match(event.text)
                if found:
                    return found.group(1)
        return "?"

    def starts(self) -> list[StartEvent]:
        seen: dict[int, StartEvent] = {}
        for _at, event in self.events:
            if isinstance(event, StartEvent):
                seen.setdefault(event.attempt, event)
        return [seen[a] for a in sorted(seen)]

    def start_time(self, attempt: int) -> float | None:
        return next(
            (at for at, e in self.events if isinstance(e, StartEvent) and e.attempt == attempt),
            None,
        )

    def positions(self, attempt: int, before: float = float("inf")) -> set[int]:
        return {
            e.seq
            for at, e in self.events
            if isinstance(e, TokenEvent) and e.attempt == attempt and at < before
        }

    def tokens_after(self, attempt: int, since: float) -> int:
        """Engine tokens of ``attempt`` first published after ``since`` (each position once)."""
        first: dict[int, tuple[float, int]] = {}
        for at, e in self.events:
            if isinstance(e, TokenEvent) and e.attempt == attempt:
                first.setdefault(e.seq, (at, e.n))
        return sum(n for at, n in first.values() if at >= since)

    def outcomes(self) -> list[tuple[float, EndEvent | ErrorEvent]]:
        seen: dict[tuple[str, int | None], tuple[float, EndEvent | ErrorEvent]] = {}
        for at, e in self.events:
            if isinstance(e, (EndEvent, ErrorEvent)):
                seen.setdefault((e.t, e.attempt), (at, e))
        return sorted(seen.values(), key=lambda pair: pair[0])


class Wire:
    """Watches every worker event on ``mesh.v1.tok.>`` (loopback, the test's own connection)."""

    def __init__(self) -> None:
        self.answers: dict[str, Answer] = {}
        self._sub: Any = None

    @classmethod
    async def watch(cls, cluster: Cluster) -> Wire:
        wire = cls()
        assert cluster.conn is not None
        wire._sub = await cluster.conn.nc.subscribe("mesh.v1.tok.>", cb=wire._on)
        return wire

    async def _on(self, msg: Msg) -> None:
        with contextlib.suppress(Exception):
            event = decode_event(msg.data, msg.headers)
            answer = self.answers.setdefault(msg.subject, Answer(msg.subject))
            answer.events.append((time.monotonic(), event))

    async def under_way(self, tags: list[str], what: str, *, positions: int = 10) -> None:
        """Wait (20 s at most) until every tagged answer has ``positions`` positions of its
        first attempt on the wire."""

        async def ready() -> bool:
            found = self.by_tag(tags)
            return len(found) == len(tags) and all(
                len(a.positions(1)) >= positions for a in found.values()
            )

        await eventually(ready, 20, what)

    async def taken_over(
        self, tags: list[str], what: str, timeout: float, *, positions: int = 5
    ) -> None:
        """Wait until every tagged answer has a later attempt (another worker took it over)
        with ``positions`` positions of its own on the wire."""

        async def ready() -> bool:
            found = self.by_tag(tags)
            return len(found) == len(tags) and all(
                len(a.starts()) >= 2 and len(a.positions(a.starts()[-1].attempt)) >= positions
                for a in found.values()
            )

        await eventually(ready, timeout, what)

    def by_tag(self, tags: list[str]) -> dict[str, Answer]:
        found = {a.tag: a for a in self.answers.values()}
        return {tag: found[tag] for tag in tags if tag in found}

    async def close(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()


async def worker_status(cluster: Cluster, node_id: str) -> dict[str, Any]:
    assert cluster.conn is not None
    reply = await cluster.conn.nc.request(worker_status_subject(node_id), b"", timeout=2)
    return dict(json.loads(reply.data))


async def idle(cluster: Cluster, node_id: str) -> bool:
    """The worker has no request in flight (it answers its status endpoint: it runs)."""
    with contextlib.suppress(Exception):
        return bool((await worker_status(cluster, node_id))["in_flight"] == 0)
    return False


async def stored_answer(cluster: Cluster, subject: str, request_id: str) -> AnswerState:
    """What a late reader (a joining sender, a repair) finds in the answer store."""
    assert cluster.conn is not None
    settings = cluster.settings()
    events = await AnswerStore(cluster.conn, settings.stream).replay(subject, timeout=5)
    state = AnswerState(request_id)
    state.feed_all(events)
    return state


async def drained(cluster: Cluster, timeout: float = 15.0) -> None:
    assert cluster.conn is not None
    conn, settings = cluster.conn, cluster.settings()
    await eventually(
        lambda: queue_drained(conn, settings), timeout, "the queue drained, nothing unacked"
    )


def sound(outcomes: list[Outcome], fault: str, *extra: object) -> Tally:
    """Print the fault's row of the tally, and check the property: nothing lost or corrupt."""
    tally = Tally(list(outcomes))
    print("\n" + tally.row(fault), *extra)
    tally.assert_sound()
    return tally


def log_events(proc: MeshProcess, since_line: int) -> list[dict[str, Any]]:
    return proc.log_lines()[since_line:]


# -- 1. a worker paused for longer than ack_wait -----------------------------------------------
async def test_worker_paused_past_ack_wait_is_taken_over_and_comes_back_stale(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker is paused mid-answer until JetStream redelivered every request to another
    worker and that worker continues them; then it resumes, with its old deliveries. Each client
    (SDK via the cloud and via an edge) gets one whole, exact answer, continued without a
    restart; the stale attempts harm nothing; the queue drains; the resumed worker serves
    later requests."""
    ack_wait = 2.0
    monkeypatch.setenv("MESH_STREAM_ACK_WAIT", str(ack_wait))  # the worker and edge processes
    stale = await cluster.worker("stale", slots=8, token_ms=20)
    await cluster.edge()
    client = await cluster.client()
    wire = await Wire.watch(cluster)
    n = 150  # 3 s on the stale worker; the survivor is slower, so the stale attempts end first
    tags = ["ea", "eb", "ca", "cb"]
    asks = [ask(client, t, n, via="edge", route="cloud") for t in tags[:2]]
    asks += [ask(client, t, n, via="cloud") for t in tags[2:]]
    pending = [asyncio.ensure_future(a) for a in asks]
    try:
        await wire.under_way(tags, "every answer under way on the stale worker")
        stale_lines = len(stale.log_lines())
        with paused(stale.pid):
            paused_at = time.monotonic()
            survivor = await cluster.worker("survivor", slots=8, token_ms=30)
            await wire.taken_over(
                tags, "every answer taken over and under way on the survivor", ack_wait + 20
            )
            pause = time.monotonic() - paused_at
        resumed_at = time.monotonic()
        # What the resumed worker does with its old deliveries while the survivor still serves
        # them: it must not ack (or nak, or term) them from under the survivor.
        await eventually(
            lambda: idle(cluster, "stale"), 15, "the stale worker let its old deliveries go"
        )
        survivor_busy = not any(
            e.attempt == 2 for a in wire.by_tag(tags).values() for _at, e in a.outcomes()
        )
        assert cluster.conn is not None
        held = await queue_state(cluster.conn, cluster.settings())
        outcomes = await asyncio.wait_for(asyncio.gather(*pending), 60)
    finally:
        for task in pending:
            task.cancel()
    tally = sound(
        outcomes, f"worker paused {pause:.1f} s, until taken over (ack_wait {ack_wait:g} s)"
    )
    assert tally.counts()["correct"] == 4, (tally.outcomes, cluster.logs())
    assert all(o.attempts >= 2 and o.restarts == 0 for o in tally.outcomes), tally.outcomes
    assert all(o.path == "cloud" for o in tally.outcomes), tally.outcomes

    # The survivor generated nothing twice: it continued after exactly the positions the stale
    # attempt had published before it was paused.
    answers = wire.by_tag(tags)
    stale_tokens = 0
    for tag, answer in answers.items():
        starts = answer.starts()
        assert [s.attempt for s in starts] == [1, 2], (tag, starts)  # no third attempt
        assert starts[0].node == "cloud:stale" and starts[1].node == "cloud:survivor", starts
        taken_at = answer.start_time(2)
        assert taken_at is not None
        before = answer.positions(1, before=taken_at)
        assert before == set(range(len(before))) and starts[1].seq == len(before), (tag, starts)
        stale_tokens += answer.tokens_after(1, resumed_at)
        # A late reader finds the one answer, the survivor's continuation, in the store.
        state = await stored_answer(cluster, answer.subject, starts[0].id)
        assert state.done and isinstance(state.outcome, EndEvent), (tag, state.missing())
        assert state.text() == expected_text(tag, n) and state.outcome.attempt == 2, tag
    print(
        f"stale worker: {stale_tokens} tokens generated after it resumed; outcomes on the wire:",
        {t: [(e.t, e.attempt) for _at, e in a.outcomes()] for t, a in answers.items()},
        "; queue while the survivor was still answering:",
        held,
    )
    assert survivor_busy, "the survivor finished before the stale worker let go: no check made"
    assert held["num_ack_pending"] == 4, (
        f"the stale worker acked deliveries the survivor holds: {held}; an answer the survivor "
        "is continuing is no longer protected by redelivery"
    )
    assert stale_tokens <= 4 * STALE_TOKENS_MAX, f"{stale_tokens} tokens generated for nothing"
    assert all(e.attempt != 1 for a in answers.values() for _at, e in a.outcomes())
    await drained(cluster)
    status = await worker_status(cluster, "stale")
    print("the stale worker:", {k: status[k] for k in ("fetched", "completed", "superseded")})
    assert (status["completed"], status["superseded"], status["requeued"]) == (0, 4, 0), status
    assert not [e for e in log_events(stale, stale_lines) if e.get("level") == "error"]

    # It comes back: announced again, and it serves the next requests alone.
    assert cluster.conn is not None
    await wait_for_worker(cluster.conn, "stale", timeout=10)
    await survivor.stop()
    later = await asyncio.wait_for(
        asyncio.gather(
            ask(client, "la", 20, via="cloud"),
            ask(client, "lb", 20, via="cloud"),
            ask(client, "lc", 20, via="edge", route="cloud"),
        ),
        30,
    )
    assert all(o.kind == "correct" and o.path == "cloud" for o in later), (later, cluster.logs())
    assert all(
        s.node == "cloud:stale"
        for a in wire.by_tag(["la", "lb", "lc"]).values()
        for s in a.starts()
    )
    await drained(cluster)
    await wire.close()


async def test_a_takeover_stays_protected_after_the_paused_worker_resumes(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same pause, then a second fault: the worker that took the requests over dies
    (kill -9) after the paused one resumed and let its old deliveries go. JetStream must still
    hold the requests for the survivor, so that a third worker continues them: the clients get
    whole answers, not silence."""
    ack_wait = 2.0
    monkeypatch.setenv("MESH_STREAM_ACK_WAIT", str(ack_wait))
    stale = await cluster.worker("stale", slots=8, token_ms=20)
    await cluster.edge()
    client = await cluster.client(idle_timeout=15)
    wire = await Wire.watch(cluster)
    n = 200  # the survivor (40 ms a token) is still answering when the stale worker is done
    tags = ["ka", "kb", "kc"]
    asks = [ask(client, t, n, via="cloud") for t in tags[:2]]
    asks += [ask(client, tags[2], n, via="edge", route="cloud")]
    pending = [asyncio.ensure_future(a) for a in asks]
    try:
        await wire.under_way(tags, "every answer under way on the stale worker")
        with paused(stale.pid):
            survivor = await cluster.worker("survivor", slots=8, token_ms=40)
            await wire.taken_over(
                tags, "every answer taken over and under way on the survivor", ack_wait + 20
            )
        await eventually(
            lambda: idle(cluster, "stale"), 15, "the stale worker let its old deliveries go"
        )
        await cluster.worker("heir", slots=8, token_ms=20)
        assert not any(
            e.attempt == 2 for a in wire.by_tag(tags).values() for _at, e in a.outcomes()
        ), "the survivor finished before it could be killed mid-answer"
        survivor.kill()
        outcomes = await asyncio.wait_for(asyncio.gather(*pending), 60)
    finally:
        for task in pending:
            task.cancel()
    sound(outcomes, "worker paused past ack_wait, resumed, then its heir killed")
    assert all(o.kind == "correct" and o.path == "cloud" for o in outcomes), (
        outcomes,
        cluster.logs(),
    )
    assert all(o.attempts >= 3 for o in outcomes), outcomes
    await drained(cluster)
    await wire.close()


# -- 2. a worker paused for less than ack_wait -------------------------------------------------
async def test_worker_paused_shorter_than_ack_wait_just_carries_on(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Paused 1.5 s with ack_wait 4 s (reports every 0.8 s): nothing is redelivered, every
    answer goes on as attempt 1 and ends whole, and the worker acks each request once."""
    ack_wait, pause = 4.0, 1.5
    monkeypatch.setenv("MESH_STREAM_ACK_WAIT", str(ack_wait))
    worker = await cluster.worker("w1", slots=8)
    await cluster.edge()
    client = await cluster.client()
    wire = await Wire.watch(cluster)
    n = 100
    tags = ["sa", "sb", "sc", "sd"]
    asks = [ask(client, t, n, via="edge", route="cloud") for t in tags[:2]]
    asks += [ask(client, t, n, via="cloud") for t in tags[2:]]
    pending = [asyncio.ensure_future(a) for a in asks]
    try:
        await wire.under_way(tags, "every answer under way")
        with paused(worker.pid):
            await asyncio.sleep(pause)  # the pause length is the fault
        outcomes = await asyncio.wait_for(asyncio.gather(*pending), 60)
    finally:
        for task in pending:
            task.cancel()
    sound(outcomes, f"worker paused {pause:g} s (< ack_wait {ack_wait:g} s)")
    assert all(
        o.kind == "correct" and o.path == "cloud" and o.attempts == 1 and o.restarts == 0
        for o in outcomes
    ), (outcomes, cluster.logs())
    for tag, answer in wire.by_tag(tags).items():
        assert [s.attempt for s in answer.starts()] == [1], (tag, answer.starts())
        assert [(e.t, e.attempt) for _at, e in answer.outcomes()] == [("end", 1)], tag
    await drained(cluster)
    status = await worker_status(cluster, "w1")
    assert (status["fetched"], status["completed"]) == (4, 4), status  # never redelivered
    assert status["superseded"] == 0 and status["requeued"] == 0, status
    await wire.close()


async def test_worker_link_down_past_ack_wait_lets_its_old_deliveries_be(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not a pause but the same stale state: the worker's link is down (a proxy cut) until a
    second worker took its requests over, then it comes back. nats-py buffers the progress
    reports it makes meanwhile, so they do not count: the link down that long is a lapse, and
    the returning worker acks none of its old deliveries from under the survivor."""
    ack_wait = 2.0
    monkeypatch.setenv("MESH_STREAM_ACK_WAIT", str(ack_wait))
    link = await cluster.proxy()
    await cluster.worker("cut", url=link.url, slots=8, token_ms=20)
    client = await cluster.client()
    wire = await Wire.watch(cluster)
    n, tags = 200, ["la", "lb", "lc"]
    pending = [asyncio.ensure_future(ask(client, t, n, via="cloud")) for t in tags]
    try:
        await wire.under_way(tags, "every answer under way on the worker about to be cut off")
        link.cut(60)
        await cluster.worker("survivor", slots=8, token_ms=40)
        await wire.taken_over(
            tags, "every answer taken over by the survivor", ack_wait + 20, positions=0
        )
        link.restore()
        await eventually(lambda: idle(cluster, "cut"), 15, "the cut worker back, and idle")
        survivor_busy = not any(
            e.attempt == 2 for a in wire.by_tag(tags).values() for _at, e in a.outcomes()
        )
        assert cluster.conn is not None
        held = await queue_state(cluster.conn, cluster.settings())
        outcomes = await asyncio.wait_for(asyncio.gather(*pending), 60)
    finally:
        for task in pending:
            task.cancel()
    tally = sound(outcomes, f"worker link down past ack_wait ({ack_wait:g} s)", held)
    assert tally.counts()["correct"] == 3, (outcomes, cluster.logs())
    assert survivor_busy, "the survivor finished before the cut worker came back: no check made"
    assert held["num_ack_pending"] == 3, f"the returning worker let go of the survivor's: {held}"
    await drained(cluster)
    await wire.close()


# -- 3. the edge paused mid-answer -------------------------------------------------------------
async def test_edge_paused_for_two_seconds_mid_answer(cluster: Cluster) -> None:
    """The edge stands still 2 s while it relays cloud answers and generates a local one. Its
    SDK clients (timeouts 30 s), a `nats req` client and an OpenAI SSE client get one whole
    answer each; a client whose idle timeout (1 s) is shorter than the pause gets one typed
    `timeout` from its own SDK, and its request is cancelled, not left running. A request
    straight to the cloud is untouched."""
    await cluster.worker("w1", slots=8)
    http_port = free_port()
    edge = await cluster.edge(MESH_EDGE_HTTP_PORT=str(http_port))
    client = await cluster.client()
    impatient = await cluster.client(idle_timeout=1.0)
    wire = await Wire.watch(cluster)
    n = 120  # 2.4 s at the worker's 20 ms a token
    local_n = 500  # 2.5 s at the edge's 5 ms a token
    asks = [ask(client, t, n, via="edge", route="cloud") for t in ("pa", "pb")]
    asks += [ask(client, "pl", local_n, via="edge", route="local")]
    asks += [ask(client, "pc", n, via="cloud")]
    asks += [nats_req(cluster, "pn", n), sse(http_port, "ps", n)]
    pending = [asyncio.ensure_future(a) for a in asks]

    async def impatient_ask() -> BaseException | None:
        try:
            # 8 s: still running when its cancel reaches the worker, after the edge resumes
            async for _event in impatient.stream(prompt("pi"), max_tokens=400, route="cloud"):
                pass
        except MeshError as err:
            return err
        return None

    short = asyncio.ensure_future(impatient_ask())
    cloud_tags = ["pa", "pb", "pc", "pn", "ps", "pi"]
    try:
        await wire.under_way(cloud_tags, "every cloud answer under way")
        with paused(edge.pid):
            await asyncio.sleep(2.0)  # the pause length is the fault
        outcomes = await asyncio.wait_for(asyncio.gather(*pending), 60)
        short_err = await asyncio.wait_for(short, 30)
    finally:
        for task in [*pending, short]:
            task.cancel()
    print(f"\nimpatient client (idle timeout 1 s): {short_err!r}")
    sound(outcomes, "edge paused 2 s (patient clients)")
    assert all(o.kind == "correct" for o in outcomes), (outcomes, cluster.logs())
    assert [o.path for o in outcomes] == ["cloud", "cloud", "local", "cloud", "cloud", "cloud"]
    assert isinstance(short_err, MeshTimeoutError) and short_err.code.value == "timeout", short_err
    # Its request was cancelled at the worker once the edge came back: nothing runs on, nothing
    # stays queued or unacked.
    await drained(cluster)
    await eventually(lambda: idle(cluster, "w1"), 15, "the worker idle")
    pi = wire.by_tag(["pi"])["pi"]
    ended = [(e.t, e.attempt, getattr(e, "code", None)) for _at, e in pi.outcomes()]
    print("the impatient client's request at the worker:", ended)
    # One outcome at the worker: the cancel, which the edge passes on once it resumes. (Before
    # mesh.tasks.raise_if_cancelled, the resumed edge's relay ran on in 3 of 4 runs: an inner
    # asyncio.wait_for swallowed the cancel, and the worker generated the whole answer.)
    assert ended == [("err", 1, "cancelled")], ended
    await wire.close()


# -- 4. nats-server paused mid-answer ----------------------------------------------------------
async def test_nats_server_paused_for_two_seconds_mid_answer(cluster: Cluster) -> None:
    """Every connection stalls at once and nobody disconnects cleanly: answers in flight (via the
    cloud, via the edge, the edge's local one, `nats req`) end whole, as attempt 1 (the default
    ack_wait of 5 s outlasts the pause), the queue drains, and the mesh serves on."""
    worker = await cluster.worker("w1", slots=8)
    await cluster.edge()
    client = await cluster.client()
    wire = await Wire.watch(cluster)
    n = 120
    asks = [ask(client, t, n, via="edge", route="cloud") for t in ("ra", "rb")]
    asks += [ask(client, "rl", 500, via="edge", route="local")]
    asks += [ask(client, t, n, via="cloud") for t in ("rc", "rd")]
    asks += [nats_req(cluster, "rn", n)]
    pending = [asyncio.ensure_future(a) for a in asks]
    cloud_tags = ["ra", "rb", "rc", "rd", "rn"]
    try:
        await wire.under_way(cloud_tags, "every cloud answer under way")
        assert cluster.server.pid is not None
        with paused(cluster.server.pid):
            await asyncio.sleep(2.0)  # the pause length is the fault
        outcomes = await asyncio.wait_for(asyncio.gather(*pending), 60)
    finally:
        for task in pending:
            task.cancel()
    sound(outcomes, "nats-server paused 2 s")
    assert all(o.kind == "correct" for o in outcomes), (outcomes, cluster.logs())
    assert [o.path for o in outcomes] == ["cloud", "cloud", "local", "cloud", "cloud", "cloud"]
    assert all(o.attempts == 1 and o.restarts == 0 for o in outcomes), outcomes
    await drained(cluster)
    status = await worker_status(cluster, "w1")
    assert (status["fetched"], status["completed"]) == (5, 5), status
    assert cluster.conn is not None
    await wait_for_worker(cluster.conn, "w1", timeout=10)
    after = await asyncio.wait_for(
        asyncio.gather(
            ask(client, "after", 10, via="edge", route="cloud"), ask(client, "afc", 10, via="cloud")
        ),
        30,
    )
    assert all(o.kind == "correct" and o.path == "cloud" for o in after), after
    assert worker.proc is not None and worker.proc.returncode is None
    await wire.close()


# -- 5. a paused worker held the lease of a request that can wait ------------------------------
async def test_paused_worker_holding_a_lease_is_taken_over_and_keeps_away(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Requests that can wait (``deferrable``: a lease each, the answer kept for the site). Their
    worker is paused past ack_wait; the redeliveries take its leases over and continue the
    answers. Resumed, the stale worker stops at its next report, before it refreshes (and so
    takes back) the lease, and keeps, acks or naks nothing. The kept answer is the whole text,
    as the survivor ended it."""
    ack_wait = 2.0  # leases last 4 s without a refresh
    monkeypatch.setenv("MESH_STREAM_ACK_WAIT", str(ack_wait))
    stale = await cluster.worker("stale", slots=8, token_ms=20)
    client = await cluster.client()
    wire = await Wire.watch(cluster)
    n = 150
    tags = ["da", "db"]
    pending = [asyncio.ensure_future(ask(client, t, n, via="cloud", deferrable=True)) for t in tags]
    try:
        await wire.under_way(tags, "both answers under way on the stale worker")
        with paused(stale.pid):
            await cluster.worker("survivor", slots=8, token_ms=30)
            await wire.taken_over(
                tags, "both answers taken over and under way on the survivor", ack_wait + 20
            )
        resumed_at = time.monotonic()
        await eventually(
            lambda: idle(cluster, "stale"), 15, "the stale worker let its old deliveries go"
        )
        assert cluster.conn is not None
        held = await queue_state(cluster.conn, cluster.settings())
        outcomes = await asyncio.wait_for(asyncio.gather(*pending), 60)
    finally:
        for task in pending:
            task.cancel()
    sound(outcomes, "worker holding leases paused past ack_wait, resumed")
    assert all(o.kind == "correct" and o.attempts >= 2 for o in outcomes), (
        outcomes,
        cluster.logs(),
    )
    assert held["num_ack_pending"] == 2, held  # the stale worker let go of nothing
    answers = wire.by_tag(tags)
    for tag, answer in answers.items():
        # No third attempt: the stale worker handed nothing back (a nak) to be redelivered.
        assert [(s.attempt, s.node) for s in answer.starts()] == [
            (1, "cloud:stale"),
            (2, "cloud:survivor"),
        ], (tag, answer.starts())
        assert answer.tokens_after(1, resumed_at) <= STALE_TOKENS_MAX, tag
        assert all(e.attempt != 1 for _at, e in answer.outcomes()), answer.outcomes()
    await drained(cluster)
    status = await worker_status(cluster, "stale")
    assert status["superseded"] == 2 and status["requeued"] == 0, status
    for tag, answer in answers.items():
        kept = await kept_answer(cluster, answer.subject)
        assert isinstance(kept, KeptAnswer), (tag, kept)
        assert kept.text == expected_text(tag, n) and kept.served_by == "cloud:survivor", kept
    await wire.close()


async def kept_answer(cluster: Cluster, token_subj: str) -> object:
    """The answer kept for the request's site (MESH_ANSWERS), or None."""
    assert cluster.conn is not None
    scope, request_id = address_of(token_subj)
    try:
        msg = await cluster.conn.jsm().get_msg(
            ANSWERS_STREAM, subject=answer_subject(scope, request_id), direct=True
        )
    except Exception:
        return None
    return decode_event(msg.data or b"")
