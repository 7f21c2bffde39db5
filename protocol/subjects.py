"""Subject, stream and consumer names of protocol v1.

- ``mesh.v1.infer.<model>``: stream ``MESH_INFER`` (work queue), escalated requests
- ``mesh.v1.tok.<request_id>``: core NATS, token / restart / end / error events
- ``mesh.v1.cancel.<request_id>``: core NATS, cancel one request
- ``mesh.v1.edge.<edge_id>.infer``: core NATS request-reply (micro service), an edge's entry
"""

from __future__ import annotations

import re

PREFIX = "mesh.v1"
INFER_STREAM = "MESH_INFER"
INFER_WILDCARD = f"{PREFIX}.infer.>"
CANCEL_WILDCARD = f"{PREFIX}.cancel.*"
TOKEN_WILDCARD = f"{PREFIX}.tok.*"
NODES_BUCKET = "mesh_nodes"

# A request id, edge id or model token is one subject token: no dots, wildcards or spaces.
TOKEN_PATTERN = r"^[A-Za-z0-9_-]{1,128}$"  # noqa: S105 - a regex, not a secret
_TOKEN_RE = re.compile(TOKEN_PATTERN)
_UNSAFE_RE = re.compile(r"[^A-Za-z0-9_-]")
# A reply subject a worker may publish to: dot-separated tokens, no wildcards or whitespace.
_SUBJECT_RE = re.compile(r"^[^\s.*>]+(\.[^\s.*>]+)*$")


def is_token(value: str) -> bool:
    """True when ``value`` can be used as one subject token as it is."""
    return bool(_TOKEN_RE.match(value))


def is_subject(value: str) -> bool:
    """True when ``value`` is a literal subject (no wildcards) a node may publish to."""
    return len(value) <= 512 and bool(_SUBJECT_RE.match(value))


def model_token(model: str) -> str:
    """The subject token for a model name (``Qwen/Qwen2.5-7B`` -> ``Qwen_Qwen2_5-7B``)."""
    if not model:
        raise ValueError("model name is empty")
    return _UNSAFE_RE.sub("_", model)[:128]


def infer_subject(model: str) -> str:
    return f"{PREFIX}.infer.{model_token(model)}"


def token_subject(request_id: str) -> str:
    _check_token(request_id, "request id")
    return f"{PREFIX}.tok.{request_id}"


def cancel_subject(request_id: str) -> str:
    _check_token(request_id, "request id")
    return f"{PREFIX}.cancel.{request_id}"


def edge_infer_subject(edge_id: str) -> str:
    _check_token(edge_id, "edge id")
    return f"{PREFIX}.edge.{edge_id}.infer"


def consumer_name(model: str) -> str:
    """The durable pull consumer shared by every worker serving ``model``."""
    return f"workers_{model_token(model)}"


def request_id_of(subject: str) -> str:
    """The last token of a ``tok`` or ``cancel`` subject."""
    return subject.rsplit(".", 1)[-1]


def _check_token(value: str, what: str) -> None:
    if not is_token(value):
        raise ValueError(f"{what} {value!r} is not a valid subject token ([A-Za-z0-9_-], 1-128)")
