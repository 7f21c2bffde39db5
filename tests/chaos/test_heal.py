"""Heal on events, not timers: a worker killed mid-answer has its answers continued by another
worker, and a fleet killed mid-answer has the edge answer locally, long before ``ack_wait``.

``ack_wait`` is 30 s here, so only the event path (the reader's "are you there?", the server's
"no responders", a live worker handing the delivery back) can explain an answer continued within
seconds. Real worker and edge processes, kill -9 by PID, every answer checked exactly.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Sequence

import pytest

from mesh.testing.chaos import Outcome, Tally, ask, assert_in_flight, paused, under_way
from tests.chaos.conftest import Cluster

pytestmark = pytest.mark.chaos

LONG_ACK_WAIT = {"MESH_STREAM_ACK_WAIT": "30"}
WITHIN_S = 5.0
"""Far below ack_wait (30 s): a bound the timer path cannot meet, loose for a busy machine."""


async def _tally(pending: Sequence[Awaitable[Outcome]]) -> Tally:
    tally = Tally()
    for outcome in await asyncio.wait_for(asyncio.gather(*pending), 60):
        tally.add(outcome)
    return tally


def _since(fault: float, moments: list[float | None]) -> list[float]:
    """Seconds from the fault to each moment that came (sorted, rounded for the print)."""
    return sorted(round(m - fault, 2) for m in moments if m is not None)


async def test_kill_9_continues_on_another_worker_long_before_ack_wait(cluster: Cluster) -> None:
    doomed = await cluster.worker("doomed", slots=8, extra_env=LONG_ACK_WAIT)
    await cluster.edge(**LONG_ACK_WAIT)
    client = await cluster.client()
    n = 250  # tokens at 20 ms: 5 s, longer than a slow machine takes to start the survivor
    started = [asyncio.Event() for _ in range(6)]
    asks = [
        ask(client, f"e{i}", n, via="edge", route="cloud", first_token=started[i]) for i in range(3)
    ]
    asks += [ask(client, f"c{i}", n, via="cloud", first_token=started[3 + i]) for i in range(3)]
    pending = [asyncio.ensure_future(a) for a in asks]
    await under_way(started)
    await cluster.worker("survivor", slots=8, extra_env=LONG_ACK_WAIT)
    assert_in_flight(pending)
    killed_at = time.monotonic()
    doomed.kill()
    tally = await _tally(pending)
    waits = _since(killed_at, [o.first_continued for o in tally.outcomes])
    print("\n" + tally.row("kill -9, ack_wait 30 s"), "kill -> first continued token:", waits)
    tally.assert_sound()
    assert tally.counts()["correct"] == len(asks), cluster.logs()
    assert all(o.path == "cloud" and o.restarts == 0 for o in tally.outcomes), tally.outcomes
    assert len(waits) == len(asks), f"not every answer was continued: {tally.outcomes}"
    assert max(waits) < WITHIN_S, f"continued only after {max(waits)} s: {cluster.logs()}"
    from tests.chaos.test_pauses import worker_status

    status = await worker_status(cluster, "survivor")
    assert status["handed_back"] == len(asks) and status["continued"] == len(asks), status


async def test_fleet_killed_mid_answer_edge_answers_locally_long_before_ack_wait(
    cluster: Cluster,
) -> None:
    doomed = await cluster.worker("only", slots=8, extra_env=LONG_ACK_WAIT)
    await cluster.edge(**LONG_ACK_WAIT)
    client = await cluster.client()
    n = 80
    pending = [
        asyncio.ensure_future(ask(client, f"f{i}", n, via="edge", route="cloud")) for i in range(3)
    ]
    await asyncio.sleep(0.6)
    killed_at = time.monotonic()
    doomed.kill()
    tally = await _tally(pending)
    local = _since(killed_at, [o.first_restarted for o in tally.outcomes])
    print("\n" + tally.row("every worker killed, ack_wait 30 s"), "kill -> first local:", local)
    tally.assert_sound()
    assert all(o.kind == "correct" and o.path == "local" for o in tally.outcomes), tally.outcomes
    assert len(local) == len(pending), "each answer restarts locally, announced"
    assert max(local) < WITHIN_S, cluster.logs()


async def test_a_request_sent_just_after_the_fleet_died_is_answered_locally_at_once(
    cluster: Cluster,
) -> None:
    """The registry still shows the killed worker for its ttl (3 s). A request that waits
    unstarted has the edge ask the workers the registry shows whether they are there: the
    server says nobody listens for the dead one, the view forgets it, and with no worker left
    the edge answers locally. It used to wait for the entry to age out (3.01 s here)."""
    doomed = await cluster.worker("only", slots=8)
    await cluster.edge()
    client = await cluster.client()
    warm = await ask(client, "warm", 5, via="edge", route="cloud")
    assert (warm.kind, warm.path) == ("correct", "cloud"), warm
    doomed.kill()
    began = time.monotonic()
    outcome = await ask(client, "after", 5, via="edge", route="cloud")
    waited = outcome.token_times[0] - began if outcome.token_times else None
    print(f"\nfleet killed -> a new request's first (local) token: {waited}")
    assert (outcome.kind, outcome.path) == ("correct", "local"), outcome
    assert waited is not None and waited < 2.0, cluster.logs()


async def test_an_edge_killed_mid_answer_ends_its_clients_answers_typed_at_once(
    cluster: Cluster,
) -> None:
    """What an edge relayed lived in its memory: killed, its answers cannot go on. Each client
    ends in one typed ``incomplete`` once nobody has answered for the edge for
    ``edge_gone_after`` (3 s here: an edge whose link is down keeps its answers, and the
    5 s link cut in test_faults.py is waited out), not in its idle timeout's silence (30 s
    here; it used to be exactly that)."""
    await cluster.worker("w", slots=8)
    edge = await cluster.edge()
    client = await cluster.client(edge_gone_after=3.0)  # idle timeout 30 s
    started = [asyncio.Event() for _ in range(2)]
    asks = [
        ask(client, "viacloud", 150, via="edge", route="cloud", first_token=started[0]),
        ask(client, "local", 600, via="edge", route="local", first_token=started[1]),
    ]
    pending = [asyncio.ensure_future(a) for a in asks]
    await under_way(started)
    assert_in_flight(pending)
    edge.kill()
    killed_at = time.monotonic()
    tally = await _tally(pending)
    ended = [round(time.monotonic() - killed_at, 2)]
    print("\n" + tally.row("edge kill -9 mid-answer"), "kill -> the last typed error:", ended)
    tally.assert_sound()
    assert [(o.kind, o.detail) for o in tally.outcomes] == [("typed", "incomplete")] * 2, tally
    assert 3.0 <= ended[0] < 10.0, ended


async def test_a_frozen_worker_is_taken_over_long_before_ack_wait_and_lets_go(
    cluster: Cluster,
) -> None:
    """SIGSTOP mid-answer: the reader's "are you there?" goes unanswered, a live worker asks
    for itself, gets no word either, and hands the delivery back. The frozen worker, once
    resumed, knows it stood still: it checks the store, sees the newer attempt and stops, and
    settles nothing (the survivor's delivery stays protected)."""
    from tests.chaos.test_pauses import drained, idle, worker_status
    from tests.helpers import eventually

    frozen = await cluster.worker("frozen", slots=8, extra_env=LONG_ACK_WAIT)
    await cluster.edge(**LONG_ACK_WAIT)
    client = await cluster.client()
    n = 150  # 3 s at 20 ms a token
    asks = [ask(client, f"e{i}", n, via="edge", route="cloud") for i in range(2)]
    asks += [ask(client, f"c{i}", n, via="cloud") for i in range(2)]
    pending = [asyncio.ensure_future(a) for a in asks]
    await cluster.worker("survivor", slots=8, extra_env=LONG_ACK_WAIT)
    await asyncio.sleep(0.8)
    with paused(frozen.pid):
        frozen_at = time.monotonic()
        await asyncio.sleep(4.0)  # the pause length is the fault
    tally = await _tally(pending)
    waits = _since(frozen_at, [o.first_continued for o in tally.outcomes])
    print("\n" + tally.row("SIGSTOP 4 s, ack_wait 30 s"), "freeze -> first continued:", waits)
    tally.assert_sound()
    assert all(o.kind == "correct" and o.restarts == 0 for o in tally.outcomes), tally.outcomes
    assert len(waits) == len(asks) and max(waits) < WITHIN_S, (waits, cluster.logs())
    await drained(cluster)
    await eventually(lambda: idle(cluster, "frozen"), 15, "the resumed worker let go")
    status = await worker_status(cluster, "frozen")
    assert status["completed"] == 0 and status["superseded"] == len(asks), status


async def test_an_engine_that_stands_still_mid_answer_has_the_edge_answer_locally_within_3_s(
    cluster: Cluster,
) -> None:
    """The worker lives, but its engine stops producing mid-answer: the worker says so when the
    reader asks (no token for 2 s on any answer it holds), and the edge restarts the answer
    locally, announced. Before, the edge waited for its idle timeout (15 s)."""
    await cluster.worker("w1", slots=8, extra_env=LONG_ACK_WAIT)
    await cluster.edge(**LONG_ACK_WAIT)
    client = await cluster.client()
    began = time.monotonic()
    tally = await _tally(
        [ask(client, f"s{i}", 80, "[hang-after:20]", via="edge", route="cloud") for i in range(3)]
    )
    outcomes = tally.outcomes
    hung_at = began + 0.02 + 20 * 0.02  # the prefill, then 20 tokens at 20 ms
    local = _since(hung_at, [o.first_restarted for o in outcomes])
    print("\n" + tally.row("engine stands still after 20 tokens"), "hang -> first local:", local)
    tally.assert_sound()
    assert all(o.kind == "correct" and o.path == "local" for o in outcomes), outcomes
    assert len(local) == len(outcomes) and max(local) < 3.0, (local, cluster.logs())


async def test_a_slow_engine_is_never_taken_for_one_that_stands_still(cluster: Cluster) -> None:
    """1.2 s between tokens, under the 2 s bound: the reader asks again and again, the worker
    says it is there and not stalled, and the answer comes from the cloud, whole."""
    await cluster.worker("slow", slots=4, token_ms=1200)
    await cluster.edge()
    client = await cluster.client()
    outcome = await ask(client, "slow", 4, via="edge", route="cloud")
    assert outcome.kind == "correct" and outcome.path == "cloud", (outcome, cluster.logs())
    assert outcome.restarts == 0 and outcome.attempts == 1, outcome


async def test_a_worker_stopped_with_answers_in_flight_hands_them_over_without_a_pause(
    cluster: Cluster,
) -> None:
    """SIGTERM while another worker has room: the stopping worker hands every answer in flight
    back to the queue at once (no drain wait), the other continues each from the store, and no
    client's answer stands still for a second; the stopped worker exits well within its 30 s
    drain grace."""
    from tests.chaos.test_pauses import drained

    grace = {"MESH_WORKER_DRAIN_GRACE": "30"}
    leaving = await cluster.worker("leaving", slots=8, extra_env=grace)
    await cluster.edge()
    client = await cluster.client()
    n = 250  # 5 s at 20 ms a token: still streaming once the other worker is up
    started = [asyncio.Event() for _ in range(4)]
    asks = [
        ask(client, f"e{i}", n, via="edge", route="cloud", first_token=started[i]) for i in range(2)
    ]
    asks += [ask(client, f"c{i}", n, via="cloud", first_token=started[2 + i]) for i in range(2)]
    pending = [asyncio.ensure_future(a) for a in asks]
    await under_way(started)
    await cluster.worker("staying", slots=8, extra_env=grace)
    assert_in_flight(pending)
    stopping = time.monotonic()
    await leaving.stop()
    stopped_in = time.monotonic() - stopping
    tally = await _tally(pending)
    silences = [o.longest_silence or 0.0 for o in tally.outcomes]
    print(
        "\n" + tally.row("worker SIGTERM, answers handed over"),
        f"stopped in {stopped_in:.2f}s; longest silence per answer:",
        sorted(round(s, 2) for s in silences),
    )
    tally.assert_sound()
    assert all(
        o.kind == "correct" and o.restarts == 0 and o.attempts == 2 for o in tally.outcomes
    ), (stopped_in, tally.outcomes, cluster.logs())
    assert stopped_in < 10.0, (stopped_in, cluster.logs())  # not the 30 s drain
    assert max(silences) < 1.0, silences
    await drained(cluster)
