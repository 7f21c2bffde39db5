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
- streams: its token subjects, the registry's republished updates, and JetStream's word that a
  consumer of the queue was made (its queue put back: :mod:`mesh.queue_watch`) or deleted (a
  pool gone: :mod:`mesh.served_models`).

Every export but the registry's needs an activation token, which ``MESH`` signs per edge for
that edge's own subjects only. Reply and deliver subjects then live in the edge's account: a
request whose reply names another edge's subject answers into the requester's own namespace.
An edge may create no consumer at all (a consumer it created would live in ``MESH`` and could
deliver anywhere there).
"""

from __future__ import annotations

from typing import Any

from mesh.config import StreamSettings
from mesh.stream_deleted import queue_words
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


def site_acks(site: str) -> tuple[str, str]:
    """The ack subjects of a site's collector's deliveries: the 9-token form
    (``$JS.ACK.<stream>.<consumer>`` and five numbers) and the domain form (a domain and an
    account hash first, 12 tokens or more). Each is pinned to its length: with a ``>`` after
    the consumer, the domain form also matched the 9-token ack subject of every other consumer
    (its stream and consumer in the wildcards), and a ``+NXT`` there pulled that consumer's
    next message, another edge's queued request or kept answer, to the sender."""
    return (
        f"$JS.ACK.{ANSWERS_STREAM}.{site}.*.*.*.*.*",
        f"$JS.ACK.*.*.{ANSWERS_STREAM}.{site}.*.*.*.*.*.>",
    )


def _lanes(stream: StreamSettings) -> list[tuple[str, str, str | None]]:
    """Every lane ``MESH`` exports: (kind, subject, response type of a service). ``{edge}``
    and ``{site}`` stand where an edge's id and its site consumer's name go: a wildcard in the
    export, the edge's own in its import (with an activation token, unless public)."""
    infer, answers, kv = stream.name, ANSWERS_STREAM, NODES_STREAM
    service = "service"
    return [
        (service, f"{PREFIX}.infer.*.{{edge}}", "Singleton"),
        (service, f"{PREFIX}.cancel.{{edge}}.*", "Singleton"),
        (service, f"{PREFIX}.worker.*.cancel.{{edge}}.*", "Singleton"),
        (service, f"{PREFIX}.worker.*.alive.{{edge}}.*", "Singleton"),
        (service, f"{PREFIX}.orphan.{{edge}}.*", "Singleton"),
        (service, f"{PREFIX}.store.{{edge}}.*", "Stream"),
        (service, f"$JS.API.CONSUMER.INFO.{infer}.*", "Singleton"),
        (service, f"$JS.API.CONSUMER.INFO.{answers}.{{site}}", "Singleton"),
        (service, f"$JS.API.CONSUMER.MSG.NEXT.{answers}.{{site}}", "Stream"),
        (service, f"$JS.API.CONSUMER.RESET.{answers}.{{site}}", "Singleton"),
        *((service, ack, "Singleton") for ack in site_acks("{site}")),
        (service, f"$JS.API.DIRECT.GET.{kv}", "Stream"),
        (service, f"$JS.API.STREAM.INFO.{kv}", "Singleton"),
        ("stream", f"{PREFIX}.tok.{{edge}}.*", None),
        ("stream", REGISTRY, None),
        ("stream", STATUS_ASK, None),
        *(("stream", word, None) for word in queue_words(infer)),
    ]


def _public(stream: StreamSettings) -> set[str]:
    """Exports any account may import: the registry is every edge's to read, and every edge hears
    ``mesh status`` ask and its queue's consumers made and deleted."""
    return {
        f"$JS.API.DIRECT.GET.{NODES_STREAM}",
        f"$JS.API.STREAM.INFO.{NODES_STREAM}",
        REGISTRY,
        STATUS_ASK,
        NOOP,
        *queue_words(stream.name),
    }


def mesh_exports(stream: StreamSettings) -> list[dict[str, Any]]:
    """The exports of the ``MESH`` account (the same whatever the edges)."""
    out: list[dict[str, Any]] = []
    public = _public(stream)
    for kind, template, response in [*_lanes(stream), ("service", NOOP, "Singleton")]:
        subject = template.format(edge="*", site="*")
        export: dict[str, Any] = {"name": subject, "subject": subject, "type": kind}
        if response is not None:
            export["response_type"] = response
        if subject not in public:
            export["token_req"] = True
        out.append(export)
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


def edge_slice(edge: str, stream: StreamSettings) -> list[tuple[str, str]]:
    """(kind, subject) of each lane edge ``edge`` imports: each export with its id filled in."""
    site = site_consumer(edge)
    return [(kind, t.format(edge=edge, site=site)) for kind, t, _response in _lanes(stream)]


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
    public = _public(stream)

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
        *(entry(subject, kind) for kind, subject in edge_slice(edge, stream)),
        entry(NOOP, "service", local="$JS.API.INFO"),
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
