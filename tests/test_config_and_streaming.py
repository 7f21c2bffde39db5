"""Configuration mapping and token coalescing, no I/O."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from mesh.backends.base import Chunk
from mesh.config import describe_settings, env_name, load_settings
from mesh.generate import coalesce, generate_into
from protocol.errors import BackendError, InvalidRequestError
from protocol.messages import EndEvent, InferRequest, TokenEvent, TokenLogprob
from protocol.stream import AnswerState, AnswerWriter
from tests.helpers import eventually


def test_env_vars_map_onto_nested_fields() -> None:
    settings = load_settings(
        environ={
            "MESH_NATS_URL": "nats://hub:4222",
            "MESH_WORKER_MODEL_SLOTS": "4",
            "MESH_EDGE_ROUTER_THRESHOLD": "0.7",
            "MESH_STREAM_STORAGE": "memory",
            "MESH_LOG_LEVEL": "debug",
        }
    )
    assert settings.nats.servers() == ["nats://hub:4222"]
    assert settings.worker.model.slots == 4
    assert settings.edge.router.threshold == 0.7
    assert settings.stream.storage == "memory"
    assert settings.log.level == "debug"


def test_flags_override_env_and_defaults_stay() -> None:
    settings = load_settings(
        {("nats", "url"): "nats://flag:1"}, environ={"MESH_NATS_URL": "nats://env:2"}
    )
    assert settings.nats.url == "nats://flag:1"
    assert settings.stream.max_deliver == 3
    assert load_settings(environ={}).nats.servers() == ["nats://127.0.0.1:4222"]


def test_bad_config_value_names_the_env_var() -> None:
    with pytest.raises(InvalidRequestError) as excinfo:
        load_settings(environ={"MESH_WORKER_MODEL_SLOTS": "many"})
    assert "MESH_WORKER_MODEL_SLOTS" in str(excinfo.value)


def test_every_setting_is_documented() -> None:
    rows = describe_settings()
    assert len(rows) > 40
    undocumented = [env for env, _default, doc in rows if not doc]
    assert undocumented == []
    assert env_name(("worker", "model", "path")) == "MESH_WORKER_MODEL_PATH"


async def _chunks(texts: list[str], delay: float = 0.0) -> AsyncIterator[Chunk]:
    for text in texts:
        if delay:
            await asyncio.sleep(delay)
        yield Chunk(text=text)
    yield Chunk(finish_reason="stop")


async def test_coalesce_sends_first_token_alone_then_batches() -> None:
    out = [c async for c in coalesce(_chunks(list("abcdefgh")), max_parts=3, linger=0.01)]
    texts = [c.text for c in out if c.finish_reason is None]
    assert texts[0] == "a"
    assert "".join(texts) == "abcdefgh"
    assert all(len(t) <= 3 for t in texts)
    assert len(texts) < 8  # batching happened
    assert out[-1].finish_reason == "stop"


async def test_coalesce_without_linger_keeps_slow_tokens_separate() -> None:
    out = [c async for c in coalesce(_chunks(list("abc"), delay=0.02), max_parts=8, linger=0)]
    assert [c.text for c in out[:-1]] == ["a", "b", "c"]


async def test_coalesce_never_holds_back_a_token_of_a_slow_stream() -> None:
    """Tokens further apart than the linger go out as they come: the linger batches fast
    streams; it must not add latency to slow ones (each token here would otherwise wait 0.5 s)."""
    linger = 0.5
    received = asyncio.Event()
    late: list[str] = []

    async def slow() -> AsyncIterator[Chunk]:
        for text in "abc":
            await asyncio.sleep(linger * 1.2)  # longer apart than the linger
            received.clear()
            yield Chunk(text=text)
            try:  # the consumer must have it well before a linger has passed
                await asyncio.wait_for(received.wait(), linger * 0.8)
            except asyncio.TimeoutError:
                late.append(text)
        yield Chunk(finish_reason="stop")

    out = []
    async for chunk in coalesce(slow(), max_parts=16, linger=linger):
        out.append(chunk.text)
        received.set()
    assert out[:3] == ["a", "b", "c"]
    assert late == []


async def test_coalesce_sends_a_full_batch_without_waiting_out_the_linger() -> None:
    """A fast engine is never held back by the linger: a batch goes as soon as it is full. The
    engine here pauses every 10 tokens (as engines do between steps), so partial batches are
    common; with a 30 s linger, waiting one out would stall the whole answer."""

    async def bursty() -> AsyncIterator[Chunk]:
        for i in range(200):
            yield Chunk(text=f"{i} ")
            if i % 10 == 9:
                await asyncio.sleep(0)
        yield Chunk(finish_reason="stop")

    async def collect() -> list[Chunk]:
        return [c async for c in coalesce(bursty(), max_parts=16, linger=30)]

    out = await asyncio.wait_for(collect(), 10)
    texts = [c.text for c in out if c.finish_reason is None]
    assert "".join(texts) == "".join(f"{i} " for i in range(200))
    assert all(len(t.split()) <= 16 for t in texts)
    assert out[-1].finish_reason == "stop"


async def test_coalesce_sends_the_last_batch_at_once_when_the_engine_has_finished() -> None:
    """The engine's last tokens and its finish are queued together: nothing more can come, so
    the last partial batch does not wait out the linger (30 s here) before the end."""

    async def short() -> AsyncIterator[Chunk]:
        for text in ("a", "b", "c"):
            yield Chunk(text=text)
        yield Chunk(finish_reason="stop")

    async def collect() -> list[Chunk]:
        return [c async for c in coalesce(short(), max_parts=16, linger=30)]

    out = await asyncio.wait_for(collect(), 10)
    assert [c.text for c in out if c.finish_reason is None] == ["a", "bc"]
    assert out[-1].finish_reason == "stop"


async def test_coalesce_keeps_each_tokens_logprobs_with_its_batch() -> None:
    """Batched text carries one logprob per engine token, in order, none lost or repeated."""
    lps = [TokenLogprob(token=f"w{i} ", logprob=-i / 10) for i in range(40)]

    async def engine() -> AsyncIterator[Chunk]:
        for i, lp in enumerate(lps):
            yield Chunk(text=lp.token, logprobs=[lp])
            if i % 7 == 6:
                await asyncio.sleep(0)
        yield Chunk(finish_reason="stop")

    out = [c async for c in coalesce(engine(), max_parts=16, linger=30)]
    tokens = [c for c in out if c.finish_reason is None]
    assert len(tokens) < 40  # batched
    assert [lp for c in tokens for lp in c.logprobs or []] == lps
    for chunk in tokens:
        assert chunk.logprobs is not None and len(chunk.logprobs) == chunk.n
        assert chunk.text == "".join(lp.token for lp in chunk.logprobs)


async def test_coalesce_hung_engine_is_a_retryable_error() -> None:
    async def hangs_after_one() -> AsyncIterator[Chunk]:
        yield Chunk(text="x")
        await asyncio.Event().wait()
        yield Chunk(text="never")

    async def hangs_at_once() -> AsyncIterator[Chunk]:
        await asyncio.Event().wait()
        yield Chunk(text="never")

    for source, before in ((hangs_after_one(), ["x"]), (hangs_at_once(), [])):
        got: list[str] = []

        async def consume(src: AsyncIterator[Chunk] = source, out: list[str] = got) -> None:
            async for chunk in coalesce(src, max_parts=4, linger=0, stall=0.2):
                out.append(chunk.text)

        with pytest.raises(BackendError) as excinfo:
            await consume()
        assert excinfo.value.retryable
        assert got == before


def _is(test: Callable[[], bool]) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return test()

    return check


async def test_coalesce_cancelled_while_the_engine_is_slow_stays_a_cancel() -> None:
    """A slow stream is read in the caller's task, where the stall watchdog may interrupt it:
    a cancel from elsewhere (a client's) must stay a cancel, and a stream that goes on after
    the watchdog's checks must not be taken for a hung one."""
    gate = asyncio.Event()

    async def slow() -> AsyncIterator[Chunk]:
        for text in "ab":
            await asyncio.sleep(0.05)  # slower than the linger, within the stall bound
            yield Chunk(text=text)
        await gate.wait()
        yield Chunk(text="never")

    got: list[str] = []

    async def consume() -> None:
        async for chunk in coalesce(slow(), max_parts=4, linger=0.001, stall=0.2):
            got.append(chunk.text)

    task = asyncio.create_task(consume())
    await eventually(_is(lambda: got == ["a", "b"]), what="two slow tokens")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert got == ["a", "b"]


async def test_coalesce_raises_backend_errors_in_order() -> None:
    async def failing() -> AsyncIterator[Chunk]:
        yield Chunk(text="x")
        raise RuntimeError("engine died")

    received: list[str] = []

    async def consume() -> None:
        async for chunk in coalesce(failing(), max_parts=4, linger=0):
            received.append(chunk.text)

    with pytest.raises(RuntimeError, match="engine died"):
        await consume()
    assert received == ["x"]


async def test_closing_coalesce_closes_the_backend_stream() -> None:
    closed = asyncio.Event()

    async def endless() -> AsyncIterator[Chunk]:
        try:
            while True:
                await asyncio.sleep(0.001)
                yield Chunk(text="t")
        finally:
            closed.set()

    stream = coalesce(endless(), max_parts=4, linger=0)
    async for _chunk in stream:
        break
    await stream.aclose()
    assert closed.is_set()


class _Scripted:
    """A backend that yields ``texts`` (and a finish) as fast as it can."""

    model = "scripted"

    def __init__(self, texts: list[str]) -> None:
        self.texts = texts

    async def generate(self, request: object, prefix: str = "", prefix_tokens: int = 0):  # type: ignore[no-untyped-def]
        for text in self.texts:
            yield Chunk(text=text)
        yield Chunk(finish_reason="stop")


@pytest.mark.parametrize("waits", [True, False])
async def test_generate_into_hands_each_token_to_a_taker_that_waits_or_never_does(
    waits: bool,
) -> None:
    """A worker's publisher takes tokens without a coroutine each; the edge's local path awaits
    its record. Either way every token goes, numbered, in order, and the end vouches for them."""
    taken: list[TokenEvent] = []

    async def awaiting(event: TokenEvent) -> None:
        await asyncio.sleep(0)
        taken.append(event)

    texts = [f" t{i}" for i in range(40)]
    writer = AnswerWriter("g1", attempt=1, node="n")
    request = InferRequest(id="g1", prompt="x", max_tokens=64)
    settings = load_settings(environ={}).worker
    emit = awaiting if waits else taken.append
    gen = await generate_into(_Scripted(texts), request, writer, emit, settings)  # type: ignore[arg-type]
    state = AnswerState("g1")
    state.feed(writer.start())
    for event in taken:
        state.feed(event)
    state.feed(writer.end(finish_reason=gen.finish_reason, usage=gen.usage))
    assert state.done and state.text() == "".join(texts)
    assert isinstance(state.outcome, EndEvent)  # its seq and digest match what was taken


def test_package_data_entries_match_real_files() -> None:
    """A non-editable install ships only declared data (the router weights among them)."""
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib", reason="tomllib needs Python 3.11+")
    root = Path(__file__).resolve().parent.parent
    declared = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"
    ]
    assert "edge_node.learned" in declared
    for package, patterns in declared.items():
        folder = root / package.replace(".", "/")
        for pattern in patterns:
            assert list(folder.glob(pattern)), f"{package}: {pattern} matches no file"
