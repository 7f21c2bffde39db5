"""In-process counters, exposed through each node's NATS micro-service STATS.

``nats micro stats mesh-edge`` shows them.
"""

from __future__ import annotations

from collections import Counter
from threading import Lock


class Metrics:
    """Named counters, labels flattened into the name (``route.cloud``, ``error.overloaded``)."""

    def __init__(self) -> None:
        self._counts: Counter[str] = Counter()
        self._lock = Lock()

    def inc(self, name: str, amount: int = 1) -> None:
        with self._lock:
            self._counts[name] += amount

    def get(self, name: str) -> int:
        return self._counts.get(name, 0)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(sorted(self._counts.items()))
