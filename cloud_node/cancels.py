"""Cancels a worker has heard of: which requests (by token subject), with which keys, for a while.

A cancel may arrive before the request is fetched, so it is remembered. It acts on a request only
if the request set no ``cancel_key`` or the cancel carries the same key: only a request's sender
knows its key, so nobody else can cancel it by naming its id.
"""

from __future__ import annotations

import contextlib
import time
from collections import OrderedDict

from protocol.codec import load, sniff
from protocol.errors import MeshError
from protocol.messages import InferRequest
from protocol.subjects import address_of

NO_KEY = ""


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


class CancelBook:
    """A bounded memory of recently heard cancels: which ids, with which keys. Each (id, key)
    is forgotten ``ttl`` seconds after it was last heard.

    Anyone may send cancels in their own scope, with ids and keys of their choosing: one scope
    holds at most ``per_scope`` of them (its own oldest go first), so that a flood of cancels in
    one scope cannot push another scope's cancels out before their requests are fetched; all
    scopes together hold at most ``max_size``. Keys count one by one against their scope: an id
    is not capped at a few keys, which let eight guesses sent before the sender's own cancel
    void it (review S27b), and four on each side of it (review S27c). A guesser now has to send
    ``per_scope`` cancels in the sender's scope after the sender's own, before the request is
    fetched, and even then guesses never cancel anything themselves."""

    def __init__(self, ttl: float, max_size: int = 20_000, per_scope: int = 5_000) -> None:
        self._ttl = ttl
        self._max = max_size
        self._per_scope = min(per_scope, max_size)
        self._heard: OrderedDict[tuple[str, str], float] = OrderedDict()
        """Each (token subject, key) heard, oldest first, and when it is forgotten."""
        self._keys: dict[str, set[str]] = {}
        """The keys heard for each token subject."""
        self._scopes: dict[str, OrderedDict[tuple[str, str], None]] = {}
        """Each scope's (token subject, key) pairs, oldest first."""

    def add(self, address: str, key: str = NO_KEY) -> None:
        self._expire()
        pair = (address, key)
        self._forget(pair)  # heard again: the newest
        self._heard[pair] = time.monotonic() + self._ttl
        self._keys.setdefault(address, set()).add(key)
        own = self._scopes.setdefault(address_of(address)[0], OrderedDict())
        own[pair] = None
        while len(own) > self._per_scope:
            self._forget(next(iter(own)))
        while len(self._heard) > self._max:
            self._forget(next(iter(self._heard)))

    def cancels(self, address: str, request: InferRequest) -> bool:
        """True when a remembered cancel for ``address`` (the request's token subject) acts on
        ``request``."""
        self._expire()
        return any(allows(request, key) for key in self._keys.get(address, ()))

    def __contains__(self, address: object) -> bool:
        self._expire()
        return address in self._keys

    def _forget(self, pair: tuple[str, str]) -> None:
        if self._heard.pop(pair, None) is None:
            return
        address, key = pair
        keys = self._keys.get(address)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self._keys[address]
        scope = address_of(address)[0]
        own = self._scopes.get(scope)
        if own is not None:
            own.pop(pair, None)
            if not own:
                del self._scopes[scope]

    def _expire(self) -> None:
        now = time.monotonic()
        while self._heard:
            oldest, expires = next(iter(self._heard.items()))
            if expires > now:
                break
            self._forget(oldest)
