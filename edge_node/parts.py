"""What the edge's parts share, handed to them by the node that composes them
(:mod:`edge_node.node`): the request entry point, the edge's metrics sink, its kept answers.

Each part (:class:`~edge_node.nats_intake.NatsIntake`, :class:`~edge_node.http_api.EdgeHTTP`,
:class:`~edge_node.relay.CloudRelay`, :class:`~edge_node.site.SiteStore`,
:class:`~edge_node.paths.Paths`) declares next to itself the few things it uses (a dataclass of
settings sections, views and callables) and never holds the node.
"""

from __future__ import annotations

from collections.abc import Awaitable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from edge_node.records import Record, Sink
from mesh.metrics import Counters, EdgeMetrics
from protocol.errors import MeshError
from protocol.messages import Answer, ErrorEvent, InferRequest


class Serve(Protocol):
    """The edge's one entry point for a validated request (:meth:`EdgeNode.serve`): answer it
    into ``sink``; its record once complete (None when its id was refused as a duplicate)."""

    def __call__(
        self,
        req: InferRequest,
        sink: Sink,
        *,
        scope: str,
        received: float | None = None,
        trace: Mapping[str, str] | None = None,
    ) -> Awaitable[Record | None]: ...


class KeptAnswers(Protocol):
    """An edge site's kept answers (:meth:`edge_node.site.SiteStore.fetch`)."""

    async def fetch(self, request_id: str, key: str | None) -> Answer | ErrorEvent | None: ...


@dataclass(frozen=True)
class EdgeCounts:
    """Where the edge counts, as the worker's :class:`cloud_node.counts.WorkerCounts` does:
    ``stats`` for ``nats micro stats mesh-edge`` and ``mesh status``, ``metrics`` for
    Prometheus (``/metrics`` on the HTTP API)."""

    stats: Counters = field(default_factory=Counters)
    metrics: EdgeMetrics = field(default_factory=EdgeMetrics)

    def inc(self, name: str, amount: int = 1) -> None:
        self.stats.inc(name, amount)

    def refused(self, error: MeshError) -> None:
        """A request refused before it was served (unreadable, invalid, over a limit, no room,
        its id taken): counted where the served ones are, in the STATS counters ``mesh status``
        shows and in Prometheus (``path="none"``, as every request that ended in an error)."""
        code = error.code.value
        self.stats.inc(f"error.{code}")
        self.metrics.requests.labels(path="none", route="none", outcome="error").inc()
        self.metrics.errors.labels(code=code).inc()
