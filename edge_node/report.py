"""What the edge reports per request: Prometheus figures and one canonical log line."""

from __future__ import annotations

import time
from typing import Any

from edge_node.records import Record
from mesh.logs import get_logger
from mesh.metrics import EdgeMetrics
from protocol.errors import ErrorCode
from protocol.messages import EndEvent, ErrorEvent

log = get_logger(__name__)


def observe(metrics: EdgeMetrics, record: Record) -> None:
    """Prometheus: the request's outcome, latencies and tokens."""
    outcome = record.state.outcome
    if isinstance(outcome, EndEvent):
        path = outcome.path
        forced = outcome.routing is not None and outcome.routing.forced
        metrics.requests.labels(path=path, route="forced" if forced else "auto", outcome="ok").inc()
        timings = outcome.timings
        if timings.ttft_ms is not None:
            metrics.ttft.labels(path=path).observe(timings.ttft_ms / 1000)
        tokens = outcome.usage.completion_tokens
        if timings.gen_ms and tokens > 1:
            metrics.tpot.labels(path=path).observe(timings.gen_ms / 1000 / (tokens - 1))
        if path == "cloud" and timings.queue_ms is not None:
            metrics.queue_wait.observe(timings.queue_ms / 1000)
        metrics.tokens.labels(direction="in", path=path).inc(outcome.usage.prompt_tokens)
        metrics.tokens.labels(direction="out", path=path).inc(tokens)
    elif isinstance(outcome, ErrorEvent):
        state = "cancelled" if outcome.code == ErrorCode.CANCELLED.value else "error"
        metrics.requests.labels(path="none", route="none", outcome=state).inc()
        metrics.errors.labels(code=outcome.code).inc()
    if record.restarts:
        metrics.restarts.inc(record.restarts)


def canonical_line(record: Record, received: float, *, streaming: bool) -> None:
    """One log line per request with everything an operator asks about it."""
    fields: dict[str, Any] = {
        "total_ms": round((time.perf_counter() - received) * 1000, 1),
        "stream": streaming,
        "positions": record.state.positions,
    }
    outcome = record.state.outcome
    if isinstance(outcome, EndEvent):
        fields.update(
            tokens=outcome.usage.completion_tokens,
            outcome="ok",
            path=outcome.path,
            served_by=outcome.served_by,
            finish=outcome.finish_reason,
            ttft_ms=outcome.timings.ttft_ms,
            fallback=outcome.fallback,
            attempt=outcome.attempt,  # a delivery count, or a time-based number (a copy)
        )
        if outcome.routing is not None:
            fields.update(
                route=outcome.routing.decision,
                score=outcome.routing.score,
                forced=outcome.routing.forced,
                reason=outcome.routing.reason,
            )
    elif isinstance(outcome, ErrorEvent):
        fields.update(outcome="error", code=outcome.code)
    else:
        fields.update(outcome="none")
    log.info("request", **fields)
