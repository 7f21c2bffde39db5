"""Cancels a worker has heard of: which requests (by token subject), with which keys, for a while.

A cancel may arrive before the request is fetched, so it is remembered. It acts on a request only
if the request set no ``cancel_key`` or the cancel carries the same key: only a request's sender
knows its key, so nobody else can cancel it by naming its id.
"""

from __future__ import annotations

import contextlib
import time
from collections import OrderedDict, deque
from collections.abc import Iterator

from protocol.codec import load, sniff
from protocol.errors import MeshError
from protocol.messages import InferRequest
from protocol.subjects import address_of

NO_KEY = ""
KEYS_KEPT = 4
"""Of the keys the cancels of one id carry, the first this many and the latest this many are
kept (a bound on what a flood of cancels can make a worker hold)."""


def cancel_key_of(payload: bytes, headers: dict[str, str] | None = None) -> str:
    """The key a cancel message carries (``{"key": ...}`` in msgpack or JSON), or ``NO_KEY``."""
    if not payload:
        return NO_KEY
    with contextlib.suppress(MeshError):
        raw = load(payload, sniff(payload, headers))
        if isinstance(raw, dict) and isinstance(raw.get("key"), str):
            return str(raw["key"])[:128]
    return NO_KEY


def allows(request: InferRequest, key: str) -> bool:
    """True when a cancel carrying ``key`` may cancel ``request``."""
    return request.cancel_key is None or key == request.cancel_key


class _Keys:
    """The keys the cancels of one id carried: the first :data:`KEYS_KEPT` and the latest
    :data:`KEYS_KEPT`. Anyone who may cancel in a scope may send keys for an id; with the first
    eight alone, eight guesses sent before the sender's own cancel voided it (review S27b), and
    with the latest alone, eight sent after it would. A guesser now has to flood on both sides
    of it before the request is fetched, and the sender's cancel sent again still acts."""

    __slots__ = ("first", "latest")

    def __init__(self) -> None:
        self.first: list[str] = []
        self.latest: deque[str] = deque(maxlen=KEYS_KEPT)

    def add(self, key: str) -> None:
        if key in self.first or key in self.latest:
            return
        if len(self.first) < KEYS_KEPT:
            self.first.append(key)
        else:
            self.latest.append(key)

    def __iter__(self) -> Iterator[str]:
        yield from self.first
        yield from self.latest


class CancelBook:
    """A bounded map of recently cancelled ids to the keys their cancels carried; each entry is
    forgotten ``ttl`` seconds after its last cancel.

    Anyone may send cancels in their own scope, with ids of their choosing: one scope holds at
    most ``per_scope`` entries (its own oldest go first), so that a flood of cancels in one scope
    cannot push another scope's cancels out before their requests are fetched."""

    def __init__(self, ttl: float, max_size: int = 20_000, per_scope: int = 5_000) -> None:
        self._ttl = ttl
        self._max = max_size
        self._per_scope = min(per_scope, max_size)
        self._ids: OrderedDict[str, tuple[float, _Keys]] = OrderedDict()
        self._scopes: dict[str, OrderedDict[str, None]] = {}
        """Each scope's entries, oldest first (the addresses in ``_ids``)."""

    def add(self, address: str, key: str = NO_KEY) -> None:
        self._expire()
        keys = self._forget(address) or _Keys()
        keys.add(key)
        self._ids[address] = (time.monotonic() + self._ttl, keys)
        own = self._scopes.setdefault(address_of(address)[0], OrderedDict())
        own[address] = None
        while len(own) > self._per_scope:
            self._forget(next(iter(own)))
        while len(self._ids) > self._max:
            self._forget(next(iter(self._ids)))

    def cancels(self, address: str, request: InferRequest) -> bool:
        """True when a remembered cancel for ``address`` (the request's token subject) acts on
        ``request``."""
        self._expire()
        entry = self._ids.get(address)
        return entry is not None and any(allows(request, key) for key in entry[1])

    def __contains__(self, address: object) -> bool:
        self._expire()
        return address in self._ids

    def _forget(self, address: str) -> _Keys | None:
        """Drop ``address`` (its keys are returned; None when it was not there)."""
        entry = self._ids.pop(address, None)
        if entry is None:
            return None
        scope = address_of(address)[0]
        own = self._scopes.get(scope)
        if own is not None:
            own.pop(address, None)
            if not own:
                del self._scopes[scope]
        return entry[1]

    def _expire(self) -> None:
        now = time.monotonic()
        while self._ids:
            oldest, (expires, _keys) = next(iter(self._ids.items()))
            if expires > now:
                break
            self._forget(oldest)
