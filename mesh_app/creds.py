"""``mesh creds``: the hub's auth config and one credential per edge, worker and operator.

Each role gets exactly the subjects its process uses (see docs/security.md's threat model):

- an **edge** (or an edge site's leaf node) is an account of its own (``mesh_app.accounts``):
  it publishes only its own requests (``mesh.v1.infer.*.<edge>``) and cancels, reads only its
  own answers (``mesh.v1.tok.<edge>.*``, and what the store kept of them through the workers),
  creates no consumer, and reaches JetStream's API only to read the node registry, whether a
  model is served, and its site's kept answers;
- a **client** of an edge may only call that edge's entry subjects;
- a **worker** pulls from the work queue, publishes only on token subjects, announces only its
  own registry key, and may provision the mesh's own streams, nothing else;
- the **operator** may do anything (``mesh provision``, ``mesh status``, the ``nats`` CLI).

Every user has its own inbox prefix, so no one can subscribe to another's replies.

The work queue and the answer store are named by configuration (``MESH_STREAM_NAME``,
``MESH_STREAM_ANSWER_STREAM``): the permissions name the streams of the settings they are
minted under, so mint them with the same settings the processes run with.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from edge_node.api_keys import parse_keys
from mesh.config import StreamSettings, load_settings
from mesh.hub import hub_deletions
from mesh.stream_deleted import queue_words
from mesh_app import nats_jwt
from mesh_app.accounts import account_jwts, site_acks
from mesh_app.nats_jwt import Key, Permissions
from protocol.subjects import (
    ANSWER_WILDCARD,
    ANSWERS_STREAM,
    CANCEL_WILDCARD,
    GIVEN_UP_STREAM,
    LEASE_WILDCARD,
    LEASES_STREAM,
    NODES_BUCKET,
    NODES_STREAM,
    ORPHAN_WILDCARD,
    PREFIX,
    REGISTRY_UPDATES,
    STATUS_ASK,
    STORE_WILDCARD,
    TOKEN_WILDCARD,
    edge_status_subject,
    given_up_subject,
    is_token,
    site_consumer,
    worker_alives,
    worker_cancels,
)

EDGE_RESPONSES = 1_000_000
"""Events an edge may send to one client's reply inbox (a streamed answer is many messages)."""
RESPONSE_TTL_S = 3600.0
HUB_DOMAIN = "hub"
"""The hub's JetStream domain in the configs written here (``jetstream { domain: hub }``)."""


def inbox_prefix(role: str, name: str) -> str:
    return f"_INBOX.{role}.{name}"


def edge_permissions(
    edge: str, hub_domain: str | None = HUB_DOMAIN, *, stream: StreamSettings
) -> Permissions:
    """``hub_domain``: the hub's JetStream domain, which an edge on its site's leaf node (with
    JetStream of its own) names in every hub API call (``$JS.<domain>.API``). ``stream``: the
    settings naming the work queue and the answer store."""
    inbox = inbox_prefix("edge", edge)
    infer = stream.name
    site = site_consumer(edge)
    api = (
        f"CONSUMER.INFO.{infer}.*",
        # Collecting the answers of requests that could wait: pulls from its own durable,
        # which a worker creates (an edge creates no consumer on the hub's answers).
        f"CONSUMER.INFO.{ANSWERS_STREAM}.{site}",
        f"CONSUMER.MSG.NEXT.{ANSWERS_STREAM}.{site}",
        # Its deliveries lost with a link, sent again now (mesh.pull.Pull.redeliver).
        f"CONSUMER.RESET.{ANSWERS_STREAM}.{site}",
        *_registry_reader(),
    )
    prefixes = ["$JS.API"] + ([f"$JS.{hub_domain}.API"] if hub_domain else [])
    return Permissions(
        pub_allow=(
            f"{PREFIX}.infer.*.{edge}",
            f"{PREFIX}.cancel.{edge}.*",
            f"{PREFIX}.worker.*.cancel.{edge}.*",  # to the worker holding its request
            # Is the worker answering still there? If not, a live one hands the request back.
            f"{PREFIX}.worker.*.alive.{edge}.*",
            f"{PREFIX}.orphan.{edge}.*",
            # Answer repairs: what the store kept of its own answers, read by the workers.
            f"{PREFIX}.store.{edge}.*",
            edge_status_subject(edge),  # its answer when `mesh status` asks
            *(f"{prefix}.{call}" for prefix in prefixes for call in api),
            *site_acks(site),
        ),
        sub_allow=(
            f"{PREFIX}.tok.{edge}.*",
            f"{REGISTRY_UPDATES}.worker.>",  # the registry's updates (republished)
            # Its queue put back (its waiting requests go again), a pool gone (an SDK under an
            # edge's credentials).
            *queue_words(infer),
            STATUS_ASK,
            f"{PREFIX}.edge.{edge}.*",
            f"{inbox}.>",
            *_micro("mesh-edge"),
        ),
        responses=EDGE_RESPONSES,
        response_ttl_s=RESPONSE_TTL_S,
    )


def client_permissions(edge: str, name: str) -> Permissions:
    return Permissions(
        pub_allow=(f"{PREFIX}.edge.{edge}.*",),
        sub_allow=(f"{inbox_prefix('client', name)}.>",),
    )


def worker_permissions(node: str, *, stream: StreamSettings) -> Permissions:
    """``stream``: the settings naming the work queue and the answer store."""
    inbox = inbox_prefix("worker", node)
    infer, tokens = stream.name, stream.answer_stream
    streams = (infer, tokens, NODES_STREAM, ANSWERS_STREAM, LEASES_STREAM, GIVEN_UP_STREAM)
    return Permissions(
        pub_allow=(
            TOKEN_WILDCARD,
            *(f"$JS.API.STREAM.{op}.{s}" for op in ("INFO", "CREATE", "UPDATE") for s in streams),
            f"$JS.API.CONSUMER.CREATE.{infer}.>",
            f"$JS.API.CONSUMER.DURABLE.CREATE.{infer}.>",
            f"$JS.API.CONSUMER.INFO.{infer}.*",
            f"$JS.API.CONSUMER.MSG.NEXT.{infer}.*",
            # Each pool's given-up requests, read until a worker ends each (cloud_node.given_up).
            *(f"$JS.API.CONSUMER.{op}.{GIVEN_UP_STREAM}.>" for op in ("CREATE", "DURABLE.CREATE")),
            f"$JS.API.CONSUMER.MSG.NEXT.{GIVEN_UP_STREAM}.*",
            f"$JS.ACK.{GIVEN_UP_STREAM}.>",
            # Each site's collector consumer on the kept answers, made before its first answer.
            f"$JS.API.CONSUMER.CREATE.{ANSWERS_STREAM}.>",
            f"$JS.ACK.{infer}.>",
            f"$JS.API.STREAM.MSG.GET.{infer}",
            f"$JS.API.STREAM.MSG.DELETE.{infer}",
            f"$JS.API.DIRECT.GET.{tokens}",
            f"$JS.API.DIRECT.GET.{ANSWERS_STREAM}.>",
            f"$JS.API.DIRECT.GET.{LEASES_STREAM}.>",
            ANSWER_WILDCARD,
            LEASE_WILDCARD,
            f"{PREFIX}.worker.*.alive.*.*",  # is a worker named dead really gone?
            f"{PREFIX}.worker.*.reserve",  # a stopping worker asks its peers for free slots
            f"$KV.{NODES_BUCKET}.worker.*.{node}",  # its own key, in its model's pool
            f"$KV.{NODES_BUCKET}.handback.>",  # claims on handing back a dead worker's requests
            *(f"$JS.API.{call}" for call in _registry_reader()),
        ),
        sub_allow=(
            CANCEL_WILDCARD,
            ORPHAN_WILDCARD,
            STORE_WILDCARD,  # reads of the answer store for edges (each its own scope)
            worker_cancels(node),
            worker_alives(node),
            f"{PREFIX}.worker.{node}.status",
            f"{PREFIX}.worker.{node}.reserve",
            given_up_subject(infer, "*"),  # heard where the stream cannot be had
            *hub_deletions(stream, "*"),  # put back at once
            f"{inbox}.>",
            *_micro("mesh-worker"),
        ),
        responses=1,
        response_ttl_s=60.0,
    )


OPERATOR = Permissions(pub_allow=(">",), sub_allow=(">",))


def _registry_reader() -> tuple[str, ...]:
    """JetStream API calls (after the ``$JS.API.`` prefix) that read the node registry: its
    stream's info and batched direct gets. No consumer: updates come republished on
    ``mesh.v1.reg.>`` (see :mod:`mesh.registry`), which no user but the operator may publish."""
    return (f"STREAM.INFO.{NODES_STREAM}", f"DIRECT.GET.{NODES_STREAM}")


def _micro(service: str) -> tuple[str, ...]:
    """What ``nats micro ls/info/stats`` asks of a NATS micro service."""
    return ("$SRV.*", f"$SRV.*.{service}", f"$SRV.*.{service}.*")


@dataclass(frozen=True)
class Minted:
    out: Path
    auth_conf: Path
    users: dict[str, Path]
    """Credential file per user name (``operator``, ``edge-<id>``, ``worker-<id>``, ...)."""
    leaf_confs: dict[str, Path]
    """An edge site's leaf-node nats-server config per edge id."""


_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")


def parse_duration(text: str) -> float:
    """``90s``, ``30m``, ``12h``, ``30d`` -> seconds."""
    match = _DURATION.match(text.strip())
    if not match:
        raise ValueError(f"{text!r} is not a duration like 90s, 30m, 12h or 30d")
    return float(match.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[match.group(2)]


def mint(
    out: Path,
    *,
    edges: list[str],
    workers: list[str],
    clients: Sequence[tuple[str, str]] = (),
    expires_in: float | None = None,
    now: float | None = None,
    mount: str | None = None,
    hub_leaf_url: str = "nats-leaf://nats-hub:7422",
    leaf_tls_ca: str | None = None,
    leaf_store_dir: str | None = None,
    stream: StreamSettings | None = None,
) -> Minted:
    """Write ``auth.conf`` (include it in the hub's nats-server config) and a ``.creds`` plus an
    ``.env`` per user into ``out``. Keys already in ``out/keys`` are reused, so running it again
    adds users without invalidating the ones handed out. ``mount`` is the directory where the
    processes will find the files (a container's volume), written into the ``.env`` files.

    Each edge also gets ``leaf-<edge>.conf``: its site's nats-server, a leaf node that dials
    ``hub_leaf_url`` with the edge's credentials (and verifies the hub's TLS certificate against
    ``leaf_tls_ca`` when given), so the hub holds the whole site to the edge's permissions.

    ``stream`` names the streams the permissions cover; unset, this process's settings
    (``MESH_STREAM_*``) do."""
    for name in [*edges, *workers, *(app for _e, app in clients)]:
        if not is_token(name):
            raise ValueError(f"{name!r} is not a valid edge, worker or app id ([A-Za-z0-9_-])")
    for edge, app in clients:
        if edge not in edges:
            raise ValueError(f"--client names edge {edge!r}, which is not among --edge")
        if app == f"{edge}-apps":  # its inbox prefix would be the site's shared user's
            raise ValueError(f"--client {edge}:{app}: {app!r} names the site's shared apps user")
    stream = stream or load_settings().stream
    out.mkdir(parents=True, exist_ok=True)
    keys = _keys(out / "keys")
    expires = int((now or time.time()) + expires_in) if expires_in else 0
    users: dict[str, Path] = {}
    leaf_confs: dict[str, Path] = {}

    def user(
        file: str,
        name: str,
        permissions: Permissions,
        env: dict[str, str],
        account: Key | None = None,
    ) -> None:
        """A user of ``account`` (an edge's own; the ``MESH`` account's by default)."""
        key = nats_jwt.user_key()
        jwt = nats_jwt.user_jwt(account or keys["account"], key, name, permissions, expires)
        path = out / f"{file}.creds"
        _write_secret(path, nats_jwt.creds(jwt, key))
        env = {"MESH_NATS_CREDS_FILE": seen_at(path), **env}
        _write_secret(out / f"{file}.env", "".join(f"{k}={v}\n" for k, v in env.items()))
        users[file] = path

    def seen_at(path: Path) -> str:
        return f"{mount.rstrip('/')}/{path.name}" if mount else str(path.resolve())

    user("operator", "operator", OPERATOR, {})
    for edge in edges:
        account = _edge_key(out / "keys", edge)
        apps = [f"{edge}-apps", *(a for e, a in clients if e == edge)]
        keys_file = out / f"api-keys-{edge}"
        http_keys = _api_keys(keys_file, apps)
        user(
            f"edge-{edge}",
            f"edge {edge}",
            edge_permissions(edge, stream=stream),
            {
                "MESH_EDGE_EDGE_ID": edge,
                "MESH_NATS_SCOPE": edge,
                "MESH_NATS_HUB_DOMAIN": HUB_DOMAIN,
                "MESH_NATS_INBOX_PREFIX": inbox_prefix("edge", edge),
                "MESH_NATS_LEAST_PRIVILEGE": "true",
                "MESH_EDGE_API_KEYS_FILE": seen_at(keys_file),
            },
            account,
        )
        for app in apps:
            # One user for the site's apps together, and one per app named with --client, so
            # that app has an inbox prefix of its own.
            user(
                f"client-{edge}" if app == f"{edge}-apps" else f"client-{edge}-{app}",
                f"client {app} of edge {edge}",
                client_permissions(edge, app),
                {
                    "MESH_EDGE_EDGE_ID": edge,
                    # On the site's leaf, JetStream is the site's own: the hub's is a domain.
                    "MESH_NATS_HUB_DOMAIN": HUB_DOMAIN,
                    "MESH_NATS_INBOX_PREFIX": inbox_prefix("client", app),
                    "MESH_NATS_LEAST_PRIVILEGE": "true",
                    # The app's key to the edge's HTTP API, where the openai client looks.
                    "OPENAI_API_KEY": http_keys[app],
                },
                account,
            )
    for edge in edges:
        creds_path = seen_at(users[f"edge-{edge}"])
        leaf_confs[edge] = out / f"leaf-{edge}.conf"
        # A container's volume with --mount; else beside the files, where their user can write
        # (it was always /data/jetstream: an ordinary user's leaf could not start).
        store = leaf_store_dir or (
            "/data/jetstream" if mount else str((out / f"jetstream-{edge}").resolve())
        )
        leaf_confs[edge].write_text(_leaf_conf(edge, hub_leaf_url, creds_path, leaf_tls_ca, store))
    for worker in workers:
        user(
            f"worker-{worker}",
            f"worker {worker}",
            worker_permissions(worker, stream=stream),
            {
                "MESH_WORKER_NODE_ID": worker,
                "MESH_NATS_INBOX_PREFIX": inbox_prefix("worker", worker),
                "MESH_NATS_LEAST_PRIVILEGE": "true",
            },
        )
    auth = out / "auth.conf"
    auth.write_text(_auth_conf(keys, _edge_keys(out / "keys"), stream))
    return Minted(out=out, auth_conf=auth, users=users, leaf_confs=leaf_confs)


def _api_keys(path: Path, apps: list[str]) -> dict[str, str]:
    """The HTTP API keys of an edge's apps, by app: those in ``path`` stay (keys handed out
    stay valid), a new app gets a new key; written back to ``path`` (mode 0600)."""
    kept = {app: key for key, app in parse_keys(path.read_text()).items()} if path.exists() else {}
    for app in apps:
        kept.setdefault(app, "mesh-" + secrets.token_urlsafe(32))
    lines = ["# <app> <key>: the edge's HTTP API keys (MESH_EDGE_API_KEYS_FILE), by `mesh creds`"]
    _write_secret(path, "\n".join([*lines, *(f"{a} {k}" for a, k in kept.items())]) + "\n")
    return kept


def _leaf_conf(edge: str, hub_url: str, creds_path: str, tls_ca: str | None, store: str) -> str:
    tls = f'\n      tls {{ ca_file: "{tls_ca}" }}' if tls_ca else ""
    return f"""# Edge site {edge}: the nats-server its edge daemon and local apps use, written by
# `mesh creds`. A leaf node of the hub: it dials out (no inbound port at the site), and the hub
# holds everything crossing the link to edge {edge}'s permissions.
server_name: leaf-{edge}
port: 4222
# An uplink gone silent (the hub's host lost, a NAT's drop) is taken for dead once three pings a
# second apart go unanswered, and redialled (nats-server's own default: minutes).
ping_interval: "1s"
ping_max: 3

# The site's own JetStream (domain {edge}): requests that can wait are held here while the
# uplink is down, and their answers are kept here. The hub is domain {HUB_DOMAIN}.
jetstream {{
  store_dir: "{store}"
  domain: {edge}
}}

leafnodes {{
  # Redialled every second after a drop (nats-server's default; 2.15 warns about an integer
  # `reconnect`, and servers before it cannot read a duration there).
  remotes: [
    {{
      url: "{hub_url}"
      credentials: "{creds_path}"{tls}
    }}
  ]
}}
"""


def _keys(directory: Path) -> dict[str, Key]:
    """The operator, system account and mesh account keys: read, or made once."""
    directory.mkdir(parents=True, exist_ok=True)
    made = {
        "operator": nats_jwt.operator_key,
        "system": nats_jwt.account_key,
        "account": nats_jwt.account_key,
    }
    return {name: _key(directory / f"{name}.nk", new) for name, new in made.items()}


def _key(path: Path, new: Callable[[], Key]) -> Key:
    """The key whose seed ``path`` holds: read, or made once and written (mode 0600)."""
    if path.exists():
        return Key.from_seed(path.read_text().strip())
    key = new()
    _write_secret(path, key.seed + "\n")
    return key


def _edge_key(directory: Path, edge: str) -> Key:
    """Edge ``edge``'s account key: read, or made once (``keys/edge-<edge>.nk``)."""
    return _key(directory / f"edge-{edge}.nk", nats_jwt.account_key)


def _edge_keys(directory: Path) -> dict[str, Key]:
    """Every edge account minted here so far, this run's and earlier ones': the hub keeps
    vouching for credentials already handed out."""
    return {
        path.name.removeprefix("edge-").removesuffix(".nk"): Key.from_seed(path.read_text().strip())
        for path in sorted(directory.glob("edge-*.nk"))
    }


def _auth_conf(keys: dict[str, Key], edges: dict[str, Key], stream: StreamSettings) -> str:
    operator, system, account = keys["operator"], keys["system"], keys["account"]
    preload = {
        system.public: nats_jwt.account_jwt(operator, system, "SYS", jetstream=False),
        **account_jwts(operator, account, edges, stream),
    }
    lines = [
        "# Written by `mesh creds`: operator-mode auth for the mesh hub. Include it from the",
        "# server config (include auth.conf), and reload the hub after adding an edge. Users",
        "# are not listed here: each proves a JWT signed by its account's key (MESH for workers",
        "# and the operator, one account per edge), which `mesh creds` keeps in keys/.",
        f"operator: {nats_jwt.operator_jwt(operator, 'mesh', system.public)}",
        f"system_account: {system.public}",
        "resolver: MEMORY",
        "resolver_preload: {",
        *(f"  {pub}: {jwt}" for pub, jwt in preload.items()),
        "}",
        "",
    ]
    return "\n".join(lines)


def _write_secret(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)


def describe(minted: Minted) -> str:
    rows = {name: str(path) for name, path in minted.users.items()}
    return json.dumps({"auth_conf": str(minted.auth_conf), "creds": rows}, indent=2)
