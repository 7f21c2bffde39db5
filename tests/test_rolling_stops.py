"""Ordered shutdown and restarts under load, as a user and an operator meet them (review S18d).

Real nats-server, real `mesh worker` / `mesh edge` processes signalled by PID where signals
matter; every answer checked exactly against the deterministic script. The tests whose comment
begins "Before the fix" failed on the code before it (the comment says what happened then);
the others are guards: they passed there too."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

from mesh.client import MeshClient
from mesh.config import MeshSettings
from mesh.connection import Connection
from mesh.testing.chaos import (
    MeshProcess,
    Tally,
    ask,
    assert_in_flight,
    wait_for_worker,
    worker_env,
)


async def _worker_proc(
    settings: MeshSettings,
    conn: Connection,
    tmp: Path,
    node_id: str,
    *,
    slots: int,
    token_ms: float,
    grace: float = 30.0,
) -> MeshProcess:
    env = worker_env(settings.nats.url or "", node_id, slots=slots, token_ms=token_ms)
    env["MESH_WORKER_DRAIN_GRACE"] = str(grace)
    env["MESH_STREAM_ACK_WAIT"] = "10"
    proc = await MeshProcess("worker", node_id, env, tmp / f"{node_id}.log").start()
    await wait_for_worker(conn, node_id, process=proc)
    return proc


# Before the fix (heal / maintenance without pauses): a worker stopped with SIGTERM handed
# EVERY answer in flight back to the queue as soon as ANY peer announced a free slot
# (mesh.registry.peers_with_room: `info.free > 0`), however few. A peer with one free slot
# continued one answer; the others stood still in the queue until that answer ended (2.05 and
# 4.07 s of silence here), when the stopping worker could have finished them itself within its
# drain grace. Now it hands over as many as its peers have free slots (peers_room), the rest
# drain here.
async def test_a_worker_stopped_hands_over_no_more_answers_than_its_peers_have_room_for(
    settings: MeshSettings, conn: Connection, tmp_path: Path
) -> None:
    leaving = await _worker_proc(settings, conn, tmp_path, "leaving", slots=3, token_ms=30)
    staying: MeshProcess | None = None
    client = MeshClient(settings=settings, first_event_timeout=30, idle_timeout=30)
    await client.connect()
    try:
        n = 80  # 2.4 s at 30 ms a token
        started = [asyncio.Event() for _ in range(3)]
        pending = [
            asyncio.ensure_future(ask(client, f"h{i}", n, via="cloud", first_token=started[i]))
            for i in range(3)
        ]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 20)
        staying = await _worker_proc(settings, conn, tmp_path, "staying", slots=1, token_ms=30)
        assert_in_flight(pending)
        os.kill(leaving.pid, signal.SIGTERM)
        tally = Tally()
        for outcome in await asyncio.wait_for(asyncio.gather(*pending), 30):
            tally.add(outcome)
    finally:
        await client.close()
        await leaving.stop()
        if staying is not None:
            await staying.stop()
    silences = sorted(round(o.longest_silence or 0.0, 2) for o in tally.outcomes)
    tally.assert_sound()
    assert all(o.kind == "correct" for o in tally.outcomes), tally.outcomes
    # Each answer stood still at most about a second (what the hand-over promises).
    assert max(silences) < 1.0, f"longest silence per answer: {silences}"


# Before the fix (first rule): a rolling restart of a worker pool under steady traffic. From
# `_stopping = True` until `Puller.stop()` (the registry delete in between) the stopping worker
# still kept pull requests open for its free slots and renewed them, and `Worker._accept` naked
# each delivery: JetStream handed the same request straight back to it, each time one delivery
# of `max_deliver` (3) gone. Then `Puller.stop()` unsubscribed the pull inboxes while the
# server still sent them messages: those were dropped by the client and waited out `ack_wait`.
# So a request that arrived as a worker stopped ended in `max_deliveries` (1 to 7 a run; no
# worker ever ran it) or waited `ack_wait`. Now the puller stops first, and ends its pull
# requests at the server (UNSUB, then a round trip with the callback still naking) before the
# rest of the stop.
async def test_a_rolling_restart_under_steady_traffic_loses_no_request(
    settings: MeshSettings, conn: Connection, tmp_path: Path
) -> None:
    """Three restarts in a row of a one-worker pool (SIGTERM, then a new worker), requests
    arriving all along. The race is narrow (the registry delete's round trip): about one
    restart in two loses or holds a request here."""
    client = MeshClient(settings=settings, first_event_timeout=20, idle_timeout=20)
    await client.connect()
    procs: list[MeshProcess] = []
    bad: list[tuple[int, int, str, str]] = []
    late: list[float] = []
    try:
        worker = await _worker_proc(settings, conn, tmp_path, "w0", slots=32, token_ms=2, grace=5)
        procs.append(worker)
        for cycle in range(1, 4):
            pending = []
            for i in range(300):  # steady traffic; the SIGTERM a third of the way in
                pending.append(asyncio.ensure_future(ask(client, f"c{cycle}r{i}", 3, via="cloud")))
                if i == 100:
                    os.kill(worker.pid, signal.SIGTERM)
                await asyncio.sleep(0.001)
            assert worker.proc is not None
            await asyncio.wait_for(worker.proc.wait(), 15)
            worker = await _worker_proc(
                settings, conn, tmp_path, f"w{cycle}", slots=32, token_ms=2, grace=5
            )
            procs.append(worker)
            replaced = time.monotonic()
            outcomes = await asyncio.wait_for(asyncio.gather(*pending), 40)
            late.append(round(time.monotonic() - replaced, 1))
            bad += [
                (cycle, i, o.kind, o.detail) for i, o in enumerate(outcomes) if o.kind != "correct"
            ]
    finally:
        await client.close()
        for proc in procs:
            await proc.stop()
    assert not bad, f"{len(bad)} requests not answered whole: {bad[:5]}"
    # Every request was queued (or handed back) when the new worker came: none waits out
    # ack_wait (10 s) after it.
    assert max(late) < 5.0, f"the last answer came {late}s after each new worker"


async def _post(url: str, body: dict[str, object]) -> tuple[int, dict[str, str], bytes]:
    import aiohttp

    async with aiohttp.ClientSession() as session, session.post(url, json=body) as resp:
        return resp.status, dict(resp.headers), await resp.read()


async def _sdk_outcome(client: MeshClient, tag: str, n: int, route: str) -> tuple[str, str, float]:
    """What one SDK client via the edge ends with: ('answer', text) or ('error', code)."""
    from protocol.errors import MeshError
    from protocol.messages import EndEvent, TokenEvent

    text = ""
    try:
        async for event in client.stream(f"[tag:{tag}] go", via="edge", route=route, max_tokens=n):
            if isinstance(event, TokenEvent):
                text += event.text
            elif isinstance(event, EndEvent):
                return "answer", text, time.monotonic()
    except MeshError as err:
        return "error", f"{err.code.value} retry_after={err.retry_after}", time.monotonic()
    return "nothing", text, time.monotonic()


# GUARD (found sound): SIGTERM to a `mesh edge` process with NATS (SDK streams, a raw JSON
# request) and HTTP (SSE, whole) answers in flight, local and escalated: each ends in one typed,
# retryable end within the grace and a second; requests arriving meanwhile are refused typed.
async def test_an_edge_sigterm_ends_every_client_once_and_typed(
    settings: MeshSettings, conn: Connection, tmp_path: Path
) -> None:
    import json

    import aiohttp

    from mesh.testing.chaos import edge_env, free_port, wait_for_edge
    from protocol.subjects import edge_infer_subject

    worker = await _worker_proc(settings, conn, tmp_path, "wk", slots=4, token_ms=50)
    edge_id = settings.edge.edge_id
    port = free_port()
    env = {**edge_env(settings.nats.url or "", edge_id, token_ms=50)}
    env["MESH_EDGE_HTTP_PORT"] = str(port)
    edge = await MeshProcess("edge", edge_id, env, tmp_path / "edge.log").start()
    client = MeshClient(settings=settings, edge_id=edge_id, first_event_timeout=20, idle_timeout=20)
    await client.connect()
    base = f"http://127.0.0.1:{port}"
    try:
        await wait_for_edge(conn, edge_id)
        n = 300  # 15 s of tokens at 50 ms: past the 1.5 s grace
        sdk_local = asyncio.ensure_future(_sdk_outcome(client, "sl", n, "local"))
        sdk_cloud = asyncio.ensure_future(_sdk_outcome(client, "sc", n, "cloud"))
        raw = asyncio.ensure_future(
            conn.nc.request(
                edge_infer_subject(edge_id),
                json.dumps({"prompt": "[tag:raw] go", "max_tokens": n, "route": "local"}).encode(),
                timeout=20,
            )
        )
        chat = f"{base}/v1/chat/completions"
        msgs = [{"role": "user", "content": "[tag:h] go"}]
        sse = asyncio.ensure_future(
            _post(chat, {"messages": msgs, "max_tokens": n, "stream": True, "route": "local"})
        )
        whole = asyncio.ensure_future(
            _post(chat, {"messages": msgs, "max_tokens": n, "route": "cloud"})
        )
        short = asyncio.ensure_future(
            _post(chat, {"messages": msgs, "max_tokens": 10, "route": "local"})
        )
        await asyncio.sleep(1.0)  # all under way
        session = aiohttp.ClientSession()  # a keep-alive connection for /ready
        async with session.get(f"{base}/ready") as resp:
            assert resp.status == 200
        os.kill(edge.pid, signal.SIGTERM)
        signalled = time.monotonic()
        await asyncio.sleep(0.3)
        ready_during = None
        try:
            async with session.get(f"{base}/ready") as resp:
                ready_during = resp.status
        except aiohttp.ClientError as exc:
            ready_during = type(exc).__name__
        await session.close()
        late = await conn.nc.request(
            edge_infer_subject(edge_id), b'{"prompt": "late", "max_tokens": 3}', timeout=5
        )
        late_sdk = await asyncio.wait_for(_sdk_outcome(client, "late", 3, "local"), 10)
        results = await asyncio.wait_for(asyncio.gather(sdk_local, sdk_cloud), 15)
        raw_reply = json.loads((await asyncio.wait_for(raw, 15)).data)
        sse_status, _, sse_body = await asyncio.wait_for(sse, 15)
        whole_status, whole_headers, whole_body = await asyncio.wait_for(whole, 15)
        short_status, _, _ = await asyncio.wait_for(short, 15)
        assert edge.proc is not None
        code = await asyncio.wait_for(edge.proc.wait(), 15)
    finally:
        await client.close()
        await edge.stop()
        await worker.stop()
    print("ready during stop:", ready_during, "late:", late.data[:200], "late sdk:", late_sdk)
    for kind, detail, at in results:
        assert kind == "error" and detail.startswith("unavailable"), (kind, detail)
        assert at - signalled < 1.5 + 2.0, at - signalled
    assert raw_reply.get("code") == "unavailable", raw_reply
    assert (
        sse_status == 200
        and b'"unavailable"' in sse_body
        and sse_body.rstrip().endswith(b"data: [DONE]")
    )
    assert whole_status == 503 and whole_headers.get("Retry-After") == "1", whole_body
    assert short_status == 200
    assert json.loads(late.data).get("t") == "err", late.data
    assert late_sdk[0] == "error", late_sdk
    assert code == 0


async def _mesh_up(tmp: Path, grace: float) -> tuple[asyncio.subprocess.Process, str, str]:
    """`mesh up` on deterministic engines; its process, NATS URL and edge id."""
    import re
    import sys

    env = {
        **os.environ,
        "MESH_WORKER_MODEL_BACKEND": "deterministic",
        "MESH_WORKER_MODEL_TOKEN_DELAY_MS": "50",
        "MESH_EDGE_MODEL_BACKEND": "deterministic",
        "MESH_EDGE_MODEL_FAULTS": "false",
        "MESH_EDGE_MODEL_TOKEN_DELAY_MS": "50",
        "MESH_EDGE_ROUTER_KIND": "heuristic",
        "MESH_EDGE_EDGE_ID": "upedge",
        "MESH_WORKER_DRAIN_GRACE": str(grace),
        "MESH_NATS_STORE_DIR": str(tmp / "store"),
    }
    env = {k: v for k, v in env.items() if not k.startswith("MESH_NATS_URL")}
    log = (tmp / "up.log").open("ab")
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "mesh_app.cli",
        "up",
        "--port",
        "-1",
        "--http-port",
        "-1",
        "--log-format",
        "json",
        stdout=asyncio.subprocess.PIPE,
        stderr=log,
        stdin=asyncio.subprocess.DEVNULL,
        env=env,
    )
    log.close()
    assert proc.stdout is not None
    line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
    match = re.search(r"NATS (nats://[\d.]+:\d+)", line)
    assert match, (line, (tmp / "up.log").read_text()[-2000:])
    return proc, match.group(1), "upedge"


# `mesh up` stopped with Ctrl-C while answering: the edge's clients end typed, a client of the
# cloud directly gets its whole answer (the worker drains), and the process exits 0; a second
# Ctrl-C during that drain ends it at once (docs/reliability.md: "A second signal while the
# ordered stop runs ends the process at once").
async def test_mesh_up_ctrl_c_while_answering_and_again_during_the_drain(tmp_path: Path) -> None:
    from mesh.config import load_settings

    proc, url, edge_id = await _mesh_up(tmp_path, grace=20)
    try:
        settings = load_settings({("nats", "url"): url, ("edge", "edge_id"): edge_id}, environ={})
        client = MeshClient(
            settings=settings, edge_id=edge_id, first_event_timeout=20, idle_timeout=20
        )
        await client.connect()
        edge_local = asyncio.ensure_future(_sdk_outcome(client, "ul", 300, "local"))
        direct = asyncio.ensure_future(ask(client, "ud", 300, via="cloud"))  # 15 s: in the drain
        await asyncio.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        first = await asyncio.wait_for(edge_local, 10)
        await asyncio.sleep(1.0)  # the worker drains the direct answer now
        assert proc.returncode is None, "it should still drain"
        proc.send_signal(signal.SIGINT)  # an operator who will not wait
        again = time.monotonic()
        code = await asyncio.wait_for(proc.wait(), 20)
        took = time.monotonic() - again
        direct.cancel()
        await asyncio.gather(direct, return_exceptions=True)
        await client.close()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    log = (tmp_path / "up.log").read_text(errors="replace")
    print(first, code, round(took, 2))
    assert first[0] == "error" and first[1].startswith("unavailable"), first
    assert took < 2.0, (
        f"exited {took:.1f}s after the second Ctrl-C (code {code}); log: {log[-1500:]}"
    )
