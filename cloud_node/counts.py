"""What a worker counts, in one place: :class:`WorkerCounts` owns the worker's STATS counters
(:class:`WorkerStats`: ``nats micro stats mesh-worker`` and ``mesh status`` show them) and its
Prometheus metrics (:class:`mesh.metrics.WorkerMetrics`), and each kind of event has one method
that moves both where both count it.

The worker hands this sink to its parts (the handler, takeover, outcomes, the settler); the
histograms and gauges that serving observes directly (TTFT, in flight, tokens) stay on
:attr:`WorkerCounts.metrics`.

Counted in one system only (so far, by design of what each shows):

- STATS only: ``fetched``, ``max_deliveries``, ``cancels_refused``;
- Prometheus only: ``mesh_worker_redeliveries_total``, and the typed error's ``code``
  (``mesh_worker_errors_total``; STATS counts the outcome, not its code).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from cloud_node.publisher import AnswerPublisher
from mesh.generate import Generation
from mesh.metrics import WorkerMetrics
from protocol.messages import Timings

Outcome = Literal[
    "completed",
    "rejected",
    "failed",
    "cancelled",
    "requeued",
    "already_done",
    "other_copy",
    "superseded",
]
"""How one delivery ended: a STATS field each, and a ``mesh_worker_requests_total`` outcome."""
TakeoverKind = Literal["continued", "restarted"]
"""How a redelivery took over a started answer: a STATS field each, and a
``mesh_worker_takeovers_total`` kind."""


@dataclass
class WorkerStats:
    fetched: int = 0
    completed: int = 0
    rejected: int = 0
    failed: int = 0
    cancelled: int = 0
    requeued: int = 0
    continued: int = 0
    """Redelivered requests continued from the stored prefix."""
    restarted: int = 0
    """Redelivered requests started over (nothing kept, or a backend that cannot continue)."""
    already_done: int = 0
    """Redelivered requests whose outcome was already stored: acked, not generated again."""
    other_copy: int = 0
    """Second copies of a request that can wait, acked while the first was being answered."""
    republished: int = 0
    """Events published again after a reconnect lost them."""
    cancels_refused: int = 0
    """Cancels whose key did not match the request's."""
    max_deliveries: int = 0
    """Requests answered with max_deliveries after the last delivery's worker died."""
    superseded: int = 0
    """Generations stopped after this worker stood still (paused) and another took them over."""


class WorkerCounts:
    """The worker's one counting sink: its STATS and its Prometheus metrics."""

    def __init__(self, metrics: WorkerMetrics | None = None) -> None:
        self.stats = WorkerStats()
        self.metrics = WorkerMetrics() if metrics is None else metrics
        """Also where serving observes its histograms and the worker sets its gauges."""

    def outcome(self, outcome: Outcome, code: str | None = None) -> None:
        """One delivery's outcome (``outcome("failed", code)``), with its error code if any."""
        setattr(self.stats, outcome, getattr(self.stats, outcome) + 1)
        self.metrics.requests.labels(outcome=outcome).inc()
        if code is not None:
            self.metrics.errors.labels(code=code).inc()

    def takeover(self, kind: TakeoverKind) -> None:
        """A redelivery took over a started answer: continued it, or started it over."""
        setattr(self.stats, kind, getattr(self.stats, kind) + 1)
        self.metrics.takeovers.labels(kind=kind).inc()

    def republished(self, publisher: AnswerPublisher) -> None:
        """The events ``publisher`` published again since it was last counted."""
        count = publisher.take_republished()
        self.stats.republished += count
        self.metrics.republished.inc(count)

    def redelivery(self) -> None:
        """A delivery of a request another worker had before (Prometheus only)."""
        self.metrics.redeliveries.inc()

    def served(self, gen: Generation, timings: Timings) -> None:
        """A completed generation: its outcome, and its queue wait, TTFT, TPOT and tokens."""
        self.outcome("completed")
        self.metrics.observe(gen, timings)

    def fetched(self) -> None:
        """A delivery accepted into a slot (STATS only)."""
        self.stats.fetched += 1

    def max_deliveries(self) -> None:
        """A request answered with max_deliveries (STATS only)."""
        self.stats.max_deliveries += 1

    def cancel_refused(self) -> None:
        """A cancel whose key did not match the request's (STATS only)."""
        self.stats.cancels_refused += 1

    def snapshot(self) -> dict[str, int]:
        """The STATS counters, by name."""
        return dict(vars(self.stats))
