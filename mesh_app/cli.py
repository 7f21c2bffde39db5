"""The ``mesh`` command.

mesh demo                      start a local mesh, stream two sample answers, stop
mesh up                        run the local mesh (nats-server + worker + edge) until Ctrl-C
mesh ask "PROMPT" [--route auto|local|cloud] [--via edge|cloud]
mesh worker | mesh edge        run one role against MESH_NATS_URL
mesh provision                 create/update the hub's streams and consumers
mesh status [--json]           workers, edges, capacity, queue depth and pending acks
mesh bench [PART] [--json F]   paths, relay, model, overload, fleet, cascade, failover;
                               only when named: vllm (GPU), registry, embedded, confidence
mesh router train | eval       rebuild the shipped router weights / evaluate the router
mesh router score --data DIR   score labelled data with the shipped weights [--json]
mesh creds --out DIR --edge ID... --worker ID... [--expires-in 30d]
                               hub auth config + per-edge/worker credentials (least privilege)
mesh config                    list every setting with its env var and default
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any

from mesh import heap
from mesh.config import MeshSettings, describe_settings
from mesh.logs import get_logger
from mesh.tasks import first_of
from mesh_app.args import ENGINE_EXTRAS
from mesh_app.args import build_parser as _parser
from mesh_app.args import require_extra as _require
from mesh_app.args import settings_from_args as _settings
from protocol.errors import MeshError
from protocol.messages import EndEvent, RestartEvent, TokenEvent

if TYPE_CHECKING:
    from mesh.backends.base import Backend
    from mesh.connection import Connection

log = get_logger(__name__)
DEMO_PROMPTS = (
    "Say hello to a new user in one short sentence.",
    "A train leaves at 3:15 pm and travels 240 km at 80 km/h. Explain step by step when it "
    "arrives, then compute 17 * 23 as a check.",
)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "config":
        for env, default, doc in describe_settings():
            print(f"{env:<38} {default!s:<28} {doc}")
        return 0
    if args.command == "creds":
        return _creds(args)
    try:
        # Settings read first: a bad one is a usage error (2), not a failure of the command.
        if args.command == "ask":
            settings = _settings(args, quiet=True)
            return _run(lambda: _ask(settings, args))
        if args.command == "demo":
            settings = _settings(args, quiet=True)
            settings.nats.local_port = -1  # never collide with a running `mesh up`
            settings.edge.http_port = -1
            settings.worker.metrics_port = settings.edge.metrics_port = -1
            return _run(lambda: _demo(settings, args))
        if args.command == "up":
            settings = _settings(args)
            return _run(lambda: _up(settings))
        if args.command in ("worker", "edge"):
            settings = _settings(args)
            return _run(lambda: _serve_role(settings, args.command))
        if args.command == "provision":
            settings = _settings(args)
            return _run(lambda: _provision(settings, args.models))
        if args.command == "router":
            from mesh_app.router.commands import router_eval, router_score, router_train

            router_settings = _settings(args, quiet=True).edge.router
            data_dir = router_settings.data_dir
            if args.router_command == "train":
                return router_train(data_dir, args.out)
            if args.router_command == "score":
                return router_score(router_settings, max(1, args.window), args.json)
            return router_eval(data_dir, args.group_seeds, args.latency_n)
        if args.command == "bench":
            from mesh_app.bench import ALL
            from mesh_app.bench import run as run_bench

            _settings(args, quiet=True)
            parts = list(ALL) if args.part == "all" else [args.part]
            if "vllm" in parts:
                _require("vllm", "vllm", "mesh bench vllm")
            options = {
                name: getattr(args, name)
                for name in getattr(args, "bench_options", ())
                if hasattr(args, name)
            }
            return _run(lambda: run_bench(parts, args.json_path, options))
        if args.command == "status":
            settings = _settings(args, quiet=True)
            return _run(lambda: _status(settings, args.json))
    except MeshError as err:
        print(f"mesh: error: {err}", file=sys.stderr)
        return 2
    return 1


def _creds(args: argparse.Namespace) -> int:
    from pathlib import Path

    from mesh_app.creds import describe, mint, parse_duration

    try:
        expires = parse_duration(args.expires_in) if args.expires_in else None
        clients = []
        for pair in args.client:
            edge, sep, app = pair.partition(":")
            if not sep:
                raise ValueError(f"--client {pair!r}: write EDGE:APP")
            clients.append((edge, app))
        minted = mint(
            Path(args.out),
            edges=args.edge,
            workers=args.worker,
            clients=clients,
            expires_in=expires,
            mount=args.mount,
            hub_leaf_url=args.hub_leaf_url,
            leaf_tls_ca=args.leaf_tls_ca,
            leaf_store_dir=args.leaf_store_dir,
        )
    except (ValueError, MeshError) as exc:  # a bad id or duration; bad MESH_* settings
        print(f"mesh: error: {exc}", file=sys.stderr)
        return 2
    print(describe(minted))
    print(
        f"# Add `include {minted.auth_conf.name}` to the hub's nats-server config (same "
        "directory); give each process its .creds and .env; keep keys/ offline.",
        file=sys.stderr,
    )
    return 0


def _run(factory: Callable[[], Awaitable[int]]) -> int:
    async def runner() -> int:
        return await factory()

    try:
        return asyncio.run(runner())
    except MeshError as err:
        print(f"mesh: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


class _Stop:
    """SIGINT and SIGTERM, from when a process may take work (enter it then): the first asks for
    an ordered stop, in which its nodes drain what they took; a second, while that runs, ends
    the process at once (an operator who will not wait; a supervisor's SIGKILL would too).
    Before that the defaults stand: the process ends at once, with nothing taken to lose and no
    model load to wait out."""

    def __init__(self, conn: Connection | None = None) -> None:
        self._asked = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self._conn = conn
        self.lost = False
        """Whether the stop came from the NATS connection closed for good, not a signal: the
        process then exits 1, and its supervisor starts it again (connecting anew)."""

    def __enter__(self) -> _Stop:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._loop.add_signal_handler(sig, self._signalled, sig)
        return self

    def _signalled(self, sig: signal.Signals) -> None:
        if not self._asked.is_set():
            self._asked.set()
            log.warning("stopping in order; signal again to stop at once", signal=sig.name)
            return
        log.warning("stopping at once", signal=sig.name)
        self._loop.remove_signal_handler(sig)
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)

    def __exit__(self, *_exc: object) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._loop.remove_signal_handler(sig)

    async def unless_asked(self, work: Coroutine[Any, Any, Any]) -> bool:
        """Await a step of the start; False, the step cancelled, when a stop is asked first."""
        ended, _ = await first_of(work, self._asked)
        return bool(ended)

    async def wait(self) -> None:
        """Until a signal asks for the stop, or the server closed the connection for good."""
        heap.settle()  # once the node serves: mesh.heap
        closed = self._conn.closed_for_good if self._conn is not None else asyncio.Event()
        asked, _ = await first_of(self._asked.wait(), closed)
        if not asked:
            self.lost = True
            log.error("stopping: the server closed the NATS connection for good; exiting 1")


async def _up(settings: MeshSettings) -> int:
    from mesh_app.local import LocalMesh

    async with LocalMesh(settings) as mesh, contextlib.AsyncExitStack() as stack:
        assert mesh.edge is not None
        stop = stack.enter_context(_Stop(mesh.conn))  # before the banner: a stop it asks for
        print(f"mesh is up: NATS {mesh.nats_url}, edge subject {mesh.edge.subject}", flush=True)
        if mesh.edge.http is not None:
            print(f"  OpenAI-compatible API: {mesh.edge.http.url}/v1", flush=True)
        for nodes, where in mesh.metrics_pages():
            print(f"  Prometheus metrics ({nodes}): {where}", flush=True)
        print(f'  try: mesh ask --nats-url {mesh.nats_url} "What is 2+2?"', flush=True)
        print("  Ctrl-C stops everything", flush=True)
        await stop.wait()
        print("stopping...", flush=True)
    print("stopped", flush=True)
    return 1 if stop.lost else 0


async def _demo(settings: MeshSettings, args: argparse.Namespace) -> int:
    from mesh.client import MeshClient
    from mesh_app.local import LocalMesh

    prompts = args.prompts or list(DEMO_PROMPTS)
    print("starting a local mesh: nats-server, one cloud worker, one edge node ...", flush=True)
    async with LocalMesh(settings) as mesh:
        print(f"up at {mesh.nats_url}\n", flush=True)
        async with MeshClient(settings=mesh.settings) as client:
            for prompt in prompts:
                print(f">>> {prompt}", flush=True)
                await _print_stream(client, prompt, args)
                print(flush=True)
    return 0


async def _ask(settings: MeshSettings, args: argparse.Namespace) -> int:
    from mesh.client import MeshClient
    from mesh.connection import Connection

    async with (
        Connection(settings.nats, "mesh-ask", patient=False) as conn,
        MeshClient(settings=settings, connection=conn) as client,
    ):
        if args.json:
            answer = await client.complete(
                args.prompt,
                via=args.via,
                route=args.route,
                model=args.ask_model,
                max_tokens=args.max_tokens,
                temperature=args.temperature,
                seed=args.seed,
            )
            out = answer.end.model_dump(mode="json", exclude_none=True)
            out.update(text=answer.text, restarts=answer.restarts)
            print(json.dumps(out, indent=2))
            return 0
        await _print_stream(client, args.prompt, args)
    return 0


async def _print_stream(client: Any, prompt: str, args: argparse.Namespace) -> None:
    async for event in client.stream(
        prompt,
        via=args.via,
        route=args.route,
        model=getattr(args, "ask_model", None),
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        seed=args.seed,
    ):
        if isinstance(event, TokenEvent):
            sys.stdout.write(event.text)
            sys.stdout.flush()
        elif isinstance(event, RestartEvent):
            sys.stdout.write(f"\n[restarted: {event.reason}]\n")
        elif isinstance(event, EndEvent):
            print("\n" + _summary(event), flush=True)


def _summary(end: EndEvent) -> str:
    where = "edge (local model)" if end.path == "local" else "cloud (worker pool)"
    t = end.timings
    parts = [f"served by {where}: {end.served_by}"]
    if t.ttft_ms is not None:
        parts.append(f"TTFT {t.ttft_ms:.0f} ms")
    parts.append(f"{end.usage.completion_tokens} tokens")
    if t.tokens_per_s:
        parts.append(f"{t.tokens_per_s:.0f} tok/s")
    parts.append(f"finish={end.finish_reason}")
    line = "-- " + " | ".join(parts)
    if end.routing is not None:
        line += f"\n-- route: {end.routing.decision}, {end.routing.reason}"
    if end.fallback:
        line += f"\n-- fell back to local: {end.fallback}"
    return line


async def _serve_role(settings: MeshSettings, role: str) -> int:
    from mesh.backends import create_backend
    from mesh.connection import Connection
    from mesh.metrics import exposition

    model_settings = settings.worker.model if role == "worker" else settings.edge.model
    if model_settings.backend in ENGINE_EXTRAS:
        module, extra = ENGINE_EXTRAS[model_settings.backend]
        _require(module, extra, f"the {role}'s {model_settings.backend} backend")
    if role == "edge":
        _require("numpy", "edge", "the edge's router")
    metrics_port = settings.worker.metrics_port if role == "worker" else settings.edge.metrics_port
    backend = create_backend(model_settings)
    await backend.start()
    if metrics_port >= 0:
        port = exposition.serve(metrics_port, setting=f"MESH_{role.upper()}_METRICS_PORT")
        print(f"Prometheus metrics on port {port}", flush=True)
    try:
        async with Connection(settings.nats, f"mesh-{role}", source=role == "worker") as conn:
            with _Stop(conn) as stop:  # a start takes requests before it ends
                if role == "worker":
                    await _serve_workers(settings, conn, backend, stop)
                else:
                    from edge_node.node import EdgeNode
                    from edge_node.routing import create_router

                    edge = EdgeNode(settings, conn, backend, create_router(settings.edge.router))
                    if await stop.unless_asked(edge.start()):
                        try:
                            await stop.wait()
                        finally:
                            await edge.stop()
    finally:
        await backend.close()
        exposition.stop()
    return 1 if stop.lost else 0


async def _serve_workers(
    settings: MeshSettings, conn: Connection, backend: Backend, stop: _Stop
) -> None:
    """One worker per model the engine serves (``worker.also_serve``), on one connection;
    started in order, stopped in reverse. A stop asked while one starts (its engine, or its
    provisioning, which can take seconds while JetStream does not answer) leaves that start, as
    a killed process would, and stops the workers that serve in order."""
    from cloud_node.worker import Worker
    from mesh.backends import create_backend
    from mesh.provision import served_models

    async with contextlib.AsyncExitStack() as stack:
        for index, worker in enumerate(served_models(settings.worker)):
            engine = backend
            if index:
                engine = create_backend(worker.model)
                stack.push_async_callback(engine.close)
                if not await stop.unless_asked(engine.start()):
                    break
            node = Worker(settings.model_copy(update={"worker": worker}), conn, engine)
            if not await stop.unless_asked(node.start()):
                break
            stack.push_async_callback(node.stop)
        await stop.wait()


async def _status(settings: MeshSettings, as_json: bool) -> int:
    from mesh.connection import Connection
    from mesh.status import collect_status, render

    async with Connection(settings.nats, "mesh-status", patient=False) as conn:
        status = await collect_status(conn, settings)
    print(json.dumps(status, indent=2) if as_json else "\n".join(render(status)))
    queue = status.get("queue")
    if status["registry"] != "ok" and isinstance(queue, dict) and "unavailable" in queue:
        print(
            "mesh status: the hub's JetStream did not answer (its registry nor its queue): run "
            "it where the hub is reachable, under credentials that may read it (operator.env)",
            file=sys.stderr,
        )
        return 1
    return 0


async def _provision(settings: MeshSettings, models: list[str] | None) -> int:
    """Everything the hub's workers use, so that workers under least-privilege credentials find
    it in place: the queue and its consumers, the answer store, kept answers, leases. Asked
    again, as a worker's start does, while JetStream does not answer yet."""
    from mesh.connection import Connection
    from mesh.hub import provision_hub
    from mesh.provision import provisioned

    names = models or [settings.worker.model.name]
    async with Connection(settings.nats, "mesh-provision") as conn:
        # A server that just started may not answer its JetStream API yet: asked again.
        hub = await provisioned(lambda: provision_hub(conn.jsm(), settings.stream, names))
    print(f"streams ready: {', '.join(hub.streams)}; consumers for: {', '.join(names)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
