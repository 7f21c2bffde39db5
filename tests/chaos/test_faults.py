"""Fault tests: every accepted request ends in exactly one complete, correct answer or one typed
error, never a lost, truncated, gapped, duplicated or foreign one.

Real nats-server (file storage), real ``mesh worker`` and ``mesh edge`` processes on the
deterministic backend, faults made by killing processes by PID, cutting links with a proxy, and
restarting the server on the same port and store. Every answer is checked exactly.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from mesh.testing.chaos import (
    Outcome,
    Tally,
    ask,
    assert_in_flight,
    expected_text,
    free_port,
    prompt,
    under_way,
)
from tests.chaos.conftest import Cluster

pytestmark = pytest.mark.chaos


async def wait_tokens_flowing(cluster: Cluster, seconds: float) -> None:
    """Let answers get going before the fault (a fixed lead time is the test's design)."""
    await asyncio.sleep(seconds)


async def test_kill_9_a_worker_mid_stream(cluster: Cluster) -> None:
    doomed = await cluster.worker("doomed", slots=8)
    http_port = free_port()
    await cluster.edge(MESH_EDGE_HTTP_PORT=str(http_port))
    client = await cluster.client()
    tally = Tally()
    n = 250  # tokens at 20 ms: answers take 5 s, still streaming once the survivor is up
    started = [asyncio.Event() for _ in range(4)]
    asks = [
        ask(client, f"e{i}", n, via="edge", route="cloud", first_token=started[i]) for i in range(2)
    ]
    asks += [ask(client, f"c{i}", n, via="cloud", first_token=started[2 + i]) for i in range(2)]
    # What the `nats` CLI sends (JSON in, one JSON answer out), and an OpenAI SSE client.
    asks += [nats_req(cluster, f"n{i}", n) for i in range(2)]
    asks += [sse(http_port, f"s{i}", n) for i in range(2)]
    pending = [asyncio.ensure_future(a) for a in asks]
    await under_way(started)
    survivor = await cluster.worker("survivor", slots=6)
    assert_in_flight(pending)
    killed_at = time.monotonic()
    doomed.kill()
    for outcome in await asyncio.gather(*pending):
        tally.add(outcome)
    print("\n" + tally.row("kill -9 worker mid-stream"))
    continued = [o for o in tally.outcomes if o.first_continued is not None]
    print(
        "failover (kill to first continued token):",
        sorted(round(o.first_continued - killed_at, 2) for o in continued),
    )
    tally.assert_sound()
    assert survivor.proc is not None
    assert tally.counts()["correct"] == len(asks), cluster.logs()
    assert continued, "no answer was continued by the survivor"
    assert all(o.restarts == 0 for o in tally.outcomes if o.path == "cloud")


async def nats_req(cluster: Cluster, tag: str, n: int) -> Outcome:
    """`nats req mesh.v1.edge.<id>.infer '{"prompt": ..., "route": "cloud"}'`, byte for byte."""
    from protocol.subjects import edge_infer_subject
    from tests.nats_wire import RawNatsClient

    cli = await RawNatsClient().connect(cluster.server.url)
    began = time.monotonic()
    try:
        body = {"prompt": prompt(tag), "max_tokens": n, "route": "cloud"}
        reply = await cli.request(
            edge_infer_subject(cluster.edge_id), json.dumps(body).encode(), timeout=30
        )
    except asyncio.TimeoutError:
        return Outcome("lost", "nats req timed out")
    finally:
        await cli.close()
    answer = reply.json()
    if answer.get("t") == "err":
        return Outcome("typed", answer["code"])
    ok = answer.get("t") == "answer" and answer["text"] == expected_text(tag, n)
    return Outcome(
        "correct" if ok else "corrupt",
        "" if ok else str(answer)[:200],
        path=answer.get("path", ""),
        elapsed=time.monotonic() - began,
    )


async def sse(http_port: int, tag: str, n: int) -> Outcome:
    """An OpenAI client streaming chat completions from the edge over HTTP (SSE)."""
    import aiohttp

    body = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": prompt(tag)}],
        "max_tokens": n,
        "stream": True,
        "route": "cloud",
    }
    parts: list[str] = []
    finish = None
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=40)) as session,
        session.post(f"http://127.0.0.1:{http_port}/v1/chat/completions", json=body) as resp,
    ):
        if resp.status != 200:
            return Outcome("typed", f"HTTP {resp.status}")
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return Outcome("typed", chunk["error"]["code"])
            for choice in chunk.get("choices", []):
                parts.append(choice["delta"].get("content", ""))
                finish = choice.get("finish_reason") or finish
    if finish is None:
        return Outcome("lost", "the SSE stream ended without a finish reason")
    ok = "".join(parts) == expected_text(tag, n)
    return Outcome("correct" if ok else "corrupt", "" if ok else "".join(parts)[-80:], path="cloud")


async def test_nats_server_restart_with_answers_in_flight(cluster: Cluster) -> None:
    await cluster.worker("w1", slots=6)
    await cluster.edge()
    client = await cluster.client()
    tally = Tally()
    n = 120  # 2.4 s answers: the restart lands mid-answer
    asks = [ask(client, f"e{i}", n, via="edge", route="cloud") for i in range(3)]
    asks += [ask(client, f"c{i}", n, via="cloud") for i in range(3)]
    pending = [asyncio.ensure_future(a) for a in asks]
    await wait_tokens_flowing(cluster, 0.8)
    await cluster.server.restart(outage=3.0)
    for outcome in await asyncio.gather(*pending):
        tally.add(outcome)
    print("\n" + tally.row("nats-server restart (SIGTERM, 3 s, same store)"))
    tally.assert_sound()
    # The control plane came back by itself: the edge escalates again within seconds.
    began = time.monotonic()
    after = await ask(client, "after", 10, via="edge", route="cloud")
    assert after.kind == "correct" and after.path == "cloud", (after, cluster.logs())
    took = time.monotonic() - began
    print(f"first escalation after the restart answered by the cloud in {took:.2f}s")
    assert tally.counts()["correct"] == len(asks), cluster.logs()


async def test_client_link_cut_for_two_seconds(cluster: Cluster) -> None:
    await cluster.worker("w1", slots=6)
    await cluster.edge()
    link = await cluster.proxy()
    client = await cluster.client(link.url)
    tally = Tally()
    n = 100
    asks = [ask(client, f"e{i}", n, via="edge", route="cloud") for i in range(3)]
    asks += [ask(client, f"l{i}", n, via="edge", route="local") for i in range(2)]
    asks += [ask(client, f"c{i}", n, via="cloud") for i in range(3)]
    pending = [asyncio.ensure_future(a) for a in asks]
    await wait_tokens_flowing(cluster, 0.6)
    link.cut(2.0)
    for outcome in await asyncio.gather(*pending):
        tally.add(outcome)
    print("\n" + tally.row("client link cut 2 s"))
    tally.assert_sound()
    assert tally.counts()["correct"] == len(asks), cluster.logs()


async def test_edge_link_cut_for_five_seconds(cluster: Cluster) -> None:
    await cluster.worker("w1", slots=6)
    link = await cluster.proxy()
    await cluster.edge(url=link.url)
    client = await cluster.client()
    tally = Tally()
    n = 60  # 1.2 s: the cloud finishes these while the edge is cut off
    pending = [
        asyncio.ensure_future(ask(client, f"e{i}", n, via="edge", route="cloud")) for i in range(5)
    ]
    await wait_tokens_flowing(cluster, 0.5)
    link.cut(5.0)
    for outcome in await asyncio.gather(*pending):
        tally.add(outcome)
    print("\n" + tally.row("edge link cut 5 s"))
    tally.assert_sound()
    assert tally.counts()["correct"] == 5, cluster.logs()
    assert all(o.path == "cloud" for o in tally.outcomes)  # finished by the cloud, not redone


async def test_worker_link_cut_shorter_and_longer_than_ack_wait(cluster: Cluster) -> None:
    link = await cluster.proxy()
    await cluster.worker("flaky", url=link.url, slots=4)
    await cluster.edge()
    client = await cluster.client()
    for outage, fault in ((2.0, "worker link cut 2 s"), (7.0, "worker link cut 7 s (> ack_wait)")):
        if outage > 5:
            await cluster.worker("steady", slots=4)  # takes over while the flaky one is away
        tally = Tally()
        n = 80
        asks = [ask(client, f"e{i}", n, via="edge", route="cloud") for i in range(2)]
        asks += [ask(client, f"c{i}", n, via="cloud") for i in range(2)]
        pending = [asyncio.ensure_future(a) for a in asks]
        await wait_tokens_flowing(cluster, 0.6)
        link.cut(outage)
        for outcome in await asyncio.gather(*pending):
            tally.add(outcome)
        print("\n" + tally.row(fault))
        tally.assert_sound()
        assert tally.counts()["correct"] == len(asks), cluster.logs()


async def test_slow_consumer_drops_are_fetched_again(cluster: Cluster) -> None:
    await cluster.worker("w1", slots=6, token_ms=1)
    await cluster.edge()
    # A client that buffers at most 4 messages per stream and reads slowly: NATS drops the rest.
    client = await cluster.client(pending_limit=4)
    tally = Tally()

    async def slow(tag: str, **kw: object) -> None:
        from protocol.errors import MeshError

        parts: list[str] = []
        try:
            async for event in client.stream(f"[tag:{tag}] go", max_tokens=200, **kw):  # type: ignore[arg-type]
                await asyncio.sleep(0.01)
                if hasattr(event, "text"):
                    parts.append(event.text)
                elif type(event).__name__ == "RestartEvent":
                    parts.clear()
        except MeshError as err:
            from mesh.testing.chaos import Outcome

            tally.add(Outcome("lost" if err.code.value == "timeout" else "typed", err.message))
            return
        from mesh.testing.chaos import Outcome, expected_text

        ok = "".join(parts) == expected_text(tag, 200)
        tally.add(Outcome("correct" if ok else "corrupt", "" if ok else "".join(parts)[-80:]))

    await asyncio.gather(
        *(slow(f"e{i}", via="edge", route="cloud") for i in range(2)),
        *(slow(f"c{i}", via="cloud") for i in range(2)),
    )
    print("\n" + tally.row("slow consumer (4-message buffer)"))
    tally.assert_sound()
    assert tally.counts()["correct"] == 4


async def test_hung_engine_and_dead_fleet_fall_back_to_local_within_5_s(cluster: Cluster) -> None:
    worker = await cluster.worker("w1", slots=4)
    await cluster.edge()
    client = await cluster.client()
    tally = Tally()
    hung = await asyncio.gather(
        *(ask(client, f"h{i}", 20, "[hang]", via="edge", route="cloud") for i in range(3))
    )
    for outcome in hung:
        tally.add(outcome)
    worker.kill()
    await asyncio.sleep(0.2)  # the fleet is dead now; the registry will say so within node_ttl
    dead = await asyncio.gather(
        *(ask(client, f"d{i}", 20, via="edge", route="cloud") for i in range(3))
    )
    for outcome in dead:
        tally.add(outcome)
    print("\n" + tally.row("hung engine, then every worker dead"))
    print("time to the whole local answer:", sorted(round(o.elapsed, 2) for o in tally.outcomes))
    tally.assert_sound()
    assert all(o.kind == "correct" and o.path == "local" for o in tally.outcomes), tally.outcomes
    assert max(o.elapsed for o in tally.outcomes) < 5.0


async def test_an_engine_that_errors_mid_stream_never_makes_a_complete_answer(
    cluster: Cluster,
) -> None:
    """``data: {"error": ...}`` then ``[DONE]`` from an OpenAI-compatible server, and an
    in-process engine failure: typed errors, after the consumer's deliveries, not answers. Via
    an edge the local model answers afresh instead (its restart after the cloud's first tokens:
    review S20c), one complete answer."""
    server = await cluster.openai_server(token_ms=10)
    await cluster.worker("http", backend_url=server, slots=4)
    await cluster.edge()
    client = await cluster.client()
    tally = Tally()
    outcomes = await asyncio.gather(
        ask(client, "x0", 30, "[sse-error-after:5]", via="cloud"),
        ask(client, "x1", 30, "[sse-error-after:5]", via="edge", route="cloud"),
        ask(client, "x2", 30, "[fail-after:5]", via="cloud"),
        ask(client, "ok", 30, via="cloud"),  # a healthy request beside them completes
    )
    for outcome in outcomes:
        tally.add(outcome)
    print("\n" + tally.row("engine error mid-stream (SSE error event, engine failure)"))
    tally.assert_sound()
    assert [o.kind for o in outcomes] == ["typed", "correct", "typed", "correct"], outcomes
    assert outcomes[0].detail == "max_deliveries" and outcomes[1].path == "local"


async def test_ten_times_overload_loses_nothing_and_memory_stays_flat(cluster: Cluster) -> None:
    workers = [await cluster.worker(f"w{i}", slots=4, token_ms=5) for i in range(2)]
    edge = await cluster.edge()
    client = await cluster.client()
    capacity = 8
    rss: list[int] = []
    for round_no in range(2):
        tally = Tally()
        asks = [ask(client, f"r{round_no}c{i}", 30, via="cloud") for i in range(6 * capacity)]
        asks += [
            ask(client, f"r{round_no}e{i}", 30, via="edge", route="cloud")
            for i in range(4 * capacity)
        ]
        for outcome in await asyncio.gather(*asks):
            tally.add(outcome)
        rss.append(sum(p.rss_kib() for p in [*workers, edge]))
        print("\n" + tally.row(f"10x overload, round {round_no + 1}"))
        tally.assert_sound()
        assert tally.counts()["correct"] + tally.counts()["typed"] == len(asks)
    print(
        f"worker+edge RSS after round 1: {rss[0] / 1024:.1f} MiB, round 2: {rss[1] / 1024:.1f} MiB"
    )
    assert rss[1] < rss[0] * 1.15 + 8 * 1024  # flat: the second round does not keep growing


async def test_kill_9_when_the_backend_cannot_continue(cluster: Cluster) -> None:
    """An OpenAI-compatible server without vLLM's continuation: the next worker starts over.
    The SDK yields a restart, then the whole answer; an SSE client, which cannot take text
    back, gets one typed error; `nats req` gets one whole answer."""
    server = await cluster.openai_server(token_ms=20)
    doomed = await cluster.worker("doomed", backend_url=server, continuation="off", slots=8)
    http_port = free_port()
    await cluster.edge(MESH_EDGE_HTTP_PORT=str(http_port))
    client = await cluster.client()
    n = 250  # 5 s at 20 ms a token: still streaming once the survivor is up
    started = [asyncio.Event() for _ in range(4)]
    asks = [
        ask(client, f"e{i}", n, via="edge", route="cloud", first_token=started[i]) for i in range(2)
    ]
    asks += [ask(client, f"c{i}", n, via="cloud", first_token=started[2 + i]) for i in range(2)]
    asks += [nats_req(cluster, "n0", n), sse(http_port, "s0", n)]
    pending = [asyncio.ensure_future(a) for a in asks]
    await under_way(started)
    await cluster.worker("survivor", backend_url=server, continuation="off", slots=8)
    assert_in_flight(pending)
    doomed.kill()
    tally = Tally()
    outcomes = await asyncio.gather(*pending)
    for outcome in outcomes:
        tally.add(outcome)
    print("\n" + tally.row("kill -9, backend cannot continue"))
    tally.assert_sound()
    sdk, sse_outcome = outcomes[:5], outcomes[5]
    assert all(o.kind == "correct" for o in sdk), sdk
    assert sum(o.restarts for o in sdk[:4]) >= 1  # SDK streams saw the answer start over
    assert (sse_outcome.kind, sse_outcome.detail) == ("typed", "incomplete"), sse_outcome
