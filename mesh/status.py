"""``mesh status``: the whole mesh at a glance, from what NATS already knows.

- workers: the node registry (who is alive, their slots) and each worker's micro-service STATS
  (in flight, completed, taken over...);
- edges: each edge's micro-service INFO and STATS (readiness, routes, fallbacks);
- the work queue: messages waiting, the senders holding most of them beside their share, and
  per model consumer what is pending and unacked;
- the answer store: events kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any

import nats.errors
from nats.js.errors import APIError, NotFoundError

from mesh.config import MeshSettings
from mesh.connection import Connection
from mesh.node_view import NodeView
from protocol.errors import MeshError
from protocol.subjects import EDGE_STATUS_WILDCARD, STATUS_ASK, model_token


async def gather(conn: Connection, subject: str, wait: float = 0.3) -> list[dict[str, Any]]:
    """Every reply to one request within ``wait`` seconds (the micro-service discovery way)."""
    inbox = conn.nc.new_inbox()
    return await _replies(conn, inbox, subject, inbox, wait)


async def ask_edges(conn: Connection, wait: float = 0.3) -> list[dict[str, Any]]:
    """Every edge's status, asked on :data:`STATUS_ASK`, gathered for ``wait`` seconds: how the
    operator reaches edges in accounts of their own."""
    return await _replies(conn, EDGE_STATUS_WILDCARD, STATUS_ASK, None, wait)


async def _replies(
    conn: Connection, listen: str, ask: str, reply: str | None, wait: float
) -> list[dict[str, Any]]:
    """The JSON objects arriving on ``listen`` within ``wait`` seconds of a publish on ``ask``."""
    nc = conn.nc
    sub = await nc.subscribe(listen)
    replies: list[dict[str, Any]] = []
    try:
        await nc.publish(ask, b"", reply=reply or "")
        deadline = time.monotonic() + wait
        while (left := deadline - time.monotonic()) > 0:
            try:
                msg = await sub.next_msg(timeout=left)
            except nats.errors.TimeoutError:
                break
            with contextlib.suppress(ValueError):
                if isinstance(body := json.loads(msg.data), dict):
                    replies.append(body)
    finally:
        with contextlib.suppress(nats.errors.Error):
            await sub.unsubscribe()
    return replies


async def _registry(conn: Connection, settings: MeshSettings) -> tuple[list[Any], str]:
    """The live workers the registry shows, and what to say of it (``ok``, or why it cannot
    be read: an election, JetStream down, when an operator needs the rest most)."""
    view = NodeView(conn, settings.stream.node_ttl, stream=settings.stream)
    try:
        await view.start()
        for _ in range(50):  # the initial snapshot arrives within a few ms
            if view.ready:
                break
            await asyncio.sleep(0.02)
        return view.live(), "ok"
    except (MeshError, nats.errors.Error, asyncio.TimeoutError) as exc:
        return [], f"unavailable: {getattr(exc, 'message', None) or repr(exc)}"
    finally:
        await view.stop()


async def collect_status(conn: Connection, settings: MeshSettings) -> dict[str, Any]:
    """What ``mesh status`` shows; each part that cannot be read says so, and the rest is
    still collected."""
    workers, registry = await _registry(conn, settings)
    worker_stats, edge_infos, edge_stats, asked = await asyncio.gather(
        gather(conn, "$SRV.STATS.mesh-worker"),
        gather(conn, "$SRV.INFO.mesh-edge"),
        gather(conn, "$SRV.STATS.mesh-edge"),
        ask_edges(conn),
    )
    by_node = {
        ep["data"].get("node_id"): ep["data"]
        for reply in worker_stats
        for ep in reply.get("endpoints", [])
        if isinstance(ep.get("data"), dict)
    }
    counters_by_id: dict[Any, dict[str, Any]] = {
        reply.get("id"): next(
            (ep["data"] for ep in reply.get("endpoints", []) if isinstance(ep.get("data"), dict)),
            {},
        )
        for reply in edge_stats
    }
    edges = [
        {**info.get("metadata", {}), "counters": counters_by_id.get(info.get("id"), {})}
        for info in edge_infos
    ]
    seen = {e.get("edge_id") for e in edges}
    # Edges in accounts of their own (mesh creds) answer only the broadcast; in one account
    # they answer both: each edge once.
    edges += [e for e in asked if e.get("edge_id") not in seen]
    listed = {w.node_id for w in workers}
    status: dict[str, Any] = {
        "registry": registry,
        "workers": [{**w.model_dump(), **by_node.get(w.node_id, {})} for w in workers]
        # Answering, but not in the registry (its announcement failing, aged out): edges do
        # not count on it.
        + [
            {"models": [data.get("model", "?")], **data, "in_registry": registry != "ok" and None}
            for node, data in by_node.items()
            if node not in listed
        ],
        "edges": edges,
    }
    status["capacity"] = {
        "slots": sum(w.slots for w in workers),
        "free": sum(w.free for w in workers),
    }
    jsm = conn.jsm()
    try:
        stream = await jsm.stream_info(settings.stream.name, subjects_filter=">")
    except NotFoundError:
        status["queue"] = None
    except (APIError, nats.errors.Error, asyncio.TimeoutError) as exc:
        status["queue"] = {"unavailable": repr(exc)}
    else:
        status["queue"] = {
            "stream": settings.stream.name,
            "waiting": stream.state.messages,
            "share": stream.config.max_msgs_per_subject,
            "top_senders": top_senders(stream.state.subjects or {}),
            "consumers": [
                {
                    "name": c.name,
                    "pending": c.num_pending,
                    "unacked": c.num_ack_pending,
                    "redelivered": c.num_redelivered,
                }
                for c in await jsm.consumers_info(settings.stream.name)
            ],
        }
    status["pools"] = pools(workers, status["queue"])
    try:
        store = await jsm.stream_info(settings.stream.answer_stream)
    except NotFoundError:
        status["answer_store"] = None
    except (APIError, nats.errors.Error, asyncio.TimeoutError) as exc:
        status["answer_store"] = {"unavailable": repr(exc)}
    else:
        status["answer_store"] = {
            "stream": settings.stream.answer_stream,
            "events": store.state.messages,
            "bytes": store.state.bytes,
        }
    return status


def top_senders(subjects: dict[str, int], most: int = 5) -> list[dict[str, Any]]:
    """The senders holding the most queued requests (``mesh.v1.infer.<model>.<scope>``), to
    set beside their share of the queue."""
    held = sorted(
        ((-waiting, subject) for subject, waiting in subjects.items() if waiting > 0),
    )
    rows: list[dict[str, Any]] = []
    for negative, subject in held:
        parts = subject.split(".")
        if len(parts) == 5:
            rows.append({"model": parts[3], "scope": parts[4], "waiting": -negative})
    return rows[:most]


def pools(workers: list[Any], queue: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """Per model pool: its live workers, their slots and free slots, and its queue (requests
    waiting for a worker, and delivered but not yet acked)."""
    out: dict[str, dict[str, Any]] = {}

    def pool(token: str) -> dict[str, Any]:
        return out.setdefault(
            token, {"workers": 0, "slots": 0, "free": 0, "waiting": 0, "in_flight": 0}
        )

    for w in workers:
        for model in w.models:
            entry = pool(model_token(model))
            entry["workers"] += 1
            entry["slots"] += w.slots
            entry["free"] += w.free
    for consumer in (queue or {}).get("consumers", []):
        name = consumer["name"]
        if name.startswith("workers_"):
            entry = pool(name.removeprefix("workers_"))
            entry["waiting"] += consumer["pending"]
            entry["in_flight"] += consumer["unacked"]
    return out


def render(status: dict[str, Any]) -> list[str]:
    """``status`` as the table ``mesh status`` prints."""
    cap = status["capacity"]
    registry = status.get("registry", "ok")
    lines = [] if registry == "ok" else [f"registry: {registry}"]
    listed = [w for w in status["workers"] if w.get("in_registry", True) is True]
    lines.append(f"workers alive: {len(listed)} (slots {cap['slots']}, free {cap['free']})")
    for w in status["workers"]:
        lines.append(
            f"  {w['node_id']:<32} models={','.join(w['models'])} slots={w['slots']} "
            f"free={w['free']} in_flight={w.get('in_flight', '?')} "
            f"completed={w.get('completed', '?')} continued={w.get('continued', '?')}"
            + ("" if w.get("health", "ok") == "ok" else f" health={w['health']}")
            + (" NOT IN THE REGISTRY: edges do not see it" if w.get("in_registry") is False else "")
            + (f" restoring={','.join(w['restoring'])}" if w.get("restoring") else "")
            + (
                f" BEHIND: its loop runs {w.get('loop_lag_ms')} ms late, it cannot keep up with"
                " its engine (run another worker process for it)"
                if w.get("behind")
                else ""
            )
        )
    lines.append(f"edges: {len(status['edges'])}")
    for e in status["edges"]:
        counters = e.get("counters", {})
        routes = {k: v for k, v in counters.items() if k.startswith(("route.", "fallback"))}
        lines.append(
            f"  {e.get('edge_id', '?'):<32} status={e.get('status', '?')} "
            f"cloud={e.get('cloud', '?')} in_flight={counters.get('in_flight', '?')} "
            f"{' '.join(f'{k}={v}' for k, v in routes.items())}"
            + (
                f" BEHIND: its loop runs {counters.get('loop_lag_ms')} ms late"
                if counters.get("behind")
                else ""
            )
        )
        budget = counters.get("budget")
        if isinstance(budget, dict):
            lines.append(
                f"    cloud budget: {budget.get('policy')} target={budget.get('target')} "
                f"realized={budget.get('realized')} over {budget.get('window')} "
                f"cap={budget.get('cap_per_minute')} capped={budget.get('capped')}"
            )
    for name, p in sorted(status.get("pools", {}).items()):
        lines.append(
            f"pool {name}: {p['workers']} workers, slots {p['slots']} (free {p['free']}), "
            f"{p['waiting']} waiting, {p['in_flight']} in flight"
        )
    queue = status["queue"]
    if queue is None:
        lines.append("queue: not provisioned")
    elif "unavailable" in queue:
        lines.append(f"queue: cannot be read ({queue['unavailable']})")
    else:
        share = queue.get("share", -1)
        lines.append(
            f"queue {queue['stream']}: {queue['waiting']} waiting"
            + (f", at most {share} per sender and model" if share and share > 0 else "")
        )
        if queue.get("top_senders"):
            lines.append(
                "  most queued: "
                + ", ".join(
                    f"{row['scope']} ({row['model']}) {row['waiting']}"
                    for row in queue["top_senders"]
                )
            )
        lines += [
            f"  {c['name']:<32} pending={c['pending']} in_flight={c['unacked']} "
            f"redelivered={c['redelivered']}"
            for c in queue["consumers"]
        ]
    store = status["answer_store"]
    if store is not None and "unavailable" in store:
        lines.append(f"answer store: cannot be read ({store['unavailable']})")
    elif store is not None:
        lines.append(
            f"answer store {store['stream']}: {store['events']} events, "
            f"{store['bytes'] / 1024 / 1024:.1f} MiB"
        )
    return lines
