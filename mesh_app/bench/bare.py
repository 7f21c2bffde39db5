"""The floors ``mesh bench paths`` (and ``relay``, ``scripts/ab_bench.py``) set the mesh beside:
bare nats-py processes doing the least a relay can do, as anyone would write them.

- the bare relay (``--bare NATS_URL BACKEND_URL``): a request on a core subject, the engine called
  over HTTP, each token published to the reply inbox, an empty message last;
- the same process takes requests from a JetStream work queue too (the bare queue), as nats-py's
  JetStream API is plainly used: :data:`QUEUE_PULLERS` loops, each ``fetch``ing one message at
  a time, the reply inbox in a header, the message acked once the answer is out;
- the bare middle (``--middle NATS_URL``): each request on to the bare relay, each message coming
  back published again to its client; on :data:`QUEUED_MIDDLE_SUBJECT` it hands each request to
  the bare queue instead (``js.publish``, its ack awaited), the shape of a request an edge
  escalates: client -> middle -> work queue -> relay -> middle -> client.

Run as ``python -m mesh_app.bench.bare``; :func:`bare_process` starts one and yields its pid.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from collections.abc import AsyncIterator, Coroutine
from typing import Any

import aiohttp
import nats
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, RetentionPolicy, StorageType
from nats.js.client import JetStreamContext

from mesh_app.bench.common import Timed

BARE_SUBJECT = "bench.bare.request"
MIDDLE_SUBJECT = "bench.middle.request"
QUEUED_MIDDLE_SUBJECT = "bench.middle.queued"
QUEUE_STREAM = "BENCH_BARE_QUEUE"
QUEUE_SUBJECT = "bench.queue.request"
QUEUE_REPLY = "Bench-Reply"
"""The header naming a queued request's reply inbox (JetStream keeps headers, not replies)."""
QUEUE_PULLERS = 64
"""Pull requests the bare queue keeps waiting, one per loop: more than the most streams run."""


def deltas(line: bytes) -> list[str]:
    """The content deltas of one SSE line of a chat completion stream."""
    line = line.strip()
    if not line.startswith(b"data: ") or line == b"data: [DONE]":
        return []
    choices = json.loads(line[6:]).get("choices") or []
    return [text for c in choices if (text := (c.get("delta") or {}).get("content"))]


async def bare(
    nc: NATS, prompt: str, tokens: int, subject: str = BARE_SUBJECT, *, queued: bool = False
) -> Timed:
    """One request through the bare relay (or the bare middle in front of it, on its
    ``subject``; or, ``queued``, through the bare queue, once the store acked it): tokens on
    the reply inbox, an empty message last."""
    arrived: asyncio.Queue[bytes] = asyncio.Queue()

    async def on_msg(msg: Msg) -> None:
        arrived.put_nowait(msg.data)

    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox, cb=on_msg)
    began = time.perf_counter()
    first: float | None = None
    got = 0
    try:
        body = json.dumps({"prompt": prompt, "max_tokens": tokens}).encode()
        if queued:
            await nc.jetstream().publish(QUEUE_SUBJECT, body, headers={QUEUE_REPLY: inbox})
        else:
            await nc.publish(subject, body, reply=inbox)
        while await asyncio.wait_for(arrived.get(), 60):
            first = first or time.perf_counter()
            got += 1
    finally:
        await sub.unsubscribe()
    done = time.perf_counter()
    return Timed(ttft=(first or done) - began, total=done - began, tokens=got)


async def _serve_bare(nats_url: str, backend_url: str) -> None:
    """The bare relay process (``python -m mesh_app.bench.bare --bare URL BACKEND``)."""
    nc = await nats.connect(nats_url)
    running: set[asyncio.Task[None]] = set()
    async with aiohttp.ClientSession() as session:

        async def handle(data: bytes, reply: str) -> None:
            ask = json.loads(data)
            body = {
                "model": "smollm2",
                "messages": [{"role": "user", "content": ask["prompt"]}],
                "max_tokens": ask["max_tokens"],
                "stream": True,
            }
            async with session.post(f"{backend_url}/chat/completions", json=body) as resp:
                async for raw in resp.content:
                    for text in deltas(raw):
                        await nc.publish(reply, text.encode())
            await nc.publish(reply, b"")

        def run(work: Coroutine[Any, Any, None]) -> None:
            task = asyncio.create_task(work)
            running.add(task)
            task.add_done_callback(running.discard)

        async def on_msg(msg: Msg) -> None:
            run(handle(msg.data, msg.reply))

        async def answer_queued(msg: Msg) -> None:
            assert msg.headers is not None
            await handle(msg.data, msg.headers[QUEUE_REPLY])
            await msg.ack()

        async def pull(puller: JetStreamContext.PullSubscription) -> None:
            while True:
                with contextlib.suppress(nats.errors.TimeoutError):
                    for msg in await puller.fetch(1, timeout=30):
                        run(answer_queued(msg))

        await nc.subscribe(BARE_SUBJECT, queue="bare", cb=on_msg)
        js = nc.jetstream()
        await js.add_stream(
            name=QUEUE_STREAM,
            subjects=[QUEUE_SUBJECT],
            retention=RetentionPolicy.WORK_QUEUE,
            storage=StorageType.FILE,
        )
        await js.add_consumer(
            QUEUE_STREAM, durable_name="bare", ack_policy=AckPolicy.EXPLICIT, ack_wait=30
        )
        for _ in range(QUEUE_PULLERS):
            run(pull(await js.pull_subscribe_bind("bare", QUEUE_STREAM)))
        await nc.flush()
        print("ready", flush=True)
        await asyncio.Event().wait()


async def _serve_middle(nats_url: str) -> None:
    """The bare middle process (``python -m mesh_app.bench.bare --middle URL``): each request
    goes on to the bare relay (to its work queue, on :data:`QUEUED_MIDDLE_SUBJECT`); each message
    coming back is published again to its client."""
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    running: set[asyncio.Task[None]] = set()

    async def relay_back(client: str, data: bytes, *, queued: bool) -> None:
        async def on_back(back: Msg) -> None:
            await nc.publish(client, back.data)
            if not back.data:
                await sub.unsubscribe()

        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox, cb=on_back)
        if queued:
            await js.publish(QUEUE_SUBJECT, data, headers={QUEUE_REPLY: inbox})
        else:
            await nc.publish(BARE_SUBJECT, data, reply=inbox)

    async def on_request(msg: Msg) -> None:
        await relay_back(msg.reply, msg.data, queued=False)

    async def on_queued(msg: Msg) -> None:
        # A task each: a callback awaiting the store's ack would hold up the requests behind it.
        task = asyncio.create_task(relay_back(msg.reply, msg.data, queued=True))
        running.add(task)
        task.add_done_callback(running.discard)

    await nc.subscribe(MIDDLE_SUBJECT, queue="middle", cb=on_request)
    await nc.subscribe(QUEUED_MIDDLE_SUBJECT, queue="middle", cb=on_queued)
    await nc.flush()
    print("ready", flush=True)
    await asyncio.Event().wait()


@contextlib.asynccontextmanager
async def bare_process(*args: str) -> AsyncIterator[int]:
    """This module run as a bare process (``--bare`` or ``--middle`` and their arguments)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "mesh_app.bench.bare", *args, stdout=asyncio.subprocess.PIPE
    )
    try:
        assert proc.stdout is not None
        await asyncio.wait_for(proc.stdout.readline(), 30)
        yield proc.pid
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    role = parser.add_mutually_exclusive_group(required=True)
    role.add_argument("--bare", nargs=2, metavar=("NATS_URL", "BACKEND_URL"))
    role.add_argument("--middle", metavar="NATS_URL")
    args = parser.parse_args()
    asyncio.run(_serve_bare(*args.bare) if args.bare else _serve_middle(args.middle))
