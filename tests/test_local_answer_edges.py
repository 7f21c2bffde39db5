"""The edge's local model path (llama.cpp, the real SmolLM2 GGUF) at its edges: a cancel or a
deadline during a long prefill, stop strings and multi-byte characters, the usage it reports.
Each failed on the code before its fix (review S16l). The usage test failed until the
backend counted the tokens llama.cpp samples: it counted text parts (3 for an 8-token emoji
answer's parts) and took the prompt as the context's length less them (off by one at a length
finish)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from edge_node.node import EdgeNode
from edge_node.router import HeuristicRouter
from mesh.backends.llama_cpp import LlamaCppBackend
from mesh.client import MeshClient
from mesh.config import MeshSettings, load_settings
from mesh.connection import Connection
from protocol.errors import DeadlineExceededError
from protocol.messages import InferRequest
from tests.helpers import eventually


@pytest.fixture(scope="module")
async def llama() -> AsyncIterator[LlamaCppBackend]:
    backend = LlamaCppBackend(load_settings(environ={}).edge.model)  # 1 slot
    await backend.start()
    assert backend._instances is not None
    backend.engine = backend._instances._queue[0]  # type: ignore[attr-defined]
    yield backend
    await backend.close()


def _engine(backend: LlamaCppBackend) -> object:
    return backend.engine  # type: ignore[attr-defined]  # the one instance, kept at start


async def _answer(backend: LlamaCppBackend, req: InferRequest) -> tuple[str, object]:
    parts = [c async for c in backend.generate(req)]
    return "".join(c.text for c in parts[:-1]), parts[-1]


# -- usage --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("prompt", "max_tokens", "stop"),
    [
        ("Count: 1, 2, 3, 4, 5,", 3, None),  # a length finish
        ("Count: 1, 2, 3, 4, 5,", 8, [", 7"]),  # a stop string held back, then found
        ("Emoji list: 😀 😃 😄 😁 😆 😅", 8, None),  # several tokens per emitted part
    ],
)
async def test_llama_usage_counts_the_prompt_and_the_answer_as_they_are(
    llama: LlamaCppBackend, prompt: str, max_tokens: int, stop: list[str] | None
) -> None:
    """The prompt's token count does not depend on the answer, and the answer's token count is
    the tokens generated (never more than ``max_tokens``, never fewer than were produced)."""
    req = InferRequest(
        id="u1", prompt=prompt, raw=True, max_tokens=max_tokens, temperature=0, stop=stop
    )
    parts = [c async for c in llama.generate(req)]
    text, end = "".join(c.text for c in parts[:-1]), parts[-1]
    engine = _engine(llama)
    real_prompt = len(engine.tokenize(prompt.encode()))  # type: ignore[attr-defined]
    assert end.usage is not None
    print(f"\n{prompt!r} -> {text!r} {end.finish_reason} {end.usage} (prompt really {real_prompt})")
    assert end.usage.prompt_tokens == real_prompt, (end.usage, real_prompt)
    if end.finish_reason == "length":
        assert end.usage.completion_tokens == max_tokens, end.usage
        # Every token is passed on with the text it made (a chunk's n), none twice.
        assert sum(c.n for c in parts[:-1]) == max_tokens, [(c.text, c.n) for c in parts]


# -- cancel during prefill ----------------------------------------------------------------
LONG = "word " * 700  # about 700 prompt tokens: seconds of prefill on one busy core


async def test_a_cancel_during_prefill_gives_the_model_instance_back_promptly(
    llama: LlamaCppBackend,
) -> None:
    """A generation cancelled while llama.cpp evaluates its prompt stops there: its model
    instance (the slot) is free again within a second, not after the whole prompt."""
    # How long the prefill takes, measured first (uncancelled).
    started = time.perf_counter()
    await _answer(llama, InferRequest(id="p0", prompt=LONG, raw=True, max_tokens=1, temperature=0))
    prefill = time.perf_counter() - started
    # Another prompt of the same length (not cached), cancelled 0.2 s into its prefill.
    other = "term " * 700
    req = InferRequest(id="p1", prompt=other, raw=True, max_tokens=1, temperature=0)
    task = asyncio.ensure_future(_answer(llama, req))
    await asyncio.sleep(0.2)
    assert llama.capacity().free == 0
    task.cancel()
    cancelled_at = time.perf_counter()
    with pytest.raises(asyncio.CancelledError):
        await task

    async def free() -> bool:
        return llama.capacity().free > 0

    await eventually(free, timeout=30, what="the instance given back")
    held = time.perf_counter() - cancelled_at
    print(f"\nprefill {prefill:.2f} s; instance held {held:.2f} s after the cancel")
    assert held < 1.0, f"the cancelled prefill held the slot {held:.2f} s (prefill {prefill:.2f} s)"


async def test_the_next_local_request_is_not_stuck_behind_a_prefill_past_its_deadline(
    settings: MeshSettings, conn: Connection, llama: LlamaCppBackend
) -> None:
    """Through an edge: a long prompt whose deadline passes during its prefill ends in
    ``deadline_exceeded`` at the deadline; the next request (2 tokens, 3 s deadline) then gets
    its whole answer, not a ``deadline_exceeded`` of its own while the first one's prompt is
    still being evaluated for nobody."""
    async with (
        EdgeNode(settings, conn, llama, HeuristicRouter()),
        MeshClient(settings=settings, first_event_timeout=30, idle_timeout=30) as client,
    ):
        await client.complete("hi", route="local", max_tokens=1, temperature=0)  # warm
        with pytest.raises(DeadlineExceededError):
            await client.complete(
                "text " * 1200, route="local", max_tokens=1, deadline=time.time() + 0.5
            )
        started = time.perf_counter()
        try:
            answer = await client.complete(
                "hi", route="local", max_tokens=2, temperature=0, deadline=time.time() + 3.0
            )
        except DeadlineExceededError:
            waited = time.perf_counter() - started
            pytest.fail(
                f"the next request timed out after {waited:.2f} s, behind the expired "
                "request's prefill"
            )
        assert answer.end.path == "local" and answer.end.finish_reason == "length"


# -- stop strings and multi-byte characters -----------------------------------------------
EMOJI = "Emoji list: 😀 😃 😄 😁 😆 😅"


@pytest.mark.parametrize(("max_tokens", "stop"), [(4, ["😐 X"]), (6, ["😐 😑 X"]), (6, ["😑 X"])])
async def test_a_stop_string_that_never_matches_changes_nothing_in_the_answer(
    llama: LlamaCppBackend, max_tokens: int, stop: list[str]
) -> None:
    """Greedy, the answer with a stop string that never occurs in it is the answer without
    one: characters held back as a possible start of the stop string are not dropped when the
    answer ends (max_tokens) before the stop string could be told apart."""
    plain = InferRequest(id="s0", prompt=EMOJI, raw=True, max_tokens=max_tokens, temperature=0)
    expected, end0 = await _answer(llama, plain)
    stopped = plain.model_copy(update={"id": "s1", "stop": stop})
    got, end1 = await _answer(llama, stopped)
    assert not any(s in expected for s in stop)
    print(f"\nwithout stop {expected!r} ({end0.finish_reason}); with {stop} {got!r}")
    assert got == expected and end1.finish_reason == end0.finish_reason == "length"
