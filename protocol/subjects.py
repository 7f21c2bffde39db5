"""Subject, stream and consumer names of protocol v1.

- ``mesh.v1.infer.<model>.<scope>``: stream ``MESH_INFER`` (work queue), escalated requests
- ``mesh.v1.tok.<scope>.<request_id>``: start / tok / end / err events, also kept a while in
  stream ``MESH_TOK`` so a reader can fetch what it missed and a new worker can continue the answer
- ``mesh.v1.cancel.<scope>.<request_id>``: core NATS, cancel a request no worker has started
  (every worker listens); ``mesh.v1.worker.<node>.cancel.<scope>.<request_id>`` cancels one that
  worker ``<node>`` has started (only it listens)
- ``mesh.v1.edge.<edge_id>.infer``: core NATS request-reply (micro service), an edge's entry;
  ``.cancel`` and ``.resend`` beside it let the sender cancel or fetch missed events
- ``mesh.v1.worker.<node_id>.status``: a worker's status (micro service ``mesh-worker``)
- ``mesh.v1.store.<scope>.<request_id>``: core NATS request-reply (queue group ``mesh-store``,
  every worker), what ``MESH_TOK`` kept of that answer: how a sender that may not read the stream
  itself (``mesh creds``) repairs its answers
- ``mesh.v1.ans.<scope>.<request_id>``: stream ``MESH_ANSWERS`` on the hub, the whole answer
  (or typed error) of a request that could wait, kept for its site to collect
- ``mesh.v1.lease.<scope>.<request_id>``: stream ``MESH_LEASES`` on the hub, which queued copy
  of a request that can wait is being answered (one at a time; see ``cloud_node/lease.py``)
- an edge site's own JetStream (its leaf node): stream ``MESH_OUTBOX``
  (``mesh.v1.outbox.<model>.<scope>``) holds requests that can wait until the uplink carries
  them to the hub; stream ``MESH_KEPT`` (``mesh.v1.kept.<request_id>``) keeps their answers

The *scope* names who queued a request: an edge's id, or the sender's own name. Request ids are
unique within a scope. A worker answers on the token subject of the scope the request arrived
under, so a server that permits each sender only ``mesh.v1.infer.*.<own scope>``, and lets it
subscribe only to ``mesh.v1.tok.<own scope>.>``, keeps senders out of each other's answers and
cancels (see ``mesh creds``).
"""

from __future__ import annotations

import functools
import re

PREFIX = "mesh.v1"
INFER_STREAM = "MESH_INFER"
INFER_WILDCARD = f"{PREFIX}.infer.*.*"
# What workers subscribe to for words addressed by <scope>.<id>: a ``>`` tail, not ``*.*``. An
# edge on a leaf node reaches a hub subscription only when the hub passes its interest over the
# link, and the hub passes a wildcard subscription only if the leaf's permissions
# (``mesh.v1.cancel.<edge>.*``) match it: ``mesh.v1.cancel.*.*`` never does, ``mesh.v1.cancel.>``
# does (measured with `mesh creds` permissions: every ``*.*`` form got "no responders" from a
# site). Handlers check the token count themselves (:func:`addressed`).
CANCEL_WILDCARD = f"{PREFIX}.cancel.>"
ORPHAN_WILDCARD = f"{PREFIX}.orphan.>"
STORE_WILDCARD = f"{PREFIX}.store.>"
TOKEN_WILDCARD = f"{PREFIX}.tok.*.*"
ANSWERS_STREAM = "MESH_ANSWERS"
ANSWER_WILDCARD = f"{PREFIX}.ans.*.*"
OUTBOX_STREAM = "MESH_OUTBOX"
OUTBOX_WILDCARD = f"{PREFIX}.outbox.*.*"
KEPT_STREAM = "MESH_KEPT"
KEPT_WILDCARD = f"{PREFIX}.kept.*"
CLAIMS_STREAM = "MESH_CLAIMS"
CLAIM_WILDCARD = f"{PREFIX}.claim.*"
LEASES_STREAM = "MESH_LEASES"
LEASE_WILDCARD = f"{PREFIX}.lease.*.*"
GIVEN_UP_STREAM = "MESH_GIVEN_UP"
"""JetStream's advisories of queued requests whose deliveries ran out, kept until a worker ends
each (:mod:`cloud_node.given_up`)."""
DEFAULT_SCOPE = "anon"
"""The scope of a sender that names none (the SDK and CLI on an open server)."""
NODES_BUCKET = "mesh_nodes"
NODES_STREAM = f"KV_{NODES_BUCKET}"
"""The registry bucket's stream."""
REGISTRY_UPDATES = f"{PREFIX}.reg"
"""Where the registry's stream republishes every update: ``mesh.v1.reg.<key>``."""

# A request id, edge id or model token is one subject token: no dots, wildcards or spaces.
TOKEN_PATTERN = r"^[A-Za-z0-9_-]{1,128}$"  # noqa: S105 - a regex, not a secret
_TOKEN_RE = re.compile(TOKEN_PATTERN)
_UNSAFE_RE = re.compile(r"[^A-Za-z0-9_-]")
# A reply subject a worker may publish to: dot-separated tokens, no wildcards or whitespace.
_SUBJECT_RE = re.compile(r"^[^\s.*>]+(\.[^\s.*>]+)*$")


CLOUD_NODE = "cloud:"
"""How a worker names itself in the ``node`` of its ``start`` events (``cloud:<node_id>``); an
edge answering locally names itself without it."""


def cloud_node_name(node_id: str) -> str:
    """The ``node`` a worker puts in its start events."""
    return f"{CLOUD_NODE}{node_id}"


def worker_of(node: str) -> str | None:
    """The worker's node id in a start event's ``node``; None when a worker did not start it."""
    worker = node[len(CLOUD_NODE) :] if node.startswith(CLOUD_NODE) else None
    return worker or None  # "cloud:" names no worker


def is_token(value: str) -> bool:
    """True when ``value`` can be used as one subject token as it is."""
    return bool(_TOKEN_RE.fullmatch(value))  # match's $ takes a final newline too


MAX_SUBJECT = 512
"""The longest subject the mesh carries in a message of its own (a request's reply subject)."""


def is_literal(value: str) -> bool:
    """True when ``value`` is a literal subject (no wildcards, no whitespace) of any length."""
    return bool(_SUBJECT_RE.fullmatch(value))


def is_subject(value: str) -> bool:
    """True when ``value`` is a literal subject (no wildcards) the mesh carries."""
    return len(value) <= MAX_SUBJECT and is_literal(value)


_RESERVED_PREFIXES = ("$", "mesh.")


def is_reserved(value: str) -> bool:
    """True when ``value`` is in the server's own (``$...``) or the mesh's own (``mesh.``)
    space: a node never publishes a client's answer there."""
    return value.startswith(_RESERVED_PREFIXES)


def is_reply_inbox(value: str) -> bool:
    """True when a node may send a client's answer to ``value``: a literal subject outside the
    server's own (``$JS``, ``$SYS``, ``$KV``, any ``$``) and the mesh's own (``mesh.``) spaces.

    A client names its reply subject; a subject in those spaces would make a node publish into
    the work queue, another request's events, a cancel, or a JetStream API call.
    """
    return is_subject(value) and not is_reserved(value)


_NUID = re.compile(r"[A-Za-z0-9]{22}")
"""A NATS client's unique id (22 base62 characters): what it names a connection's inboxes by."""


def sender_scope(reply: str) -> str:
    """The part of a reply inbox that names its connection: all but the last token, when the
    token before it is a NUID.

    NATS clients make one inbox prefix per connection (``<prefix>.<nuid>``) and one last token
    per request under it (``<prefix>.<nuid>.<token>``: nats-py, Go and the `nats` CLI, the SDK),
    so two requests from one client share a scope and two clients never do. Request ids are
    only unique within a scope. An inbox made for one request (``<prefix>.<nuid>``: an
    old-style request of nats-py, nats.js ``noMux``), or a reply subject of the client's own
    choosing, is a scope of its own: cut short, it could make many clients one sender (all of
    ``_INBOX``, or of an app's ``_INBOX.client.<app>``), whose ids clash or join another's.
    """
    head, _, _ = reply.rpartition(".")
    return head if _NUID.fullmatch(head.rpartition(".")[2]) else reply


@functools.lru_cache(maxsize=256)
def model_token(model: str) -> str:
    """The subject token for a model name (``Qwen/Qwen2.5-7B`` -> ``Qwen_Qwen2_5-7B``).

    Remembered for the last 256 names: a node asks for the same few on every request (its
    subjects, its fingerprints, its registry's pool): 0.3 to 0.6 -> 0.06 us a call."""
    if not model:
        raise ValueError("model name is empty")
    return _UNSAFE_RE.sub("_", model)[:128]


def infer_subject(model: str, scope: str) -> str:
    _check_token(scope, "scope")
    return f"{PREFIX}.infer.{model_token(model)}.{scope}"


def model_infer_filter(model: str) -> str:
    """Every scope's requests for ``model``: the filter of its workers' consumer."""
    return f"{PREFIX}.infer.{model_token(model)}.*"


def token_subject(scope: str, request_id: str) -> str:
    _check_token(scope, "scope")
    _check_token(request_id, "request id")
    return f"{PREFIX}.tok.{scope}.{request_id}"


def store_read_subject(scope: str, request_id: str) -> str:
    """Where a sender asks the workers what the answer store kept of its answer: the scope is
    the subject's, so a server that lets a sender publish only ``mesh.v1.store.<own scope>.*``
    keeps it to its own answers (see :mod:`cloud_node.store_service`)."""
    _check_token(scope, "scope")
    _check_token(request_id, "request id")
    return f"{PREFIX}.store.{scope}.{request_id}"


def cancel_subject(scope: str, request_id: str) -> str:
    _check_token(scope, "scope")
    _check_token(request_id, "request id")
    return f"{PREFIX}.cancel.{scope}.{request_id}"


def answer_subject(scope: str, request_id: str) -> str:
    _check_token(scope, "scope")
    _check_token(request_id, "request id")
    return f"{PREFIX}.ans.{scope}.{request_id}"


def lease_subject(scope: str, request_id: str) -> str:
    _check_token(scope, "scope")
    _check_token(request_id, "request id")
    return f"{PREFIX}.lease.{scope}.{request_id}"


def outbox_subject(model: str, scope: str) -> str:
    _check_token(scope, "scope")
    return f"{PREFIX}.outbox.{model_token(model)}.{scope}"


def kept_subject(request_id: str) -> str:
    _check_token(request_id, "request id")
    return f"{PREFIX}.kept.{request_id}"


def claim_subject(request_id: str) -> str:
    """Who may fetch the kept answer of ``request_id`` at a site (the first to hold it)."""
    _check_token(request_id, "request id")
    return f"{PREFIX}.claim.{request_id}"


def site_answers_filter(scope: str) -> str:
    _check_token(scope, "scope")
    return f"{PREFIX}.ans.{scope}.*"


def site_consumer(scope: str) -> str:
    """The hub consumer through which a site collects its answers (filtered to its scope)."""
    _check_token(scope, "scope")
    return f"site_{scope}"


def edge_answer_subject(edge_id: str) -> str:
    """Where a client asks an edge for the kept answer of a request that could wait."""
    _check_token(edge_id, "edge id")
    return f"{PREFIX}.edge.{edge_id}.answer"


def scope_of(subject: str) -> str | None:
    """The scope a queued request arrived under (the last token of ``mesh.v1.infer.<m>.<s>``),
    or None when ``subject`` is not such a subject."""
    parts = subject.split(".")
    if len(parts) != 5 or parts[:3] != ["mesh", "v1", "infer"] or not is_token(parts[4]):
        return None
    return parts[4]


def edge_infer_subject(edge_id: str) -> str:
    _check_token(edge_id, "edge id")
    return f"{PREFIX}.edge.{edge_id}.infer"


def edge_cancel_subject(edge_id: str) -> str:
    """Where a client cancels its own request at an edge (it sends from its reply inbox)."""
    _check_token(edge_id, "edge id")
    return f"{PREFIX}.edge.{edge_id}.cancel"


def edge_resend_subject(edge_id: str) -> str:
    """Where a client asks an edge to send again the events of its request that it missed."""
    _check_token(edge_id, "edge id")
    return f"{PREFIX}.edge.{edge_id}.resend"


def worker_cancel_subject(node_id: str, scope: str, request_id: str) -> str:
    """A cancel addressed to the worker holding the request (``node_id`` from its start
    event): it reaches that worker only, where ``cancel_subject`` reaches every worker."""
    _check_token(scope, "scope")
    _check_token(request_id, "request id")
    return f"{PREFIX}.worker.{model_token(node_id)}.cancel.{scope}.{request_id}"


def worker_cancels(node_id: str) -> str:
    """What a worker subscribes to for the cancels addressed to it."""
    return f"{PREFIX}.worker.{model_token(node_id)}.cancel.>"


def worker_alive_subject(node_id: str, scope: str, request_id: str) -> str:
    """Where a reader asks the worker that started its request whether it is still there: it
    answers while it lives; once its connection is gone the server answers "no responders"."""
    _check_token(scope, "scope")
    _check_token(request_id, "request id")
    return f"{PREFIX}.worker.{model_token(node_id)}.alive.{scope}.{request_id}"


def worker_alives(node_id: str) -> str:
    """What a worker subscribes to for those questions."""
    return f"{PREFIX}.worker.{model_token(node_id)}.alive.>"


def orphan_subject(scope: str, request_id: str) -> str:
    """Where a reader says the worker answering its request is gone: one live worker (a queue
    group) checks that for itself and hands the dead worker's delivery back to the queue."""
    _check_token(scope, "scope")
    _check_token(request_id, "request id")
    return f"{PREFIX}.orphan.{scope}.{request_id}"


STATUS_ASK = f"{PREFIX}.status.ask"
"""``mesh status`` asks every edge for its status here; each answers on
:func:`edge_status_subject`. Under ``mesh creds`` an edge is an account of its own, where the
operator's micro-service discovery does not reach: this subject is exported to every edge's
account, and each edge's answer subject back to the operator's."""
EDGE_STATUS_WILDCARD = f"{PREFIX}.status.edge.>"


def edge_status_subject(edge_id: str) -> str:
    """Where edge ``edge_id`` publishes its status when ``mesh status`` asks."""
    return f"{PREFIX}.status.edge.{model_token(edge_id)}"


def worker_status_subject(node_id: str) -> str:
    """A worker's status endpoint (its micro service ``mesh-worker``)."""
    return f"{PREFIX}.worker.{model_token(node_id)}.status"


def worker_reserve_subject(node_id: str) -> str:
    """Where a stopping worker asks a peer to promise it free slots (``mesh-worker``)."""
    return f"{PREFIX}.worker.{model_token(node_id)}.reserve"


def given_up_subject(stream: str, consumer: str) -> str:
    """Where JetStream says that ``consumer`` of ``stream`` gave up on a message (``*``: any)."""
    return f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{stream}.{consumer}"


def consumer_name(model: str) -> str:
    """The durable pull consumer shared by every worker serving ``model``."""
    return f"workers_{model_token(model)}"


def address_of(subject: str) -> tuple[str, str]:
    """(scope, request id): the last two tokens of a ``tok``, ``cancel``, ``alive`` or
    ``orphan`` subject."""
    head, _, request_id = subject.rpartition(".")
    return head.rpartition(".")[2], request_id


def addressed(subject: str) -> tuple[str, str] | None:
    """(scope, request id) of a word addressed to one request: ``mesh.v1.<verb>.<scope>.<id>``
    or ``mesh.v1.worker.<node>.<verb>.<scope>.<id>``; None for any other shape (workers
    subscribe with ``>`` tails, so a subject may carry more tokens than a sender meant)."""
    tokens = subject.split(".")
    if len(tokens) not in (5, 7) or (len(tokens) == 7) != (tokens[2] == "worker"):
        return None
    scope, request_id = tokens[-2], tokens[-1]
    return (scope, request_id) if is_token(scope) and is_token(request_id) else None


def _check_token(value: str, what: str) -> None:
    if not is_token(value):
        raise ValueError(f"{what} {value!r} is not a valid subject token ([A-Za-z0-9_-], 1-128)")
