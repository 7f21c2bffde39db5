"""Settings read from ``MESH_*`` environment variables: their values, and names that are not
settings (refused, with the setting meant).

A misspelt name was silently ignored: ``MESH_WORKER_SLOTS=64`` gave a 1-slot worker,
``MESH_NATS_CRED_FILE`` a node connected without credentials, ``MESH_WORKER_METRIC_PORT`` a
worker with its metrics off. Names the tests and benchmarks read themselves are let through.
"""

from __future__ import annotations

import difflib
import json
import typing
from collections.abc import Iterable, Mapping
from typing import Any

from protocol.errors import InvalidRequestError

NOT_SETTINGS = ("MESH_BENCH_", "MESH_CHAOS_", "MESH_HOP_PROBE_DIR")
"""Names read by the benchmarks and test tools, not settings."""


def refuse_unknown(environ: Mapping[str, str], prefix: str, known: Iterable[str]) -> None:
    """Raise :class:`InvalidRequestError` naming each ``prefix`` name in ``environ`` that is
    no setting (set to something), with the closest setting's name where one is close."""
    names = set(known)
    unknown = sorted(
        name
        for name, value in environ.items()
        if name.startswith(prefix)
        and value != ""
        and name not in names
        and not name.startswith(NOT_SETTINGS)
    )
    if not unknown:
        return
    said = []
    for name in unknown:
        close = difflib.get_close_matches(name, names, n=1, cutoff=0.75)
        said.append(f"{name} is not a setting" + (f" (did you mean {close[0]}?)" if close else ""))
    raise InvalidRequestError(
        f"invalid configuration: {'; '.join(said)}; `mesh config` lists every setting"
    )


def set_path(tree: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def env_value(raw: str, annotation: Any = None) -> Any:
    """Env values are strings: JSON lists and objects are parsed; a list setting's plain value
    is its items, comma-separated (``zone-a,zone-b``; it was refused as "not a valid list");
    everything else pydantic coerces."""
    try:
        if raw.strip()[:1] in "[{":
            return json.loads(raw)
    except json.JSONDecodeError:
        return raw
    if _is_list(annotation):
        return [item.strip() for item in raw.split(",") if item.strip()]
    return raw


def _is_list(annotation: Any) -> bool:
    """Whether a setting's type is a list (perhaps optional)."""
    if typing.get_origin(annotation) is list:
        return True
    return any(typing.get_origin(arg) is list for arg in typing.get_args(annotation))
