"""A worker asks its engine for a first delivery's answer before it prepares the rest
(``mesh.generate.Asked``): the request is out when the call returns, the answer reads whole and
in order, and a request that goes no further is stopped in the engine, whatever stops it."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncGenerator

import pytest

from mesh.backends.base import Chunk
from mesh.config import WorkerSettings
from mesh.generate import Asked, generate_into
from protocol.errors import BackendError
from protocol.messages import InferRequest, TokenEvent, Usage
from protocol.stream import AnswerWriter, Resume


class Engine:
    """An engine's generator that says what happened to it: asked, read, closed."""

    def __init__(self, texts: list[str], *, fail_first: bool = False) -> None:
        self.texts = texts
        self.fail_first = fail_first
        self.log: list[str] = []
        self.go = asyncio.Event()

    async def generate(
        self, request: InferRequest, *, prefix: str = "", prefix_tokens: int = 0
    ) -> AsyncGenerator[Chunk, None]:
        self.log.append(f"asked {prefix!r}")  # the engine's request, before the first wait
        try:
            await self.go.wait()  # prefill
            if self.fail_first:
                raise BackendError("the engine fell over", retryable=True)
            for text in self.texts:
                yield Chunk(text=text)
                await asyncio.sleep(0)
            usage = Usage(completion_tokens=len(self.texts))
            yield Chunk(text="", finish_reason="stop", usage=usage)
        finally:
            self.log.append("closed")


def _request() -> InferRequest:
    return InferRequest(id="r1", prompt="hi", max_tokens=16)


async def test_the_engine_is_asked_before_the_call_returns_and_the_answer_reads_whole() -> None:
    engine = Engine(["a", "b", "c"])
    asked = Asked(engine.generate(_request()))
    assert engine.log == ["asked ''"]  # no await yet: the request is out
    engine.go.set()
    got = [chunk.text async for chunk in asked]
    assert got == ["a", "b", "c", ""]
    await asked.aclose()
    assert engine.log == ["asked ''", "closed"]


async def test_a_request_that_goes_no_further_is_stopped_in_the_engine() -> None:
    engine = Engine(["a"])
    asked = Asked(engine.generate(_request()))
    await asyncio.sleep(0.01)  # the engine prefills
    await asked.aclose()
    assert engine.log == ["asked ''", "closed"]
    await asked.aclose()  # again: nothing more happens
    assert engine.log == ["asked ''", "closed"]


async def test_closing_after_part_of_the_answer_stops_the_engine() -> None:
    engine = Engine(["a", "b", "c"])
    asked = Asked(engine.generate(_request()))
    engine.go.set()
    assert (await asked.__anext__()).text == "a"
    await asked.aclose()
    assert engine.log[-1] == "closed"


async def test_an_engine_error_on_the_first_chunk_reaches_the_reader(
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine = Engine([], fail_first=True)
    asked = Asked(engine.generate(_request()))
    engine.go.set()
    with pytest.raises(BackendError, match="fell over"):
        async for _chunk in asked:
            pass
    await asked.aclose()
    # Failed unread: closing takes the error, so nothing is left for asyncio to report.
    failing = Engine([], fail_first=True)
    unread = Asked(failing.generate(_request()))
    failing.go.set()
    await asyncio.sleep(0.01)
    await unread.aclose()
    del unread
    gc.collect()
    assert "never retrieved" not in caplog.text


async def test_generate_into_reads_what_was_asked_and_counts_from_the_ask() -> None:
    engine = Engine(["x", "y"])
    asked = Asked(engine.generate(_request()))
    engine.go.set()
    tokens: list[TokenEvent] = []
    gen = await generate_into(
        engine,  # type: ignore[arg-type]
        _request(),
        AnswerWriter("r1"),
        tokens.append,
        WorkerSettings(),
        asked=asked,
    )
    assert "".join(t.text for t in tokens) == "xy" and gen.usage.completion_tokens == 2
    assert gen.started == asked.started
    assert engine.log == ["asked ''", "closed"]  # one request to the engine, closed at the end


async def test_an_answer_that_continues_another_attempt_is_not_read_from_an_ask_from_nothing() -> (
    None
):
    engine = Engine(["y"])
    asked = Asked(engine.generate(_request()))
    engine.go.set()
    writer = AnswerWriter("r1", attempt=2, resume=Resume(seq=1, tokens=1, text="x"))
    tokens: list[TokenEvent] = []
    await generate_into(
        engine,  # type: ignore[arg-type]
        _request(),
        writer,
        tokens.append,
        WorkerSettings(),
        asked=asked,
    )
    # The ask from nothing was closed, and the engine asked again with the kept text.
    assert engine.log[:2] == ["asked ''", "closed"]
    assert engine.log[2] == "asked 'x'"
    assert [t.text for t in tokens] == ["y"]
