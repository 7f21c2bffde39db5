"""NATS decentralized-auth JWTs (operator, account, user) and ``.creds`` files, signed with nkeys.

The ``nkeys`` package makes and signs the keys; this module only lays out the claims the way
nats-server reads them (JWT v2: an ``ed25519-nkey`` signature over ``header.claims``, and a
``jti`` that is the base32 SHA-512/256 of the claims with an empty ``jti``).
"""

from __future__ import annotations

import base64
import hashlib
import json
import secrets
import time
from dataclasses import dataclass
from typing import Any

import nkeys

_HEADER = {"typ": "JWT", "alg": "ed25519-nkey"}
UNLIMITED = -1


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _json(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


@dataclass(frozen=True)
class Key:
    """An nkey pair: ``seed`` (secret, ``S...``) and ``public`` (``O...``, ``A...``, ``U...``)."""

    seed: str
    public: str

    @classmethod
    def new(cls, prefix: int) -> Key:
        seed = nkeys.encode_seed(secrets.token_bytes(32), prefix).decode()
        return cls.from_seed(seed)

    @classmethod
    def from_seed(cls, seed: str) -> Key:
        pair = nkeys.from_seed(seed.encode())
        return cls(seed=seed, public=pair.public_key.decode())

    def sign(self, data: bytes) -> bytes:
        return bytes(nkeys.from_seed(self.seed.encode()).sign(data))


def operator_key() -> Key:
    return Key.new(nkeys.PREFIX_BYTE_OPERATOR)


def account_key() -> Key:
    return Key.new(nkeys.PREFIX_BYTE_ACCOUNT)


def user_key() -> Key:
    return Key.new(nkeys.PREFIX_BYTE_USER)


def encode(issuer: Key, subject: str, name: str, nats: dict[str, Any], expires: int = 0) -> str:
    """A signed JWT: ``issuer`` vouches for ``subject`` (a public key) with claims ``nats``."""
    claims: dict[str, Any] = {"jti": "", "iat": int(time.time()), "iss": issuer.public}
    if expires:
        claims["exp"] = int(expires)
    claims.update(name=name, sub=subject)
    digest = hashlib.new("sha512_256", _json(claims)).digest()
    claims["jti"] = base64.b32encode(digest).decode().rstrip("=")
    claims["nats"] = {**nats, "version": 2}
    signed = f"{_b64(_json(_HEADER))}.{_b64(_json(claims))}"
    return f"{signed}.{_b64(issuer.sign(signed.encode()))}"


def operator_jwt(operator: Key, name: str, system_account: str) -> str:
    return encode(
        operator,
        operator.public,
        name,
        {"type": "operator", "system_account": system_account},
    )


def account_jwt(
    operator: Key,
    account: Key,
    name: str,
    *,
    jetstream: bool,
    exports: list[dict[str, Any]] | None = None,
    imports: list[dict[str, Any]] | None = None,
) -> str:
    limits: dict[str, Any] = {
        "subs": UNLIMITED,
        "data": UNLIMITED,
        "payload": UNLIMITED,
        "imports": UNLIMITED,
        "exports": UNLIMITED,
        "wildcards": True,
        "conn": UNLIMITED,
        "leaf": UNLIMITED,
    }
    if jetstream:
        limits.update(
            mem_storage=UNLIMITED,
            disk_storage=UNLIMITED,
            streams=UNLIMITED,
            consumer=UNLIMITED,
        )
    claims: dict[str, Any] = {"type": "account", "limits": limits}
    if exports:
        claims["exports"] = exports
    if imports:
        claims["imports"] = imports
    return encode(operator, account.public, name, claims)


@dataclass(frozen=True)
class Permissions:
    pub_allow: tuple[str, ...] = ()
    sub_allow: tuple[str, ...] = ()
    pub_deny: tuple[str, ...] = ()
    sub_deny: tuple[str, ...] = ()
    responses: int = 0
    """Replies a user may send to the reply subject of a message it received (0: none)."""
    response_ttl_s: float = 0.0

    def claims(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "pub": _allow_deny(self.pub_allow, self.pub_deny),
            "sub": _allow_deny(self.sub_allow, self.sub_deny),
        }
        if self.responses:
            out["resp"] = {"max": self.responses, "ttl": int(self.response_ttl_s * 1e9)}
        return out


def _allow_deny(allow: tuple[str, ...], deny: tuple[str, ...]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    if allow:
        out["allow"] = list(allow)
    if deny:
        out["deny"] = list(deny)
    return out


def user_jwt(account: Key, user: Key, name: str, permissions: Permissions, expires: int = 0) -> str:
    nats = {
        "type": "user",
        "subs": UNLIMITED,
        "data": UNLIMITED,
        "payload": UNLIMITED,
        **permissions.claims(),
    }
    return encode(account, user.public, name, nats, expires=expires)


def creds(jwt: str, user: Key) -> str:
    """The ``.creds`` file every NATS client and the ``nats`` CLI read: the JWT and the seed."""
    return (
        "-----BEGIN NATS USER JWT-----\n"
        f"{jwt}\n"
        "------END NATS USER JWT------\n\n"
        "************************* IMPORTANT *************************\n"
        "NKEY Seed printed below can be used to sign and prove identity.\n"
        "NKEYs are sensitive and should be treated as secrets.\n\n"
        "-----BEGIN USER NKEY SEED-----\n"
        f"{user.seed}\n"
        "------END USER NKEY SEED------\n\n"
        "*************************************************************\n"
    )
