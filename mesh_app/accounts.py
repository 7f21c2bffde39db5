"""One NATS account per edge: lanes the server keeps, not only the code.

Inside one account, subject permissions bound what a user publishes, but not what the server
publishes on its behalf: a JetStream API request is answered on whatever reply subject it names,
and a push consumer delivers to whatever subject its creator chose (docs/security.md, the
audit). So each edge gets an account of its own (its edge, its clients, its site's leaf node),
and the ``MESH`` account (JetStream, the workers, the operator) exports to it only its slice:

- services: its queue subject (a JetStream publish, acked), its cancels, its liveness and cancel
  requests to workers, its orphan reports, reads of its own stored answers through the workers,
  whether a model's consumer exists, pulls and acks on its site's collector consumer, and the
  node registry (direct gets and the bucket's stream info);
- streams: its token subjects, and the registry's republished updates.

Every export but the registry's needs an activation token, which ``MESH`` signs per edge for
that edge's own subjects only. Reply and deliver subjects then live in the edge's account: a
request whose reply names another edge's subject answers into the requester's own namespace.
An edge may create no consumer at all (a consumer it created would live in ``MESH`` and could
deliver anywhere there).
"""

from __future__ import annotations

from typing import Any

from mesh.config import StreamSettings
from mesh_app import nats_jwt
from mesh_app.nats_jwt import Key
from protocol.subjects import (
    ANSWERS_STREAM,
    NODES_STREAM,
    PREFIX,
    REGISTRY_UPDATES,
    STATUS_ASK,
    edge_status_subject,
    site_consumer,
)

REGISTRY = f"{REGISTRY_UPDATES}.>"
"""The registry bucket's republished updates (see :mod:`mesh.registry`)."""
NOOP = f"{PREFIX}.noop"
"""Imported as ``$JS.API.INFO`` by each edge account, so that the server does not give that
JetStream-less account its default ``$JS.API.>`` import (which answers every API call a second
time: "JetStream not enabled for account")."""


def _services(stream: StreamSettings) -> list[tuple[str, str]]:
    """(subject, response type) of every service ``MESH`` exports, wildcards where the edge's
    id goes."""
    infer, answers, kv = stream.name, ANSWERS_STREAM, NODES_STREAM
    return [
        (f"{PREFIX}.infer.*.*", "Singleton"),
        (f"{PREFIX}.cancel.*.*", "Singleton"),
        (f"{PREFIX}.worker.*.cancel.*.*", "Singleton"),
        (f"{PREFIX}.worker.*.alive.*.*", "Singleton"),
        (f"{PREFIX}.orphan.*.*", "Singleton"),
        (f"{PREFIX}.store.*.*", "Stream"),
        (f"$JS.API.CONSUMER.INFO.{infer}.*", "Singleton"),
        (f"$JS.API.CONSUMER.INFO.{answers}.*", "Singleton"),
        (f"$JS.API.CONSUMER.MSG.NEXT.{answers}.*", "Stream"),
        (f"$JS.ACK.{answers}.*.>", "Singleton"),
        (f"$JS.ACK.*.*.{answers}.*.>", "Singleton"),
        (f"$JS.API.DIRECT.GET.{kv}", "Stream"),
        (f"$JS.API.STREAM.INFO.{kv}", "Singleton"),
        (NOOP, "Singleton"),
    ]


_PUBLIC = {f"$JS.API.DIRECT.GET.{NODES_STREAM}", f"$JS.API.STREAM.INFO.{NODES_STREAM}", NOOP}
"""Exports any account may import: the registry is every edge's to read."""


def mesh_exports(stream: StreamSettings) -> list[dict[str, Any]]:
    """The exports of the ``MESH`` account (the same whatever the edges)."""
    out: list[dict[str, Any]] = [
        {
            "name": subject,
            "subject": subject,
            "type": "service",
            "response_type": response,
            **({} if subject in _PUBLIC else {"token_req": True}),
        }
        for subject, response in _services(stream)
    ]
    out.append(
        {"name": "tokens", "subject": f"{PREFIX}.tok.*.*", "type": "stream", "token_req": True}
    )
    out.append({"name": "registry", "subject": REGISTRY, "type": "stream"})
    out.append({"name": "status asks", "subject": STATUS_ASK, "type": "stream"})
    return out


def edge_status_imports(edges: dict[str, Key]) -> list[dict[str, Any]]:
    """What ``MESH`` imports from the edges: each edge's answer to ``mesh status``'s ask."""
    return [
        {
            "name": f"status of {edge}",
            "subject": edge_status_subject(edge),
            "account": key.public,
            "type": "stream",
        }
        for edge, key in sorted(edges.items())
    ]


def edge_slice(edge: str, stream: StreamSettings) -> tuple[list[str], list[str]]:
    """(services, streams) edge ``edge`` imports: each export with its id filled in."""
    infer, answers, kv = stream.name, ANSWERS_STREAM, NODES_STREAM
    site = site_consumer(edge)
    services = [
        f"{PREFIX}.infer.*.{edge}",
        f"{PREFIX}.cancel.{edge}.*",
        f"{PREFIX}.worker.*.cancel.{edge}.*",
        f"{PREFIX}.worker.*.alive.{edge}.*",
        f"{PREFIX}.orphan.{edge}.*",
        f"{PREFIX}.store.{edge}.*",
        f"$JS.API.CONSUMER.INFO.{infer}.*",
        f"$JS.API.CONSUMER.INFO.{answers}.{site}",
        f"$JS.API.CONSUMER.MSG.NEXT.{answers}.{site}",
        f"$JS.ACK.{answers}.{site}.>",
        f"$JS.ACK.*.*.{answers}.{site}.>",
        f"$JS.API.DIRECT.GET.{kv}",
        f"$JS.API.STREAM.INFO.{kv}",
    ]
    return services, [f"{PREFIX}.tok.{edge}.*", REGISTRY, STATUS_ASK]


def activation(exporter: Key, importer: Key, subject: str, kind: str) -> str:
    """``exporter`` lets ``importer`` import ``subject`` (within a ``token_req`` export)."""
    return nats_jwt.encode(
        exporter,
        importer.public,
        f"{kind} {subject}",
        {"type": "activation", "subject": subject, "kind": kind},
    )


def edge_imports(
    mesh: Key, account: Key, edge: str, stream: StreamSettings
) -> list[dict[str, Any]]:
    """The imports of edge ``edge``'s account, each with its activation token where needed."""
    services, streams = edge_slice(edge, stream)
    public = _PUBLIC | {REGISTRY, STATUS_ASK}

    def entry(subject: str, kind: str, local: str | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": local or subject,
            "subject": subject,
            "account": mesh.public,
            "type": kind,
        }
        if subject not in public:
            out["token"] = activation(mesh, account, subject, kind)
        if local:
            out["local_subject"] = local
        return out

    return [
        *(entry(s, "service") for s in services),
        entry(NOOP, "service", local="$JS.API.INFO"),
        *(entry(s, "stream") for s in streams),
    ]


def account_jwts(
    operator: Key, mesh: Key, edges: dict[str, Key], stream: StreamSettings
) -> dict[str, str]:
    """Account JWTs by public key: ``MESH`` with its exports, and each edge's account with its
    imports (no JetStream of its own on the hub)."""
    out = {
        mesh.public: nats_jwt.account_jwt(
            operator,
            mesh,
            "MESH",
            jetstream=True,
            exports=mesh_exports(stream),
            imports=edge_status_imports(edges),
        )
    }
    for edge, key in sorted(edges.items()):
        status = edge_status_subject(edge)
        out[key.public] = nats_jwt.account_jwt(
            operator,
            key,
            f"EDGE {edge}",
            jetstream=False,
            exports=[{"name": "status", "subject": status, "type": "stream"}],
            imports=edge_imports(mesh, key, edge, stream),
        )
    return out
