"""In-process vLLM backend (V1 ``AsyncLLM``): the GPU cloud worker, with continuous batching.

vLLM is an optional extra (``pip install 'nats-llm-mesh[vllm]'``, CUDA hosts only); it is
imported on ``start()`` so the rest of the project never needs it. Continuing an answer renders
the conversation with the assistant's text so far as its last message
(``continue_final_message``), as ``vllm serve`` does for its chat API.

The engine gets each prompt as vLLM's renderer makes it (``renderer.render_cmpl_async``, a dict
with a ``type``): vLLM 0.26 logs "Passing raw prompts to InputProcessor is deprecated" for
anything else, a ``{"prompt": text}`` dict included, since its InputProcessor takes only a dict
with a ``type`` as already rendered. The renderer tokenizes with the defaults the raw path used
(``default_cmpl_tok_params``), so the tokens do not change. A vLLM without a renderer (the extra
allows >=0.8) gets a ``TextPrompt`` dict, part of the ``PromptType`` that ``generate`` takes.

``temperature: 0`` is repeatable only as far as vLLM makes it: by default vLLM does not promise
reproducible results (a request's numbers may depend on what it is batched with); with
``VLLM_BATCH_INVARIANT=1`` (beta, NVIDIA GPUs of compute capability 8.0 or more) they do not.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncGenerator
from typing import Any

from mesh.backends.base import Capacity, Chunk, Health, engine_saturated
from mesh.config import ModelSettings
from mesh.logs import get_logger
from protocol.errors import BackendError, ContextTooLongError, MeshError
from protocol.messages import InferRequest, TokenLogprob, Usage

log = get_logger(__name__)


class VLLMBackend:
    continues = True

    def __init__(self, settings: ModelSettings) -> None:
        if not settings.path:
            raise MeshError(
                "the vllm backend needs a model: set MESH_WORKER_MODEL_PATH "
                "to a Hugging Face id or a local model directory",
                retryable=False,
            )
        self.settings = settings
        self.model = settings.name
        self._engine: Any = None
        self._tokenizer: Any = None
        self._busy = 0
        self.engine: dict[str, float] = {}
        """The engine's own load, from its scheduler stats (empty until the first step)."""

    async def start(self) -> None:
        if self._engine is not None:
            return
        try:
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM
        except ImportError as exc:
            raise MeshError(
                f"vLLM is not installed ({exc}); install the extra: pip install "
                "'nats-llm-mesh[vllm]' on a CUDA host, or use MESH_WORKER_MODEL_BACKEND=llama_cpp",
                retryable=False,
            ) from None
        args = AsyncEngineArgs(**self.engine_options())
        self._engine = AsyncLLM.from_engine_args(args, stat_loggers=[self._load_logger()])
        tokenizer = self._engine.get_tokenizer()  # a coroutine in older vLLM, a method in 0.26
        self._tokenizer = await tokenizer if inspect.isawaitable(tokenizer) else tokenizer
        log.info(
            "vllm engine started",
            model=self.model,
            path=self.settings.path,
            max_num_seqs=self.settings.slots,
        )

    def engine_options(self) -> dict[str, Any]:
        """vLLM's AsyncEngineArgs from the model settings (explicit options, then
        ``engine_args``, which win)."""
        options: dict[str, Any] = {
            "model": self.settings.path,
            "served_model_name": [self.settings.name],
            "max_model_len": self.settings.n_ctx,
            "max_num_seqs": self.settings.slots,
            "gpu_memory_utilization": self.settings.gpu_memory_utilization,
            "tensor_parallel_size": self.settings.tensor_parallel_size,
        }
        for name in ("enable_prefix_caching", "quantization", "speculative_config"):
            value = getattr(self.settings, name)
            if value is not None:
                options[name] = value
        options.update(self.settings.engine_args)
        return options

    async def close(self) -> None:
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.shutdown()

    def _load_logger(self) -> Any:
        """A vLLM stat logger that keeps the engine's own load (running and waiting requests,
        KV-cache use) where capacity() reads it, at every scheduler step."""
        from vllm.v1.metrics.loggers import StatLoggerBase

        backend = self

        class EngineLoad(StatLoggerBase):  # type: ignore[misc]
            def __init__(self, *_args: Any, **_kwargs: Any) -> None:
                pass

            def record(self, scheduler_stats: Any, *_args: Any, **_kwargs: Any) -> None:
                if scheduler_stats is None:
                    return
                usage = getattr(scheduler_stats, "kv_cache_usage", None)
                if usage is None:
                    usage = getattr(scheduler_stats, "gpu_cache_usage", 0.0)
                backend.engine = {
                    "running": float(scheduler_stats.num_running_reqs),
                    "waiting": float(scheduler_stats.num_waiting_reqs),
                    "kv_cache": float(usage or 0.0),
                }

            def log_engine_initialized(self) -> None:
                pass

        return EngineLoad

    def capacity(self) -> Capacity:
        # vLLM batches continuously: every slot up to max_num_seqs is real concurrency, unless
        # the engine's own figures say it queues requests or its KV cache is nearly full.
        full = engine_saturated(self.engine)
        free = 0 if full else max(0, self.settings.slots - self._busy)
        return Capacity(total=self.settings.slots, free=free, saturated=full)

    async def health(self) -> Health:
        if self._engine is None:
            return Health(ok=False, detail="not started")
        try:
            await self._engine.check_health()
        except Exception as exc:  # the engine reports death as various exception types
            return Health(ok=False, detail=f"{type(exc).__name__}: {exc}")
        return Health(ok=True, detail=f"{self._busy}/{self.settings.slots} busy")

    def engine_requests(self) -> int:
        """Requests the engine itself still tracks (its output processor's unfinished ones):
        what an abort must bring down, whatever this backend's own count says."""
        if self._engine is None:
            return 0
        return int(self._engine.output_processor.get_num_unfinished_requests())

    async def abort(self, request_id: str) -> None:
        if self._engine is not None:
            await self._engine.abort(request_id)

    def _prompt(self, request: InferRequest, prefix: str) -> str:
        if request.raw:
            return (request.prompt or "") + prefix
        messages: list[dict[str, str]] = request.chat()
        if not prefix:
            prompt: str = self._tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
            return prompt
        messages.append({"role": "assistant", "content": prefix})
        continued: str = self._tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=False, continue_final_message=True
        )
        return continued

    async def _engine_prompt(self, text: str) -> dict[str, Any]:
        """``text`` as the engine's ``generate`` takes it: rendered by vLLM's renderer where
        the engine has one, else a ``TextPrompt`` dict (see the module docstring)."""
        prompt: dict[str, Any] = {"prompt": text}
        renderer = getattr(self._engine, "renderer", None)
        render = getattr(renderer, "render_cmpl_async", None)
        if render is None:
            return prompt
        # Passed along, not left to the default: some releases made tok_params mandatory.
        rendered = await render([prompt], getattr(renderer, "default_cmpl_tok_params", None))
        engine_prompt: dict[str, Any] = rendered[0]
        return engine_prompt

    async def generate(
        self, request: InferRequest, *, prefix: str = "", prefix_tokens: int = 0
    ) -> AsyncGenerator[Chunk, None]:
        if self._engine is None:
            raise BackendError("vLLM backend is not started", retryable=True)
        from vllm.sampling_params import RequestOutputKind, SamplingParams
        from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError

        options: dict[str, Any] = {}
        if request.logprobs:
            options["logprobs"] = max(1, request.top_logprobs)
        options.update(_structured(request))
        params = SamplingParams(
            max_tokens=max(1, request.max_tokens - prefix_tokens),
            temperature=request.temperature,
            top_p=request.top_p,
            stop=request.stop or None,
            seed=request.seed,
            output_kind=RequestOutputKind.DELTA,
            **options,
        )
        text = await asyncio.to_thread(self._prompt, request, prefix)  # templating is CPU work
        self._busy += 1
        prompt_tokens = 0
        completion_tokens = 0
        finish_reason: str | None = None
        finished = False
        try:
            prompt = await self._engine_prompt(text)  # too long a prompt is refused here
            async for output in self._engine.generate(
                request_id=request.id, prompt=prompt, sampling_params=params
            ):
                if output.prompt_token_ids is not None:
                    prompt_tokens = len(output.prompt_token_ids)
                for completion in output.outputs:
                    completion_tokens += len(completion.token_ids)
                    if completion.text:
                        logprobs = (
                            _logprobs(completion, request.top_logprobs)
                            if request.logprobs
                            else None
                        )
                        yield Chunk(
                            text=completion.text,
                            n=max(1, len(completion.token_ids)),
                            logprobs=logprobs,
                        )
                    if completion.finish_reason:
                        finish_reason = completion.finish_reason
            finished = True
            yield Chunk(
                finish_reason=finish_reason or "stop",
                usage=Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens),
            )
        except (asyncio.CancelledError, GeneratorExit):
            # Cancelled, or closed early (aclose): stop the engine's work too, then go on out.
            if not finished:
                await asyncio.shield(self.abort(request.id))
            raise
        except EngineDeadError as exc:
            raise BackendError(f"vLLM engine died: {exc}", request_id=request.id) from None
        except EngineGenerateError as exc:
            raise BackendError(f"vLLM failed: {exc}", request_id=request.id) from None
        except ValueError as exc:
            if "longer than" in str(exc) or "context" in str(exc).lower():
                raise ContextTooLongError(str(exc), request_id=request.id) from None
            raise BackendError(
                f"vLLM rejected the request: {exc}", request_id=request.id, retryable=False
            ) from None
        finally:
            self._busy -= 1


def _structured(request: InferRequest) -> dict[str, Any]:
    """Sampling options that constrain the answer to JSON (vLLM's structured outputs; the
    parameter was called guided decoding before vLLM 0.10)."""
    response_format = request.response_format
    if response_format is None or response_format.type == "text":
        return {}
    schema = response_format.json_schema_of()
    spec: dict[str, Any] = {"json": schema} if schema is not None else {"json_object": True}
    try:
        from vllm.sampling_params import StructuredOutputsParams

        return {"structured_outputs": StructuredOutputsParams(**spec)}
    except ImportError:
        from vllm.sampling_params import GuidedDecodingParams

        return {"guided_decoding": GuidedDecodingParams(**spec)}


def _logprobs(completion: Any, top: int) -> list[TokenLogprob]:
    """One entry per new token: its log probability and the ``top`` likeliest alternatives."""
    found: list[TokenLogprob] = []
    for token_id, alternatives in zip(
        completion.token_ids, completion.logprobs or [], strict=False
    ):
        chosen = alternatives.get(token_id)
        if chosen is None:
            continue
        ranked = sorted(alternatives.values(), key=lambda lp: lp.rank or 0)
        found.append(
            TokenLogprob(
                token=chosen.decoded_token or "",
                logprob=float(chosen.logprob),
                top=[(lp.decoded_token or "", float(lp.logprob)) for lp in ranked[:top]]
                if top
                else None,
            )
        )
    return found
