"""The ``mesh`` command's arguments: the parser, and the settings they make (flags over env vars
over defaults); and the check that an optional engine or exporter is installed."""

from __future__ import annotations

import argparse
import importlib.util
import json
from collections.abc import Callable
from typing import Any

from mesh import __version__
from mesh.config import MeshSettings, load_settings
from mesh.logs import configure_logging
from protocol.errors import ErrorCode, MeshError

# CLI flag -> config path. Flags left unset fall through to env vars, then defaults.
_FLAGS: dict[str, tuple[str, ...]] = {
    "nats_url": ("nats", "url"),
    "port": ("nats", "local_port"),
    "log_level": ("log", "level"),
    "log_format": ("log", "format"),
    "edge_id": ("edge", "edge_id"),
    "cloud_model": ("edge", "cloud_model"),
    "threshold": ("edge", "router", "threshold"),
    "router": ("edge", "router", "kind"),
    "start_timeout": ("edge", "cloud_start_timeout"),
    "http_port": ("edge", "http_port"),
    "data": ("edge", "router", "data_dir"),
}
_MODEL_FLAGS = {
    "model": "path",
    "model_name": "name",
    "backend": "backend",
    "base_url": "base_url",
    "slots": "slots",
    "tensor_parallel_size": "tensor_parallel_size",
    "quantization": "quantization",
    "enable_prefix_caching": "enable_prefix_caching",
    "gpu_memory_utilization": "gpu_memory_utilization",
    "speculative_config": "speculative_config",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mesh", description="NATS JetStream edge/cloud LLM mesh")
    parser.add_argument("--version", action="version", version=f"mesh {__version__}")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--nats-url", help="NATS server URL (env MESH_NATS_URL)")
    common.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    common.add_argument("--log-format", choices=["auto", "json", "console"])
    model = argparse.ArgumentParser(add_help=False)
    model.add_argument(
        "--model", help="GGUF path (llama_cpp) or model id (vllm); default: bundled SmolLM2-135M"
    )
    model.add_argument("--model-name", help="model name on the queue subject (default smollm2)")
    model.add_argument("--backend", choices=["llama_cpp", "openai", "vllm", "deterministic"])
    model.add_argument("--base-url", help="OpenAI-compatible server base URL (openai backend)")
    model.add_argument("--slots", type=int, help="concurrent generations (vLLM: max_num_seqs)")
    model.add_argument("--tensor-parallel-size", type=int, help="vLLM: GPUs per replica")
    model.add_argument("--quantization", help="vLLM: awq, gptq, fp8, ...")
    model.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="vLLM: reuse the KV cache of shared prompt prefixes",
    )
    model.add_argument("--gpu-memory-utilization", type=float, help="vLLM: share of GPU memory")
    model.add_argument(
        "--speculative-config", type=json.loads, help="vLLM: speculative decoding, as JSON"
    )
    edge = argparse.ArgumentParser(add_help=False)
    edge.add_argument("--edge-id", help="edge id (subject mesh.v1.edge.<id>.infer)")
    edge.add_argument("--cloud-model", help="cloud model escalations go to")
    edge.add_argument("--threshold", type=float, help="router threshold (escalate at score >= it)")
    edge.add_argument("--router", choices=["heuristic", "learned"])
    edge.add_argument("--start-timeout", type=float, help="seconds to wait for the cloud to start")
    edge.add_argument(
        "--http-port",
        type=int,
        help="OpenAI-compatible HTTP API port (default 8080; -1 off; 0 any free)",
    )
    ask_opts = argparse.ArgumentParser(add_help=False)
    ask_opts.add_argument("--route", choices=["auto", "local", "cloud"], default="auto")
    ask_opts.add_argument(
        "--via",
        choices=["edge", "cloud"],
        default="edge",
        help="ask an edge (routes) or the cloud queue directly",
    )
    ask_opts.add_argument("--max-tokens", type=int, default=256)
    ask_opts.add_argument("--temperature", type=float, default=0.7)
    ask_opts.add_argument("--seed", type=int)

    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser(
        "up",
        parents=[common, model, edge],
        help="run a local mesh (nats-server + worker + edge) until Ctrl-C",
        description="Run a local mesh (nats-server + worker + edge) until Ctrl-C. Prometheus "
        "metrics: the edge's on the HTTP API's /metrics (and on MESH_EDGE_METRICS_PORT when "
        "set); the worker's there too, or only on MESH_WORKER_METRICS_PORT when that is set.",
    )
    up.add_argument("--port", type=int, help="local nats-server port (default 4222; -1: any free)")
    demo = sub.add_parser(
        "demo",
        parents=[common, model, edge, ask_opts],
        help="start a local mesh, stream sample answers, stop",
    )
    demo.add_argument("prompts", nargs="*", help="prompts to ask (default: two samples)")
    demo.set_defaults(max_tokens=96)
    ask = sub.add_parser(
        "ask", parents=[common, ask_opts], help="stream an answer from a running mesh"
    )
    ask.add_argument("prompt")
    ask.add_argument("--edge-id", help="edge to ask (default: local)")
    ask.add_argument("--model", dest="ask_model", help="cloud model to use")
    ask.add_argument("--json", action="store_true", help="print the whole answer as JSON")
    sub.add_parser("worker", parents=[common, model], help="run a cloud worker")
    sub.add_parser("edge", parents=[common, model, edge], help="run an edge node")
    prov = sub.add_parser(
        "provision", parents=[common], help="create/update the hub's streams and consumers"
    )
    prov.add_argument(
        "--model-name",
        action="append",
        dest="models",
        help="model to provision a consumer for (repeatable)",
    )
    status = sub.add_parser(
        "status", parents=[common], help="workers, edges, capacity, queue depth, pending acks"
    )
    status.add_argument("--json", action="store_true", help="print the status as JSON")
    router = sub.add_parser("router", help="train, evaluate or score the learned router")
    router_sub = router.add_subparsers(dest="router_command", required=True)
    data = argparse.ArgumentParser(add_help=False)
    data.add_argument("--data", help="routing data directory (default ../shared/routing)")
    train = router_sub.add_parser("train", parents=[data], help="rebuild the router weights")
    train.add_argument("--out", help="weights file (default: the one the edge ships with)")
    evaluate = router_sub.add_parser("eval", parents=[data], help="metrics vs baselines")
    evaluate.add_argument(
        "--group-seeds",
        type=int,
        default=3,
        help="extra shuffled subject-held-out splits to average (default 3)",
    )
    evaluate.add_argument(
        "--latency-n",
        type=int,
        default=1000,
        help="single decisions timed for p50/p99 (default 1000)",
    )
    score = router_sub.add_parser(
        "score",
        parents=[data],
        help="score a labelled directory with the shipped weights (no retraining)",
    )
    score.add_argument("--json", action="store_true", help="print the results as JSON")
    score.add_argument(
        "--window",
        type=int,
        default=500,
        help="prompts per window for the realized cloud share (default 500)",
    )
    _bench_parser(sub, common)
    creds = sub.add_parser(
        "creds", help="write the hub's auth config and credentials for edges, workers, operator"
    )
    creds.add_argument("--out", required=True, help="directory for auth.conf, *.creds, *.env")
    creds.add_argument("--edge", action="append", default=[], help="an edge id (repeatable)")
    creds.add_argument("--worker", action="append", default=[], help="a worker id (repeatable)")
    creds.add_argument(
        "--client",
        action="append",
        default=[],
        metavar="EDGE:APP",
        help="credentials of their own for one app of an edge (repeatable)",
    )
    creds.add_argument("--expires-in", help="user credentials expire after this (90s, 12h, 30d)")
    creds.add_argument("--mount", help="where processes will see --out (a container volume)")
    creds.add_argument(
        "--hub-leaf-url",
        default="nats-leaf://nats-hub:7422",
        help="the hub's leafnode URL, which edge sites dial",
    )
    creds.add_argument("--leaf-tls-ca", help="CA file edge sites verify the hub's TLS with")
    creds.add_argument(
        "--leaf-store-dir",
        help="where an edge site's leaf keeps its JetStream (default: /data/jetstream with "
        "--mount, a container's volume; else jetstream-<edge> beside the minted files)",
    )
    sub.add_parser("config", help="list settings, env vars and defaults")
    return parser


def _bench_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    """``mesh bench [PART] [options]``: a sub-command per part, so that a part's own options
    (``mesh bench registry --puts N``) and the shared ones may follow it."""
    from mesh_app.bench import PARTS

    bench = sub.add_parser(
        "bench",
        parents=[common],
        help="measure what the mesh costs and carries, part by part; table + JSON",
        description="Measure the mesh on this machine, one part or all of them; each prints a "
        "table, and --json writes the figures too. Without a part: all.",
    )
    bench.add_argument("--json", dest="json_path", help="also write the figures to this file")
    parts = bench.add_subparsers(dest="part", metavar="PART", title="parts")
    bench.set_defaults(part="all")
    # Each part's parser takes the shared options too, so that they may follow the part. They
    # default to nothing there: a value given before the part is then not reset to None.
    shared = argparse.ArgumentParser(add_help=False, argument_default=argparse.SUPPRESS)
    shared.add_argument("--json", dest="json_path", help="also write the figures to this file")
    shared.add_argument("--nats-url", help=argparse.SUPPRESS)
    shared.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    shared.add_argument("--log-format", choices=["auto", "json", "console"])
    found: dict[str, argparse.ArgumentParser] = {
        name: parts.add_parser(name, parents=[shared], help=line, description=line)
        for name, line in PARTS.items()
    }
    parts.add_parser("all", parents=[shared], help="every part above not marked 'not in all'")

    def options(part: str, *flags: tuple[str, Callable[[str], Any], str]) -> None:
        """A part's own options; unset ones are left to the part's defaults."""
        parser = found[part]
        group = parser.add_argument_group(f"{part} options")
        for flag, kind, text in flags:
            group.add_argument(flag, type=kind, default=argparse.SUPPRESS, help=text)
        dests = tuple(flag.removeprefix("--").replace("-", "_") for flag, _k, _t in flags)
        parser.set_defaults(bench_options=dests)

    options(
        "paths",
        ("--tokens", int, "tokens per answer (default 32)"),
        (
            "--split",
            int,
            "a second answer length, run in turn with --tokens in every round: each process's "
            "CPU split into a part per token and a fixed part, beside its floor's",
        ),
        ("--rounds", int, "rounds at each concurrency (default 10)"),
        (
            "--concurrency",
            _streams,
            "requests at once, comma-separated (default 1,32); one level alone with many "
            "rounds reads its percentiles from more requests in the same time",
        ),
        (
            "--pacing",
            _pacing,
            "stream: each answer's tokens on a clock of its own (default); lockstep: every "
            "answer's on one, as a batching engine (vLLM) makes a token of each per step",
        ),
    )
    options(
        "registry",
        ("--puts", int, "heartbeat puts (default 20000)"),
        ("--watchers", int, "connections watching the registry, as edges do (default 10)"),
    )
    options(
        "embedded",
        (
            "--requests",
            int,
            "requests per path (default 20; coalescing: a quarter, at least 3; store: at least 40)",
        ),
        ("--max-tokens", int, "tokens per answer of the bundled model (default 64)"),
        ("--instant-tokens", int, "tokens per answer of the instant backend (default 4000)"),
        (
            "--sections",
            _sections,
            "which sections, comma-separated (default model,coalescing,store)",
        ),
        ("--rounds", int, "relay throughput rounds in the store section (default 6)"),
    )
    options(
        "confidence",
        ("--mmlu-per-subject", int, "prompts per MMLU subject (default 12)"),
        ("--gsm8k", int, "GSM8K prompts (default 120)"),
        ("--window", int, "generated tokens the confidence is read over (default 8)"),
        ("--seed", int, "sampling seed (default 0)"),
        (
            "--arithmetic",
            int,
            "arithmetic questions with gold by construction; 0: none (default 300)",
        ),
    )


def _pacing(text: str) -> str:
    if text not in {"stream", "lockstep"}:
        raise argparse.ArgumentTypeError(f"{text!r}: stream or lockstep")
    return text


def _streams(text: str) -> tuple[int, ...]:
    try:
        levels = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        levels = ()
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: whole numbers of 1 or more, comma-separated")
    return levels


def _sections(text: str) -> tuple[str, ...]:
    from mesh_app.bench.embedded import SECTIONS

    picked = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = sorted(set(picked) - set(SECTIONS))
    if unknown or not picked:
        raise argparse.ArgumentTypeError(
            f"{text!r}: pick from {', '.join(SECTIONS)}, comma-separated"
        )
    return picked


def settings_from_args(args: argparse.Namespace, *, quiet: bool = False) -> MeshSettings:
    overrides: dict[tuple[str, ...], Any] = {}
    for flag, path in _FLAGS.items():
        if getattr(args, flag, None) is not None:
            overrides[path] = getattr(args, flag)
    for flag, key in _MODEL_FLAGS.items():
        value = getattr(args, flag, None)
        if value is not None:
            overrides[("worker", "model", key)] = value
            overrides[("edge", "model", key)] = value
    if quiet and getattr(args, "log_level", None) is None:
        overrides.setdefault(("log", "level"), "warning")
    settings = load_settings(overrides)
    configure_logging(settings.log, cache=True)
    if settings.log.otel:
        from mesh.tracing import install_provider

        require_extra("opentelemetry.exporter.otlp.proto.http", "otel", "MESH_LOG_OTEL=true")
        install_provider(service=f"mesh-{getattr(args, 'command', 'cli')}")
    return settings


ENGINE_EXTRAS = {  # backends whose engine is an extra (the openai backend needs only aiohttp)
    "llama_cpp": ("llama_cpp", "edge"),
    "vllm": ("vllm", "vllm"),
}


def require_extra(module: str, extra: str, what: str) -> None:
    """A clear error naming the extra to install, instead of an ImportError deep inside."""
    try:
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a dotted name whose parent package is missing
        found = False
    if not found:
        raise MeshError(
            f"{what} needs {module!r}, which this install lacks: "
            f"pip install 'nats-llm-mesh[{extra}]'",
            code=ErrorCode.UNAVAILABLE,
            retryable=False,
        )
