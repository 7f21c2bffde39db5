"""Who a kept answer at an edge site is for: the keys its claims hold.

A request held at the site (``service_tier: "flex"``, ``deferrable``) leaves a claim: the hash
of its sender's key. The kept answer goes only to whoever asks with that key. NATS clients bring
their own (the SDK makes one per client); HTTP clients get their app's, made here from the
edge's credentials, so that no other app at the site, over HTTP or NATS, can make it.
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path


def lane_secret(creds_file: str | None) -> bytes | None:
    """A secret of this site's: a hash of its credentials file (its user's seed is in it)."""
    if not creds_file:
        return None
    try:
        return hashlib.sha256(Path(creds_file).expanduser().read_bytes()).digest()
    except OSError:
        return None


def app_key(secret: bytes | None, app: str) -> str:
    """The key that makes an HTTP app's kept answers its own: made from the edge's credentials,
    which nobody else at the site holds (without credentials, the open mode, anyone who reads
    this can make it: the site is one trust zone there)."""
    made = hmac.new(secret or b"mesh-open-site", f"http-app:{app}".encode(), hashlib.sha256)
    return made.hexdigest()[:32]


def key_hash(key: str | None) -> str:
    """What a claim keeps of a request's key (never the key itself)."""
    return hashlib.sha256(key.encode()).hexdigest() if key else ""
