"""The cloud worker on the other engines: a real OpenAI-compatible server (llama-cpp-python's own
``llama_cpp.server``), and vLLM where a GPU exists."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from cloud_node.worker import Worker
from mesh.backends.openai_http import OpenAIHTTPBackend
from mesh.client import MeshClient
from mesh.config import MeshSettings, ModelSettings
from mesh.connection import Connection
from mesh.models import bundled_model_path
from protocol.errors import UnavailableError
from protocol.messages import InferRequest
from tests.helpers import eventually, queue_drained, stat_reaches


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def openai_server() -> Iterator[str]:
    """llama_cpp.server on a free port, ready when GET /v1/models answers (60 s limit)."""
    port = _free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "llama_cpp.server",
            "--model",
            str(bundled_model_path()),
            "--model_alias",
            "smollm2",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--n_ctx",
            "2048",
            "--verbose",
            "False",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    base = f"http://127.0.0.1:{port}/v1"
    deadline = time.monotonic() + 60
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"llama_cpp.server exited: {proc.stderr.read().decode()[-800:]}")  # type: ignore[union-attr]
            with contextlib.suppress(OSError):
                import urllib.request

                with urllib.request.urlopen(f"{base}/models", timeout=1) as resp:
                    if resp.status == 200:
                        break
            if time.monotonic() > deadline:
                raise RuntimeError("llama_cpp.server not ready within 60 s")
            time.sleep(0.2)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture
async def http_backend(openai_server: str) -> AsyncIterator[OpenAIHTTPBackend]:
    # llama_cpp.server generates one stream at a time (a second one interrupts the first).
    backend = OpenAIHTTPBackend(ModelSettings(backend="openai", base_url=openai_server, slots=1))
    await backend.start()
    yield backend
    await backend.close()


async def test_http_backend_streams_with_usage(http_backend: OpenAIHTTPBackend) -> None:
    assert (await http_backend.health()).ok
    chunks = [
        c
        async for c in http_backend.generate(
            InferRequest(prompt="Say hi.", max_tokens=8, temperature=0)
        )
    ]
    assert "".join(c.text for c in chunks).strip()
    assert chunks[-1].finish_reason in {"stop", "length"}
    assert chunks[-1].usage is not None and 0 < chunks[-1].usage.completion_tokens <= 8


async def test_worker_on_http_backend_serves_the_queue(
    http_backend: OpenAIHTTPBackend, settings: MeshSettings, conn: Connection, client: MeshClient
) -> None:
    async with Worker(settings, conn, http_backend) as worker:
        answers = await asyncio.gather(
            *(
                client.complete(f"Name fruit number {n}.", via="cloud", max_tokens=8, temperature=0)
                for n in range(3)
            )
        )
    assert all(a.path == "cloud" and a.text.strip() for a in answers)
    await stat_reaches(worker.stats, "completed", 3)
    await eventually(lambda: queue_drained(conn, settings), what="acked")


async def test_http_backend_down_is_a_typed_retryable_error() -> None:
    backend = OpenAIHTTPBackend(
        ModelSettings(
            backend="openai", base_url=f"http://127.0.0.1:{_free_port()}/v1", http_timeout=2
        )
    )
    await backend.start()
    try:
        with pytest.raises(UnavailableError) as excinfo:
            async for _chunk in backend.generate(InferRequest(prompt="hi", max_tokens=2)):
                pass
        assert excinfo.value.retryable
        assert not (await backend.health()).ok
    finally:
        await backend.close()


async def test_http_stream_cut_off_is_a_retryable_backend_error() -> None:
    """An upstream that drops the stream mid-answer must not look like a finished answer."""
    from aiohttp import web

    from protocol.errors import BackendError

    async def truncated(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        chunk = {"choices": [{"index": 0, "delta": {"content": "Hel"}, "finish_reason": None}]}
        await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        return resp  # ends without a finish_reason or [DONE]

    app = web.Application()
    app.router.add_post("/v1/chat/completions", truncated)
    runner = web.AppRunner(app)
    await runner.setup()
    port = _free_port()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    backend = OpenAIHTTPBackend(
        ModelSettings(backend="openai", base_url=f"http://127.0.0.1:{port}/v1")
    )
    await backend.start()
    try:
        received: list[str] = []

        async def consume() -> None:
            async for chunk in backend.generate(InferRequest(prompt="hi", max_tokens=4)):
                received.append(chunk.text)

        with pytest.raises(BackendError) as excinfo:
            await consume()
        assert received == ["Hel"] and excinfo.value.retryable
    finally:
        await backend.close()
        await runner.cleanup()


async def test_a_closed_backend_leaves_no_session_open() -> None:
    # The HTTP backend must not leak connections: closing it closes its aiohttp session.
    backend = OpenAIHTTPBackend(ModelSettings(backend="openai"))
    await backend.start()
    session = backend._session
    assert session is not None and not session.closed
    await backend.close()
    assert session.closed


async def test_an_engine_at_its_batch_limit_takes_no_more_work() -> None:
    """The HTTP backend reads the server's vLLM /metrics: while the engine queues requests,
    the worker's free slots are 0, so new work waits in JetStream for any worker."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "mesh.testing.openai_server",
        "--engine-slots",
        "1",
        "--token-ms",
        "50",
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        port = int((await asyncio.wait_for(proc.stdout.readline(), 30)).split()[-1])
        url = f"http://127.0.0.1:{port}/v1"
        backend = OpenAIHTTPBackend(
            ModelSettings(backend="openai", base_url=url, slots=8, metrics_interval=0.1)
        )
        await backend.start()
        assert backend.capacity().free == 8 and backend.engine["waiting"] == 0
        # Three requests straight to the engine: it runs one and queues two.
        streams = [backend.generate(InferRequest(prompt="x", max_tokens=40)) for _ in range(3)]
        firsts = [asyncio.ensure_future(s.__anext__()) for s in streams]

        async def saturated() -> bool:
            return backend.engine.get("waiting") == 2 and backend.capacity().free == 0

        await eventually(saturated, timeout=5, what="the engine's queue to show in capacity")
        assert backend.engine["running"] == 1
        for first in firsts:
            first.cancel()
        await asyncio.gather(*firsts, return_exceptions=True)
        for stream in streams:
            await stream.aclose()
        await backend.close()
    finally:
        proc.kill()
        await proc.wait()


def test_vllm_engine_options_come_from_config_and_cli() -> None:
    """Engine options pass through to vLLM's AsyncEngineArgs (checked without a GPU)."""
    import argparse
    import json as _json

    from mesh.backends.vllm import VLLMBackend
    from mesh_app.cli import _parser, _settings

    args = _parser().parse_args(
        [
            "worker",
            "--backend",
            "vllm",
            "--model",
            "Qwen/Qwen2.5-1.5B-Instruct",
            "--slots",
            "64",
            "--tensor-parallel-size",
            "2",
            "--quantization",
            "awq",
            "--enable-prefix-caching",
            "--gpu-memory-utilization",
            "0.9",
            "--speculative-config",
            _json.dumps({"method": "ngram", "num_speculative_tokens": 4}),
        ]
    )
    assert isinstance(args, argparse.Namespace)
    settings = _settings(args)
    settings.worker.model.engine_args = {"max_num_batched_tokens": 8192}
    options = VLLMBackend(settings.worker.model).engine_options()
    assert options["model"] == "Qwen/Qwen2.5-1.5B-Instruct"
    assert options["max_num_seqs"] == 64 and options["tensor_parallel_size"] == 2
    assert options["quantization"] == "awq" and options["enable_prefix_caching"] is True
    assert options["gpu_memory_utilization"] == 0.9
    assert options["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 4}
    assert options["max_num_batched_tokens"] == 8192


def test_an_engine_that_queues_or_fills_its_cache_takes_no_more_work() -> None:
    from mesh.backends.vllm import VLLMBackend

    backend = VLLMBackend(ModelSettings(backend="vllm", path="some/model", slots=16))
    assert backend.capacity().free == 16  # no figures yet: slots alone
    backend.engine = {"running": 10.0, "waiting": 0.0, "kv_cache": 0.5}
    assert backend.capacity().free == 16
    backend.engine = {"running": 16.0, "waiting": 3.0, "kv_cache": 0.5}
    assert backend.capacity().free == 0  # the engine queues: the work waits in JetStream
    backend.engine = {"running": 4.0, "waiting": 0.0, "kv_cache": 0.97}
    assert backend.capacity().free == 0  # its KV cache is nearly full


def _vllm_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


@pytest.mark.skipif(_vllm_installed(), reason="vLLM is installed here: the worker would start")
async def test_a_vllm_worker_without_vllm_exits_saying_what_to_install(tmp_path: Path) -> None:
    """The worker process exits with a clear error, and whoever waits for it hears at once."""
    from mesh.testing.chaos import MeshProcess, Server, wait_for_worker

    server = Server(tmp_path / "store")
    await server.start()
    env = {
        "MESH_NATS_URL": server.url,
        "MESH_WORKER_NODE_ID": "no-vllm",
        "MESH_WORKER_MODEL_BACKEND": "vllm",
        "MESH_WORKER_MODEL_PATH": "some/model",
    }
    worker = MeshProcess("worker", "no-vllm", env, tmp_path / "worker.log")
    try:
        await worker.start()
        settings = MeshSettings.model_validate({"nats": {"url": server.url}})
        began = time.monotonic()
        async with Connection(settings.nats, "probe") as conn:
            with pytest.raises(AssertionError, match="exited") as failed:
                await wait_for_worker(conn, "no-vllm", timeout=60, process=worker)
        assert time.monotonic() - began < 30
        assert "needs 'vllm', which this install lacks" in str(failed.value)
        assert "nats-llm-mesh[vllm]" in str(failed.value)
        assert worker.proc is not None and worker.proc.returncode != 0
    finally:
        await worker.stop()
        await server.stop()


async def test_the_worker_exports_the_engine_s_own_load(
    settings: MeshSettings, conn: Connection
) -> None:
    """Operators see what the engine reports (the gauges read the backend's figures live)."""
    backend = OpenAIHTTPBackend(ModelSettings(backend="openai", slots=8))
    registry = Worker(settings, conn, backend).metrics.registry

    def load(figure: str) -> float | None:
        return registry.get_sample_value("mesh_worker_engine_load", {"figure": figure})

    assert (load("running"), load("waiting"), load("kv_cache")) == (0.0, 0.0, 0.0)
    backend.engine = {"running": 8.0, "waiting": 3.0, "kv_cache": 0.42}
    assert (load("running"), load("waiting"), load("kv_cache")) == (8.0, 3.0, 0.42)


def test_a_data_parallel_server_s_load_sums_requests_and_takes_the_fullest_cache() -> None:
    """vllm serve --data-parallel-size 2 reports each engine under its own label set."""
    from mesh.backends.openai_http import engine_load

    text = "\n".join(
        [
            "# HELP vllm:num_requests_running Number of requests in model execution batches.",
            "# TYPE vllm:num_requests_running gauge",
            'vllm:num_requests_running{engine="0",model_name="qwen"} 5.0',
            'vllm:num_requests_running{engine="1",model_name="qwen"} 7.0',
            'vllm:num_requests_waiting{engine="0",model_name="qwen"} 0.0',
            'vllm:num_requests_waiting{engine="1",model_name="qwen"} 2.0',
            'vllm:kv_cache_usage_perc{engine="0",model_name="qwen"} 0.5',
            'vllm:kv_cache_usage_perc{engine="1",model_name="qwen"} 0.625',
        ]
    )
    # Two half-full caches are not one full one.
    assert engine_load(text) == {"running": 12.0, "waiting": 2.0, "kv_cache": 0.625}
    assert engine_load("# no vLLM here\nhttp_requests_total 3.0") is None


@pytest.mark.skipif(_vllm_installed(), reason="vLLM is installed here: the bench would run")
def test_mesh_bench_vllm_without_vllm_says_what_to_install() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "mesh_app.cli", "bench", "vllm"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert "mesh bench vllm needs 'vllm', which this install lacks" in result.stderr
    assert "Traceback" not in result.stderr


def test_converting_the_bundled_model_without_torch_says_what_to_install() -> None:
    import importlib.util

    if importlib.util.find_spec("torch") is not None:
        pytest.skip("torch is installed here: the conversion would run")
    from mesh.testing.hf_model import hf_from_gguf

    with pytest.raises(UnavailableError, match=r"nats-llm-mesh\[vllm\]") as failed:
        hf_from_gguf(Path("/nonexistent/smollm2-hf"))
    assert not failed.value.retryable


class _FakeVLLMEngine:
    """An AsyncLLM stand-in: records what ``generate`` was given and streams one short answer;
    with ``rendered``, a ``renderer`` as vLLM 0.26 has one (``render_cmpl_async`` returns typed
    EngineInputs)."""

    def __init__(self, *, rendered: bool) -> None:
        from types import SimpleNamespace

        self.prompts: list[object] = []
        self.render_calls: list[tuple[list[dict[str, str]], object]] = []
        if rendered:
            self.renderer = SimpleNamespace(
                default_cmpl_tok_params="default-tok-params", render_cmpl_async=self._render
            )

    async def _render(
        self, prompts: list[dict[str, str]], tok_params: object = None
    ) -> list[dict[str, object]]:
        self.render_calls.append((prompts, tok_params))
        text = prompts[0]["prompt"]
        if "too long" in text:
            raise ValueError("This model's maximum context length is 2048 tokens. However, ...")
        return [{"type": "token", "prompt_token_ids": [1, 2, 3], "prompt": text}]

    async def generate(
        self, *, request_id: str, prompt: object, sampling_params: object
    ) -> AsyncIterator[object]:
        from types import SimpleNamespace

        self.prompts.append(prompt)
        done = SimpleNamespace(text="Hi.", token_ids=[7, 8], finish_reason="stop", logprobs=None)
        yield SimpleNamespace(prompt_token_ids=[1, 2, 3], outputs=[done])


@pytest.fixture
def fake_vllm_modules(monkeypatch: pytest.MonkeyPatch) -> None:
    """The few vLLM names ``VLLMBackend.generate`` imports, where vLLM is not installed."""
    if _vllm_installed():
        return
    from types import ModuleType, SimpleNamespace

    class SamplingParams:
        def __init__(self, **kwargs: object) -> None:
            self.__dict__.update(kwargs)

    class EngineError(Exception):
        pass

    modules: dict[str, dict[str, object]] = {
        "vllm": {},
        "vllm.sampling_params": {
            "SamplingParams": SamplingParams,
            "RequestOutputKind": SimpleNamespace(DELTA="delta"),
        },
        "vllm.v1": {},
        "vllm.v1.engine": {},
        "vllm.v1.engine.exceptions": {
            "EngineDeadError": EngineError,
            "EngineGenerateError": EngineError,
        },
    }
    for name, attributes in modules.items():
        module = ModuleType(name)
        module.__dict__.update(attributes)
        monkeypatch.setitem(sys.modules, name, module)


def _started_on(backend: object, engine: _FakeVLLMEngine) -> None:
    """``backend`` as if started, on ``engine``, with a chat template that marks the turn."""
    from types import SimpleNamespace

    backend._engine = engine  # type: ignore[attr-defined]
    backend._tokenizer = SimpleNamespace(  # type: ignore[attr-defined]
        apply_chat_template=lambda messages, **_kw: f"<chat>{messages[-1]['content']}</chat>"
    )


@pytest.mark.usefixtures("fake_vllm_modules")
@pytest.mark.parametrize("rendered", [True, False], ids=["renderer", "no-renderer"])
async def test_the_vllm_engine_gets_a_prompt_dict_not_a_bare_string(rendered: bool) -> None:
    """vLLM 0.26 deprecates raw prompts: the engine gets what its renderer made (a dict with a
    type), or, from a vLLM without a renderer, a TextPrompt dict; never a str."""
    from mesh.backends.vllm import VLLMBackend

    engine = _FakeVLLMEngine(rendered=rendered)
    backend = VLLMBackend(ModelSettings(backend="vllm", path="some/model", slots=4))
    _started_on(backend, engine)
    request = InferRequest(prompt="Say hi.", max_tokens=4, temperature=0)
    chunks = [c async for c in backend.generate(request)]
    assert "".join(c.text for c in chunks) == "Hi."
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == 3
    (prompt,) = engine.prompts
    assert isinstance(prompt, dict)
    chat = "<chat>Say hi.</chat>"
    if rendered:
        assert engine.render_calls == [([{"prompt": chat}], "default-tok-params")]
        assert prompt == {"type": "token", "prompt_token_ids": [1, 2, 3], "prompt": chat}
    else:
        assert prompt == {"prompt": chat}


@pytest.mark.usefixtures("fake_vllm_modules")
async def test_a_prompt_the_vllm_renderer_finds_too_long_is_a_typed_error() -> None:
    from mesh.backends.vllm import VLLMBackend
    from protocol.errors import ContextTooLongError

    engine = _FakeVLLMEngine(rendered=True)
    backend = VLLMBackend(ModelSettings(backend="vllm", path="some/model", slots=4))
    _started_on(backend, engine)
    with pytest.raises(ContextTooLongError):
        async for _chunk in backend.generate(InferRequest(prompt="too long", max_tokens=4)):
            pass
    assert engine.prompts == [] and backend.capacity().free == 4
