"""In-process llama.cpp backend: the edge model, and the cloud worker's CPU default.

llama.cpp calls block, so each generation runs on a dedicated thread pool (one thread per slot)
and hands chunks to the event loop through a queue. A slot is one loaded model instance, so
``slots`` requests generate truly at once; a request beyond that waits for a free instance.

Continuing an answer (after another worker died mid-answer) renders the conversation with the
model's own chat template, appends the text already said, and completes from there.

Repeatable requests (``temperature: 0``, or a ``seed``) give the same text every time. llama.cpp
computes a token's logits differently when it is alone in a batch: on the bundled SmolLM2 (CPU,
one thread) the last prompt token's logits differ by up to 0.53 evaluated alone vs with the rest
of the prompt, while every split into batches of two or more tokens gave identical logits. And
llama-cpp-python reuses the previous request's KV cache: the same prompt again keeps all but its
last token and evaluates that one alone, so "List the days of the week, numbered." answered
"...in order:\n\n1. Monday" fresh and "...week:\nMonday, Monday" on every repeat (issue 22).
A repeatable request therefore evaluates its prompt one way only (:func:`_llama_class`): all but
the last token from an empty cache, then the last token alone; the cache is kept only where it
holds exactly that, i.e. for the same prompt again. Measured on 2 busy cores, time to the first
token: a repeat 14 ms as before; a prompt other than the instance's previous one 230 ms instead
of 91 ms, its 24-token chat-template prefix no longer reused (39 tokens evaluated, not 15).
Other requests reuse the cache as before. Cheaper would be to keep any shared prefix and only
never evaluate a prompt's last token alone, but that rests on splits of two or more agreeing,
measured on this CPU build only: llama.cpp's server README says that, depending on the backend,
logits are not guaranteed bit-for-bit identical for different batch sizes.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path
from typing import Any

from mesh.backends.base import (
    ANSWER_ROOM,
    ROOM_CHECKED,
    Capacity,
    Chunk,
    Health,
    NoRoomError,
    openai_logprobs,
)
from mesh.backends.stop_text import StopText
from mesh.config import ModelSettings
from mesh.logs import get_logger
from mesh.models import resolve_model_path
from protocol.errors import BackendError, ContextTooLongError, InvalidRequestError, MeshError
from protocol.messages import InferRequest, ResponseFormat, TokenLogprob, Usage

log = get_logger(__name__)
_DONE = object()
# llama-cpp-python silences loading by pointing fds 1 and 2 at /dev/null and back, process-wide;
# two loads at once can restore each other's /dev/null and leave stdout dead. One at a time.
_LOAD_LOCK = threading.Lock()


class LlamaCppBackend:
    """``slots`` instances of one GGUF model, generating off the event loop."""

    continues = True

    def __init__(self, settings: ModelSettings) -> None:
        self.settings = settings
        self.model = settings.name
        self.model_path: Path = resolve_model_path(settings.path)
        self._instances: asyncio.Queue[Any] | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._stops: dict[str, threading.Event] = {}
        self._busy = 0

    async def start(self) -> None:
        if self._instances is not None:
            return
        self._executor = ThreadPoolExecutor(
            max_workers=self.settings.slots, thread_name_prefix=f"llama-{self.model}"
        )
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        instances = await asyncio.gather(
            *(loop.run_in_executor(self._executor, self._load) for _ in range(self.settings.slots))
        )
        self._instances = asyncio.Queue()
        for llama in instances:
            self._instances.put_nowait(llama)
        self.continues = "tokenizer.chat_template" in instances[0].metadata
        log.info(
            "model loaded",
            model=self.model,
            path=str(self.model_path),
            slots=self.settings.slots,
            load_s=round(time.perf_counter() - started, 2),
        )

    def _load(self) -> Any:
        llama_class = _llama_class()  # heavy import, only where the engine is used
        # Half the cores by default: llama.cpp threads spin-wait on each other, so with every
        # core taken, any neighbour (another model, BLAS, the OS) can stall a token for seconds.
        # Measured on 2 cores next to a busy process: 2 threads 1.4 s (once 70 s), 1 thread 0.7 s.
        threads = self.settings.n_threads or max(1, (os.cpu_count() or 2) // 2)
        with _LOAD_LOCK:
            llama = llama_class(
                model_path=str(self.model_path),
                n_ctx=self.settings.n_ctx,
                n_threads=threads,
                n_threads_batch=threads,
                n_gpu_layers=self.settings.n_gpu_layers,
                logits_all=self.settings.logprobs,
                verbose=False,
            )
        _abortable(llama)
        return llama

    async def close(self) -> None:
        for stop in self._stops.values():
            stop.set()
        if self._executor is not None:
            executor, self._executor = self._executor, None
            await asyncio.get_running_loop().run_in_executor(None, executor.shutdown, True)
        self._instances = None

    def capacity(self) -> Capacity:
        return Capacity(total=self.settings.slots, free=max(0, self.settings.slots - self._busy))

    async def health(self) -> Health:
        if self._instances is None:
            return Health(ok=False, detail="not started")
        return Health(ok=True, detail=f"{self.model}: {self._busy}/{self.settings.slots} busy")

    async def abort(self, request_id: str) -> None:
        stop = self._stops.get(request_id)
        if stop is not None:
            stop.set()

    def generate(
        self, request: InferRequest, *, prefix: str = "", prefix_tokens: int = 0
    ) -> AsyncGenerator[Chunk, None]:
        return self._generate(request, prefix, prefix_tokens, None)

    def generate_scored(
        self, request: InferRequest, *, scored_tokens: int
    ) -> AsyncGenerator[Chunk, None]:
        """As :meth:`generate`, each of the first ``scored_tokens`` chunks carrying the model's
        confidence in its token (read from the logits before sampling: no ``logits_all``)."""
        return self._generate(request, "", 0, _Probe(scored_tokens))

    async def _generate(
        self, request: InferRequest, prefix: str, prefix_tokens: int, probe: _Probe | None
    ) -> AsyncGenerator[Chunk, None]:
        if self._instances is None or self._executor is None:
            raise BackendError("llama.cpp backend is not started", retryable=True)
        if prefix and not self.continues:
            raise ValueError("this GGUF has no chat template: it cannot continue an answer")
        if request.logprobs and not self.settings.logprobs:
            raise InvalidRequestError(
                f"model {self.model!r} was loaded without logprobs (set logprobs=true in its "
                "model settings, e.g. MESH_EDGE_MODEL_LOGPROBS=true)",
                request_id=request.id,
            )
        instances = self._instances
        llama = await instances.get()
        self._busy += 1
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()
        stop = threading.Event()
        self._stops[request.id] = stop

        def emit(item: Any) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                stop.set()

        if ROOM_CHECKED.get():  # counted, not estimated as the edge's route was (_run resets it)
            llama.room = (min(max(1, request.max_tokens - prefix_tokens), ANSWER_ROOM), request.id)
        future = loop.run_in_executor(
            self._executor, _run, llama, request, emit, stop, prefix, prefix_tokens, probe
        )

        def release(_: object) -> None:
            # The instance goes back only once its thread is done with it, however we exit.
            self._busy -= 1
            self._stops.pop(request.id, None)
            instances.put_nowait(llama)

        future.add_done_callback(release)
        try:
            while True:
                item = await queue.get()
                if item is _DONE:
                    break
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            stop.set()  # cancelled or closed early: the thread stops at its next token


def _abortable(llama: Any) -> None:
    """Let a request's stop end its prompt's evaluation too, not only its sampling: llama.cpp
    asks this callback between the steps of each evaluation. A client that cancels, or a
    deadline that passes, during a long prefill held the instance (and the next request) until
    the prefill ended: 2.8 s after a cancel 0.2 s into a 2.9 s prefill."""
    import llama_cpp

    llama.stopping = None

    def aborted(_data: Any) -> bool:
        stopping = llama.stopping
        return stopping is not None and stopping.is_set()

    llama.abort_hook = llama_cpp.ggml_abort_callback(aborted)  # kept: llama.cpp holds no ref
    llama_cpp.llama_set_abort_callback(llama._ctx.ctx, llama.abort_hook, None)


def repeatable(request: InferRequest) -> bool:
    """Whether ``request`` asks for the same text every time: greedy, or seeded sampling."""
    return request.temperature == 0 or request.seed is not None


@cache
def _llama_class() -> type[Any]:
    """llama_cpp.Llama, evaluating the prompt of a repeatable request one fixed way.

    Set ``repeatable`` before a completion. Such a prompt of N tokens is evaluated as its first
    N-1 tokens from an empty cache (in n_batch chunks), then its last token alone. That is what
    llama-cpp-python's own prefix reuse does to the same prompt again, so a repeat keeps the
    cache and stays free; any other cache content is dropped, since the batch that computed a
    kept token changes its numbers (see the module docstring). ``canonical`` is the prompt head
    this instance holds evaluated that way; a request that is not repeatable may reuse and
    rewrite the cache, so it forgets it.
    """
    import llama_cpp
    from llama_cpp import Llama

    class RepeatableLlama(Llama):
        repeatable = False
        canonical: list[int] | None = None
        counted = (0, 0)  # the last completion's (prompt tokens, answer tokens)
        room: tuple[int, str | None] = (0, None)
        """The room the next prompt must leave for its answer, and its request's id (_run)."""

        def generate(self, tokens: Any, *args: Any, **kwargs: Any) -> Any:
            tokens = list(tokens)
            needed, request_id = self.room
            if len(tokens) + needed > self.n_ctx():  # llama-cpp-python would cut max_tokens
                raise NoRoomError(
                    f"the prompt is {len(tokens)} tokens: the local model's context "
                    f"({self.n_ctx()}) leaves room for {max(0, self.n_ctx() - len(tokens))} of "
                    f"the {needed} answer tokens it needs",
                    request_id=request_id,
                )
            self.counted = (len(tokens), 0)
            return self._counting(self._generate(tokens, *args, **kwargs))

        def _counting(self, tokens: Any) -> Any:
            """The sampled tokens, counted as they go (an end-of-generation one is not
            the answer's: llama-cpp-python ends there)."""
            try:
                for token in tokens:
                    if not llama_cpp.llama_vocab_is_eog(self._model.vocab, token):
                        self.counted = (self.counted[0], self.counted[1] + 1)
                    yield token
            finally:
                tokens.close()

        def _generate(self, tokens: list[int], *args: Any, **kwargs: Any) -> Any:
            if not self.repeatable:
                self.canonical = None
                return super().generate(tokens, *args, **kwargs)
            head = tokens[:-1]
            held = (
                bool(head)
                and self.canonical == head
                and self.n_tokens >= len(head)
                and self.input_ids[: len(head)].tolist() == head
            )
            if not held:
                self.reset()  # type: ignore[no-untyped-call]
                self.canonical = None
                if head:
                    self.eval(head)
                    self.canonical = head
            # From here llama-cpp-python finds the head cached and evaluates the last token.
            return super().generate(tokens, *args, **kwargs)

    return RepeatableLlama


class _Probe:
    """A logits processor that only looks: for each of the first ``tokens`` sampling steps, the
    entropy and top log-probability of the model's next-token distribution (full vocabulary,
    before temperature and top-p)."""

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens
        self.readings: list[tuple[float, float]] = []
        self._taken = 0

    def __call__(self, _input_ids: Any, logits: Any) -> Any:
        if len(self.readings) < self.tokens:
            import numpy as np

            shifted = logits - logits.max()
            weights = np.exp(shifted)  # float32: ~0.1 ms for 49k logits, 10x less than float64
            total = float(weights.sum(dtype=np.float64))
            log_total = float(np.log(total))
            entropy = log_total - float(np.dot(weights, shifted)) / total
            self.readings.append((max(0.0, entropy), -log_total))
        return logits

    def fresh(self) -> tuple[tuple[float, float], ...] | None:
        """The readings of the tokens sampled since the last call (None: none, or past
        ``tokens``). The stream is synchronous: the next sampling step runs only after its
        consumer asks for the next part."""
        if len(self.readings) == self._taken:
            return None
        new = tuple(self.readings[self._taken :])
        self._taken = len(self.readings)
        return new


def _formatter(llama: Any) -> Any:
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    eos_id = llama.token_eos()
    bos_id = llama.token_bos()
    return Jinja2ChatFormatter(
        template=llama.metadata["tokenizer.chat_template"],
        eos_token=llama._model.token_get_text(eos_id) if eos_id != -1 else "",
        bos_token=llama._model.token_get_text(bos_id) if bos_id != -1 else "",
        stop_token_ids=[eos_id],
    )


def _grammar(response_format: ResponseFormat | None) -> Any:
    """A llama.cpp grammar for a raw completion that must be JSON (None: free text)."""
    if response_format is None or response_format.type == "text":
        return None
    from llama_cpp.llama_grammar import JSON_GBNF, LlamaGrammar

    schema = response_format.json_schema_of()
    if schema is not None:
        return LlamaGrammar.from_json_schema(json.dumps(schema), verbose=False)
    return LlamaGrammar.from_string(JSON_GBNF, verbose=False)


def _open(
    llama: Any, request: InferRequest, prefix: str, prefix_tokens: int, probe: _Probe | None
) -> tuple[Any, bool, list[str]]:
    """The completion stream for ``request``, whether it yields chat chunks, and the stop
    strings the caller matches (:class:`StopText`; llama-cpp-python is given none).

    Chat requests go through llama-cpp-python's chat completion (the GGUF's template, its JSON
    grammar for ``response_format``); raw prompts, and a chat answer being continued (rendered
    with the template, the kept text appended), through the plain completion.
    """
    top = request.top_logprobs or 1
    if not request.raw and not prefix:
        response_format: dict[str, Any] | None = None
        if request.response_format is not None and request.response_format.type != "text":
            response_format = {"type": "json_object"}
            schema = request.response_format.json_schema_of()
            if schema is not None:
                response_format["schema"] = schema
        return (
            llama.create_chat_completion(
                messages=request.chat(),
                stream=True,
                max_tokens=request.max_tokens,
                temperature=request.temperature,
                top_p=request.top_p,
                stop=[],
                seed=request.seed,
                response_format=response_format,
                logprobs=request.logprobs or None,
                top_logprobs=request.top_logprobs if request.logprobs else None,
                logits_processor=None if probe is None else [probe],
            ),
            True,
            list(request.stop or []),
        )
    stop = list(request.stop or [])
    stopping = None
    if request.raw:
        prompt = (request.prompt or "") + prefix
        grammar = None if prefix else _grammar(request.response_format)
    else:
        messages: Any = request.chat()
        formatted = _formatter(llama)(messages=messages)
        template_stop = formatted.stop or []
        stop += [template_stop] if isinstance(template_stop, str) else template_stop
        stopping = formatted.stopping_criteria
        prompt = formatted.prompt + prefix
        grammar = None
    return (
        llama.create_completion(
            prompt=prompt,
            stream=True,
            max_tokens=max(1, request.max_tokens - prefix_tokens),
            temperature=request.temperature,
            top_p=request.top_p,
            stop=[],
            stopping_criteria=stopping,
            seed=request.seed,
            grammar=grammar,
            logprobs=top if request.logprobs else None,
            logits_processor=None if probe is None else [probe],
        ),
        False,
        stop,
    )


def _logprobs(choice: dict[str, Any], chat: bool, top: int) -> list[TokenLogprob] | None:
    """Per-token logprobs of one chunk, from either llama-cpp-python format."""
    found = choice.get("logprobs")
    if not found:
        return None
    return openai_logprobs(found, chat=chat, top=top)


def _run(  # noqa: PLR0917 - one call from generate(), positional for run_in_executor
    llama: Any,
    request: InferRequest,
    emit: Callable[[Any], None],
    stop: threading.Event,
    prefix: str,
    prefix_tokens: int,
    probe: _Probe | None,
) -> None:
    """Runs on a worker thread: stream one completion (or its continuation) into ``emit``."""
    finish_reason: str | None = None
    try:
        llama.repeatable = repeatable(request)
        llama.stopping = stop  # its prompt's evaluation stops too (_abortable)
        llama.counted = (0, 0)
        stream, chat, stops = _open(llama, request, prefix, prefix_tokens, probe)
        matcher = StopText(stops)
        sent = 0  # engine tokens passed on (the rest: their text held back)
        try:
            for part in stream:
                if stop.is_set():
                    finish_reason = "cancelled"
                    break
                choice = part["choices"][0]
                text = choice.get("delta", {}).get("content") if chat else choice.get("text")
                if text:
                    logprobs = (
                        _logprobs(choice, chat, request.top_logprobs) if request.logprobs else None
                    )
                    text = matcher.feed(text)
                    if text or logprobs:
                        confidence = probe.fresh() if probe is not None else None
                        n, sent = llama.counted[1] - sent, llama.counted[1]
                        emit(Chunk(text=text, n=n, logprobs=logprobs, confidence=confidence))
                    if matcher.hit:
                        finish_reason = "stop"
                        break
                if choice.get("finish_reason"):
                    finish_reason = choice["finish_reason"]
            if rest := matcher.flush():  # no stop string came: what was held back
                emit(Chunk(text=rest, n=llama.counted[1] - sent))
        finally:
            llama.stopping = None
            stream.close()
        prompt_tokens, completion_tokens = llama.counted
        emit(
            Chunk(
                finish_reason=finish_reason or "stop",
                usage=Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens),
            )
        )
    except MeshError as exc:
        emit(exc)
    except ValueError as exc:
        message = str(exc)
        if "context window" in message or "exceed" in message:
            emit(ContextTooLongError(message, request_id=request.id))
        else:
            emit(
                BackendError(
                    f"llama.cpp rejected the request: {message}",
                    request_id=request.id,
                    retryable=False,
                )
            )
    except Exception as exc:  # engine failure: typed, never a traceback on the wire
        emit(BackendError(f"llama.cpp failed: {type(exc).__name__}: {exc}", request_id=request.id))
    finally:
        llama.room = (0, None)
        emit(_DONE)
