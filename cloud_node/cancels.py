"""Remembering cancelled request ids for a while, so a cancel that arrives before the request is
fetched still stops it."""

from __future__ import annotations

import time
from collections import OrderedDict


class RecentIds:
    """A bounded set of ids that forgets each one ``ttl`` seconds after it was added."""

    def __init__(self, ttl: float, max_size: int = 10_000) -> None:
        self._ttl = ttl
        self._max = max_size
        self._ids: OrderedDict[str, float] = OrderedDict()

    def add(self, item: str) -> None:
        self._expire()
        self._ids[item] = time.monotonic() + self._ttl
        self._ids.move_to_end(item)
        while len(self._ids) > self._max:
            self._ids.popitem(last=False)

    def __contains__(self, item: object) -> bool:
        self._expire()
        return item in self._ids

    def _expire(self) -> None:
        now = time.monotonic()
        while self._ids:
            oldest, expires = next(iter(self._ids.items()))
            if expires > now:
                break
            del self._ids[oldest]
