"""Prometheus metrics for every node (``prometheus-client``), and the counters behind the NATS
micro-service STATS.

Each node owns its metrics in a registry of its own (a process may run a worker and an edge,
as ``mesh up`` does, and tests run many nodes); an :class:`Exposition` joins registries for one
``/metrics`` page: :data:`exposition`, the process's page, by default, or a page of its own
(``mesh up`` gives its worker one when ``MESH_WORKER_METRICS_PORT`` is set, so that the worker
is scraped where a standalone ``mesh worker`` would be, apart from the edge).

A page is valid exposition: one family per name, one sample per label set. The node families
never overlap (``mesh_edge_*``, ``mesh_worker_*``), but every node reports the NATS connection
it uses (``mesh_nats_*``) and nodes in one process often share one (``mesh up``'s worker and
edge use ``mesh-local``). So the page does not simply chain its registries: it gathers the
connections of all its :class:`NatsMetrics` and reports each connection once, under one family
per name. Merging by connection, not by label value, keeps apart distinct connections that
happen to share a name (the later ones get ``#2``, ``#3``): they are counted, not dropped.

Names follow Prometheus conventions: ``mesh_<role>_...``, base units (seconds), ``_total`` for
counters; labels take a few known values only.
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
import time
from collections import Counter as Tally
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from protocol.errors import UnavailableError

if TYPE_CHECKING:
    from mesh.generate import Generation
    from protocol.messages import Timings

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)


class _KeepsChildren:
    """A labelled metric that keeps each child it hands out: prometheus-client's ``labels()``
    checks the label names and values and takes a lock on every call (2 us in a loop, and a
    share of a request's CPU in a busy node), and a node asks for the same few children once
    per request. Labels take a few known values only (see above), so the kept children stay
    few."""

    def labels(self, *labelvalues: Any, **labelkwargs: Any) -> Any:
        key = labelvalues + tuple(labelkwargs.items())
        kept: dict[tuple[Any, ...], Any] | None = self.__dict__.get("_kept")
        if kept is None:  # the first call (setdefault would build a dict on every call)
            kept = self.__dict__["_kept"] = {}
        child = kept.get(key)
        if child is None:
            child = kept[key] = super().labels(*labelvalues, **labelkwargs)  # type: ignore[misc]
        return child


class KeptCounter(_KeepsChildren, Counter):
    """A :class:`prometheus_client.Counter` whose ``labels()`` children are kept."""


class KeptHistogram(_KeepsChildren, Histogram):
    """A :class:`prometheus_client.Histogram` whose ``labels()`` children are kept."""


class Counters:
    """Named counters, labels flattened into the name (``route.cloud``, ``error.overloaded``):
    what ``nats micro stats`` shows."""

    def __init__(self) -> None:
        self._counts: Tally[str] = Tally()
        self._lock = threading.Lock()

    def inc(self, name: str, amount: int = 1) -> None:
        with self._lock:
            self._counts[name] += amount

    def get(self, name: str) -> int:
        return self._counts.get(name, 0)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(sorted(self._counts.items()))


class EdgeMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = KeptCounter(
            "mesh_edge_requests",
            "Requests answered, by the path that served them, how it was chosen, and outcome.",
            ["path", "route", "outcome"],
            registry=r,
        )
        self.errors = KeptCounter(
            "mesh_edge_errors",
            "Requests that ended in a typed error, by code.",
            ["code"],
            registry=r,
        )
        self.ttft = KeptHistogram(
            "mesh_edge_time_to_first_token_seconds",
            "From receiving a request to passing on its first token.",
            ["path"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = KeptHistogram(
            "mesh_edge_time_per_output_token_seconds",
            "Generation time divided by output tokens, per request.",
            ["path"],
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "mesh_edge_cloud_queue_wait_seconds",
            "Time an escalated request waited in the work queue before a worker started it.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.in_flight = Gauge(
            "mesh_edge_requests_in_flight", "Requests being answered now.", registry=r
        )
        self.tokens = KeptCounter(
            "mesh_edge_tokens",
            "Prompt (in) and completion (out) tokens.",
            ["direction", "path"],
            registry=r,
        )
        self.decisions = KeptCounter(
            "mesh_edge_route_decisions",
            "Router decisions (forced: the client chose the route).",
            ["decision", "forced"],
            registry=r,
        )
        self.mid_answer = Counter(
            "mesh_edge_mid_answer_escalations",
            "Requests the router kept local that the local model's low confidence escalated.",
            registry=r,
        )
        self.fallbacks = KeptCounter(
            "mesh_edge_fallbacks",
            "Escalations answered locally instead, by why the cloud could not serve them.",
            ["reason"],
            registry=r,
        )
        self.restarts = Counter(
            "mesh_edge_answer_restarts",
            "Answers passed on that had to start over (a worker died, nothing to continue).",
            registry=r,
        )
        self.repairs = Counter(
            "mesh_edge_answer_repairs",
            "Events fetched again from the answer store after they were missed.",
            registry=r,
        )
        self.cloud_share = Gauge(
            "mesh_edge_cloud_budget_share",
            "Share of router-decided requests escalated, over the budget window.",
            registry=r,
        )
        self.cloud_threshold = Gauge(
            "mesh_edge_cloud_budget_threshold", "Router score threshold now in force.", registry=r
        )
        self.loop_lag = Gauge(
            "mesh_edge_loop_lag_seconds",
            "How late the edge's event loop ran what was due, worst of the last 5 s: tens of ms "
            "mean it cannot keep up (HTTP, NATS intake, relays and the local model share it).",
            registry=r,
        )
        self.workers_live = Gauge(
            "mesh_edge_live_workers", "Workers the node registry shows alive.", registry=r
        )


class WorkerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = KeptCounter(
            "mesh_worker_requests",
            "Deliveries handled, by outcome (completed, failed, rejected, cancelled, requeued, "
            "already_done).",
            ["outcome"],
            registry=r,
        )
        self.errors = KeptCounter(
            "mesh_worker_errors",
            "Deliveries that ended in a typed error, by code.",
            ["code"],
            registry=r,
        )
        self.queue_wait = Histogram(
            "mesh_worker_queue_wait_seconds",
            "From the request's publish to the start of its generation.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "mesh_worker_time_to_first_token_seconds",
            "From the start of generation to the first token.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "mesh_worker_time_per_output_token_seconds",
            "Generation time divided by output tokens, per request.",
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.in_flight = Gauge("mesh_worker_requests_in_flight", "Requests generating.", registry=r)
        self.slots = Gauge(
            "mesh_worker_slots", "Requests the engine generates at once.", registry=r
        )
        self.free_slots = Gauge("mesh_worker_free_slots", "Slots free now.", registry=r)
        self.loop_lag = Gauge(
            "mesh_worker_loop_lag_seconds",
            "How late the worker's event loop ran what was due, worst of the last 5 s: tens of "
            "ms mean it cannot keep up with its engine (run another worker process for it).",
            registry=r,
        )
        self.engine = Gauge(
            "mesh_worker_engine_load",
            "The engine's own load, by figure (running and waiting requests, KV-cache share), "
            "as of its last step; vLLM backends only.",
            ["figure"],
            registry=r,
        )
        self.tokens = KeptCounter(
            "mesh_worker_tokens",
            "Prompt (in) and completion (out) tokens.",
            ["direction"],
            registry=r,
        )
        self.redeliveries = Counter(
            "mesh_worker_redeliveries",
            "Deliveries of a request another worker had before (attempt > 1).",
            registry=r,
        )
        self.takeovers = KeptCounter(
            "mesh_worker_takeovers",
            "Redelivered answers taken over: continued from the stored prefix, or started over.",
            ["kind"],
            registry=r,
        )
        self.republished = Counter(
            "mesh_worker_events_republished",
            "Answer events published again after a reconnect lost them.",
            registry=r,
        )

    def observe(self, gen: Generation, timings: Timings) -> None:
        """One generation's queue wait, TTFT, time per output token and tokens."""
        if timings.queue_ms is not None:
            self.queue_wait.observe(timings.queue_ms / 1000)
        if timings.ttft_ms is not None:
            self.ttft.observe(timings.ttft_ms / 1000)
        if gen.first is not None and gen.usage.completion_tokens > 1:
            self.tpot.observe((gen.done - gen.first) / (gen.usage.completion_tokens - 1))
        self.tokens.labels(direction="in").inc(gen.usage.prompt_tokens)
        self.tokens.labels(direction="out").inc(gen.usage.completion_tokens)


class NatsMetrics(Collector):
    """Reconnects and slow-consumer drops of the connections a node uses, read at scrape time
    from the connections' own counters."""

    def __init__(self) -> None:
        self.registry = _NatsRegistry(self)
        self._connections: dict[str, Any] = {}
        self.registry.register(self)

    def watch(self, connection: Any) -> None:
        """``connection``: a :class:`mesh.connection.Connection`."""
        self._connections[connection.name] = connection

    @property
    def connections(self) -> list[Any]:
        return list(self._connections.values())

    def collect(self) -> Iterator[Any]:
        return _nats_families(self.connections)


class _NatsRegistry(CollectorRegistry):
    """A :class:`NatsMetrics`' registry, which a page recognises to report its connections
    together with other nodes' (each connection once)."""

    def __init__(self, source: NatsMetrics) -> None:
        super().__init__(auto_describe=False)
        self.source = source


def _nats_families(connections: list[Any]) -> Iterator[Any]:
    """The ``mesh_nats_*`` families of ``connections``, each connection (object) once, labelled
    by its name; a name already taken by another connection gets ``#2``, ``#3``..."""
    reconnects = CounterMetricFamily(
        "mesh_nats_reconnects", "Reconnects of a NATS connection.", labels=["connection"]
    )
    drops = CounterMetricFamily(
        "mesh_nats_message_losses",
        "Reconnects plus slow-consumer drops: times a reader may have missed messages.",
        labels=["connection"],
    )
    restoring = GaugeMetricFamily(
        "mesh_nats_restoring",
        "After-reconnect steps (watches, consumers, registry) not restored yet.",
        labels=["connection"],
    )
    seen: set[int] = set()
    names: Tally[str] = Tally()
    for conn in connections:
        if id(conn) in seen:
            continue
        seen.add(id(conn))
        names[conn.name] += 1
        label = conn.name if names[conn.name] == 1 else f"{conn.name}#{names[conn.name]}"
        reconnects.add_metric([label], conn.reconnects)
        drops.add_metric([label], conn.losses)
        restoring.add_metric([label], len(conn.restoring))
    yield reconnects
    yield drops
    yield restoring


class _Union(Collector):
    """The families of a page's registries; the NATS connections of all of them in one set of
    families, after the nodes' own."""

    def __init__(self, registries: list[CollectorRegistry]) -> None:
        self._registries = registries

    def collect(self) -> Iterator[Any]:
        connections: list[Any] = []
        nats = False
        for registry in list(self._registries):
            if isinstance(registry, _NatsRegistry):
                nats = True
                connections.extend(registry.source.connections)
            else:
                yield from registry.collect()
        if nats:
            yield from _nats_families(connections)


class Exposition:
    """The metrics of every node of this process, in one text page."""

    def __init__(self) -> None:
        self._registries: list[CollectorRegistry] = []
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Union(self._registries))
        self._servers: dict[int, Any] = {}

    def add(self, registry: CollectorRegistry) -> None:
        if registry not in self._registries:
            self._registries.append(registry)

    def remove(self, registry: CollectorRegistry) -> None:
        with contextlib.suppress(ValueError):
            self._registries.remove(registry)

    def text(self) -> bytes:
        return generate_latest(self.registry)

    def serve(
        self,
        port: int,
        host: str = "0.0.0.0",  # noqa: S104 - a scrape target
        setting: str = "metrics_port",
    ) -> int:
        """Serve ``/metrics`` on ``port`` (0: any free port); returns the port. A port that
        cannot be had raises :class:`UnavailableError`, naming ``setting`` (what sets it)."""
        try:
            server, _thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            raise cannot_listen("the metrics page", host, port, exc, setting) from exc
        bound = int(server.server_address[1])
        self._servers[bound] = server
        return bound

    def stop(self, port: int | None = None) -> None:
        """Stop serving on ``port`` (the port :meth:`serve` returned), or on every port."""
        ports = list(self._servers) if port is None else [port]
        for bound in ports:
            server = self._servers.pop(bound, None)
            if server is not None:
                server.shutdown()
                server.server_close()  # frees the port at once, for the next `mesh up`


def cannot_listen(what: str, host: str, port: int, exc: OSError, setting: str) -> UnavailableError:
    """The typed error of a server socket that cannot be had (a port taken, an address this
    host does not have), naming the setting to change (``<role>.<setting>``, ``MESH_...``)."""
    why = os.strerror(exc.errno) if exc.errno else str(exc)
    return UnavailableError(
        f"{what} cannot listen on {host}:{port}: {why} (set another port with {setting}, or -1 "
        "to turn it off)"
    )


exposition = Exposition()
"""This process's metrics page."""

GC_PAUSE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class GcPauses:
    """How long the garbage collector stopped this process, by generation: while it runs, every
    stream the process serves stands still. One per process (:data:`gc_pauses`), on the page of
    every node the process runs (:func:`watch_gc`)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        pauses = Histogram(
            "mesh_process_gc_pause_seconds",
            "How long each garbage collection stopped this process (every stream it serves)",
            ["generation"],
            buckets=GC_PAUSE_BUCKETS,
            registry=self.registry,
        )
        self._by_generation = {g: pauses.labels(generation=str(g)) for g in range(3)}
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        """A ``gc.callbacks`` entry: called as each collection starts and stops."""
        if phase == "start":
            self._started = time.perf_counter()
        elif (child := self._by_generation.get(info.get("generation", -1))) is not None:
            child.observe(time.perf_counter() - self._started)


gc_pauses = GcPauses()


def watch_gc(page: Exposition) -> None:
    """Time this process's garbage collections (once per process) and show them on ``page``."""
    if gc_pauses not in gc.callbacks:
        gc.callbacks.append(gc_pauses)
    page.add(gc_pauses.registry)
