"""The vLLM backend on a real engine and GPU: streaming, abort in the engine, continuation, and
a worker process on it serving the mesh. Skipped, saying why, where there is no CUDA GPU or no
vLLM. The model is the bundled SmolLM2-135M, converted once to a Hugging Face directory, so
nothing is downloaded."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from mesh.backends.base import Chunk
from mesh.backends.vllm import VLLMBackend
from mesh.client import MeshClient
from mesh.config import load_settings
from mesh.connection import Connection
from mesh.testing.chaos import MeshProcess, Server, free_port, wait_for_worker
from protocol.messages import InferRequest, TokenEvent
from tests.helpers import eventually


def _gpu_reason() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return "no NVIDIA GPU on this machine (nvidia-smi not found); vLLM needs CUDA"
    try:
        import vllm  # noqa: F401
    except ImportError:
        return "vLLM is not installed (pip install 'nats-llm-mesh[vllm]' on a CUDA host)"
    return None


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(_gpu_reason() is not None, reason=_gpu_reason() or ""),
    pytest.mark.timeout(900),
]

LONG = "Count from 1 to 1000, one number a line."
SHARE = 0.3  # of GPU memory for each engine: the one in process and the worker's


@pytest.fixture(scope="module")
def model_dir() -> Path:
    from mesh.testing.hf_model import hf_from_gguf

    return hf_from_gguf()


@pytest.fixture(scope="module")
async def backend(model_dir: Path) -> AsyncIterator[VLLMBackend]:
    from mesh_app.bench.vllm import model_settings

    engine = VLLMBackend(model_settings(model_dir, SHARE, slots=8))
    await engine.start()
    yield engine
    await engine.close()


async def _answer(backend: VLLMBackend, request: InferRequest, **kw: Any) -> list[Chunk]:
    return [c async for c in backend.generate(request, **kw)]


async def _probe_running(backend: VLLMBackend) -> float:
    """The most requests the engine's scheduler reported running while a probe request ran."""
    most = 0.0
    async for _chunk in backend.generate(InferRequest(prompt=LONG, max_tokens=100, temperature=0)):
        most = max(most, backend.engine.get("running", 0.0))
    return most


async def test_a_greedy_answer_streams_whole_and_the_same_twice(backend: VLLMBackend) -> None:
    request = InferRequest(prompt="Say hello to a new user.", max_tokens=48, temperature=0)
    first = await _answer(backend, request)
    again = await _answer(backend, request.model_copy(update={"id": "again"}))
    text = "".join(c.text for c in first)
    assert text.strip() and text == "".join(c.text for c in again)
    end = first[-1]
    assert end.finish_reason in ("stop", "length") and end.usage is not None
    assert end.usage.prompt_tokens > 0
    # Every generated token is counted; the stop token carries no text.
    with_text = sum(c.n for c in first if c.text)
    assert with_text <= end.usage.completion_tokens <= with_text + 1
    # The engine's own figures came through its stat logger, and it is idle again.
    assert backend.engine.get("running") == 0 and backend.engine.get("waiting") == 0


@pytest.mark.parametrize("how", ["aclose", "cancel"])
async def test_stopping_a_stream_aborts_it_in_the_engine(backend: VLLMBackend, how: str) -> None:
    request = InferRequest(id=f"abort-{how}", prompt=LONG, max_tokens=1500, temperature=0)
    stream = backend.generate(request)
    if how == "aclose":
        for _ in range(3):
            await stream.__anext__()
        await stream.aclose()
    else:

        async def read() -> None:
            async for _chunk in stream:
                pass

        task = asyncio.ensure_future(read())

        async def started() -> bool:
            return backend._busy == 1

        await eventually(started, timeout=30, what="the answer to start")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    # The engine's own bookkeeping, not this backend's counter: nothing left unfinished, and
    # its scheduler runs only the next request (it would run two had the abort not reached it).
    assert backend.engine_requests() == 0
    assert await _probe_running(backend) == 1
    capacity = backend.capacity()
    assert capacity.free == capacity.total


async def test_a_continued_answer_reads_on_from_the_prefix(backend: VLLMBackend) -> None:
    """A worker taking over an answer continues the text another worker began."""
    request = InferRequest(
        prompt="Write two sentences about the sea.", max_tokens=64, temperature=0
    )
    whole = await _answer(backend, request)
    texts = [c.text for c in whole if c.text]
    assert len(texts) > 8
    prefix, done_tokens = "".join(texts[:6]), sum(c.n for c in whole[:6])
    rest = await _answer(
        backend,
        request.model_copy(update={"id": "continued"}),
        prefix=prefix,
        prefix_tokens=done_tokens,
    )
    continued = "".join(c.text for c in rest)
    assert continued.strip()
    assert prefix + continued == "".join(texts)


async def test_a_worker_process_on_vllm_serves_the_mesh_and_cancels_in_its_engine(
    backend: VLLMBackend, model_dir: Path
) -> None:
    from mesh_app.bench.vllm import worker_env

    prompt = "Give three facts about the moon."
    greedy = InferRequest(prompt=prompt, max_tokens=64, temperature=0)
    expected = "".join(c.text for c in await _answer(backend, greedy))
    tmp = Path(tempfile.mkdtemp(prefix="mesh-gpu-"))
    server = Server(tmp / "store")
    await server.start()
    port = free_port()
    env = {**worker_env(server.url, model_dir, SHARE, 8), "MESH_WORKER_METRICS_PORT": str(port)}
    worker = MeshProcess("worker", "gpu-worker", env, tmp / "worker.log")
    try:
        await worker.start()
        settings = load_settings({("nats", "url"): server.url}, environ={})
        async with Connection(settings.nats, "gpu-probe") as conn:
            await wait_for_worker(conn, "gpu-worker", timeout=300, process=worker)
        async with MeshClient(settings=settings, first_event_timeout=60, idle_timeout=60) as c:
            answer = await c.complete(prompt, via="cloud", max_tokens=64, temperature=0)
            assert answer.text == expected  # the same engine, the same greedy tokens

            def metric(name: str) -> float:
                text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
                for line in text.decode().splitlines():
                    if line.startswith(name + " "):
                        return float(line.split()[-1])
                return float("nan")

            tokens = 0
            async for event in c.stream(LONG, via="cloud", max_tokens=1500, temperature=0):
                if isinstance(event, TokenEvent):
                    tokens += 1
                    if tokens == 5:
                        break  # leaving the stream cancels the request

            async def idle() -> bool:
                return await asyncio.to_thread(metric, "mesh_worker_requests_in_flight") == 0

            await eventually(idle, timeout=30, what="the worker to drop the cancelled request")
            probe = asyncio.ensure_future(
                c.complete(LONG, via="cloud", max_tokens=200, temperature=0)
            )
            running = 'mesh_worker_engine_load{figure="running"}'
            seen: list[float] = []
            while not probe.done():
                seen.append(await asyncio.to_thread(metric, running))
                await asyncio.sleep(0.02)
            await probe
            # The worker's engine ran the probe alone: the cancelled request left it.
            assert seen and max(seen) == 1, seen
    finally:
        await worker.stop(timeout=60)
        await server.stop()
        print((tmp / "worker.log").read_text()[-3000:])
