"""`mesh creds` names the streams the settings name: a renamed work queue or answer store gets
permissions for its own name, and a mesh on renamed streams runs under them.

Before, the permissions named MESH_INFER and MESH_TOK whatever the settings said: a worker
minted for a mesh on other streams could not create, read or ack its own queue.
"""

from __future__ import annotations

import base64
import contextlib
import json
from pathlib import Path
from typing import Any

import pytest

from cloud_node.worker import Worker
from edge_node.node import EdgeNode
from edge_node.router import HeuristicRouter
from mesh.backends.deterministic import DeterministicBackend
from mesh.client import MeshClient
from mesh.config import StreamSettings, load_settings
from mesh.connection import Connection
from mesh.credentials import check_creds_file, may_subscribe
from mesh.nats_server import NatsServer
from mesh_app.cli import main
from mesh_app.creds import mint

RENAMED = {"MESH_STREAM_NAME": "OTHER_INFER", "MESH_STREAM_ANSWER_STREAM": "OTHER_TOK"}
DEFAULTS = ("MESH_INFER", "MESH_TOK")


def permissions(creds: Path) -> dict[str, list[str]]:
    """The subjects a minted user may publish and subscribe to, from its JWT's claims."""
    claims: dict[str, Any] = check_creds_file(str(creds))["nats"]
    return {"pub": claims["pub"].get("allow", []), "sub": claims["sub"].get("allow", [])}


def named(subjects: list[str], stream: str) -> list[str]:
    return [s for s in subjects if stream in s.split(".")]


def account_claims(out: Path, name: str) -> dict[str, Any]:
    """The ``nats`` claims of the account named ``name`` in the ``auth.conf`` minted in ``out``."""
    for line in (out / "auth.conf").read_text().splitlines():
        if line.startswith("  ") and ": " in line:
            payload = line.split(": ", 1)[1].split(".")[1]
            claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
            if claims["name"] == name:
                return dict(claims["nats"])
    raise AssertionError(f"no account {name!r} in auth.conf")


def test_mesh_creds_names_the_streams_of_its_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name, value in RENAMED.items():
        monkeypatch.setenv(name, value)
    assert main(["creds", "--out", str(tmp_path), "--edge", "e1", "--worker", "w1"]) == 0
    creds = json.loads(capsys.readouterr().out)["creds"]
    edge, worker = permissions(creds["edge-e1"]), permissions(creds["worker-w1"])
    # The edge: whether a model is served (the queue's consumers), at home and as a site; its
    # answer repairs go through the workers, and it creates no consumer anywhere.
    assert "$JS.API.CONSUMER.INFO.OTHER_INFER.*" in edge["pub"]
    assert "$JS.hub.API.CONSUMER.INFO.OTHER_INFER.*" in edge["pub"]
    assert "mesh.v1.store.e1.*" in edge["pub"]
    assert [s for s in edge["pub"] if ".CONSUMER.CREATE." in s] == []
    # Its account imports from the MESH account what it may call, named by the settings too.
    imports = account_claims(tmp_path, "EDGE e1")["imports"]
    assert "$JS.API.CONSUMER.INFO.OTHER_INFER.*" in {i["subject"] for i in imports}
    exports = account_claims(tmp_path, "MESH")["exports"]
    assert "$JS.API.CONSUMER.INFO.OTHER_INFER.*" in {e["subject"] for e in exports}
    # The worker: provisions, pulls from and acks its queue, reads the answer store, hears of
    # requests that ran out of deliveries.
    for subject in (
        "$JS.API.STREAM.CREATE.OTHER_INFER",
        "$JS.API.STREAM.UPDATE.OTHER_TOK",
        "$JS.API.CONSUMER.DURABLE.CREATE.OTHER_INFER.>",
        "$JS.API.CONSUMER.MSG.NEXT.OTHER_INFER.*",
        "$JS.ACK.OTHER_INFER.>",
        "$JS.API.STREAM.MSG.DELETE.OTHER_INFER",
        "$JS.API.DIRECT.GET.OTHER_TOK",
    ):
        assert subject in worker["pub"], subject
    assert "$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.OTHER_INFER.*" in worker["sub"]
    for stream in ("OTHER_INFER", "OTHER_TOK"):  # a stream deleted under it: put back at once
        assert f"$JS.EVENT.ADVISORY.STREAM.DELETED.{stream}" in worker["sub"], stream
    assert "$JS.EVENT.ADVISORY.CONSUMER.DELETED.OTHER_INFER.*" in worker["sub"]
    # The edge hears its queue's consumers made and deleted (its queue put back, a pool gone),
    # through its account's imports; an app of the edge does not, and can tell so ahead.
    for word in ("CREATED", "DELETED"):
        subject = f"$JS.EVENT.ADVISORY.CONSUMER.{word}.OTHER_INFER.*"
        assert subject in edge["sub"], subject
        assert subject in {i["subject"] for i in imports}, subject
        assert subject in {e["subject"] for e in exports}, subject
        assert may_subscribe(check_creds_file(creds["edge-e1"]), subject)
        assert not may_subscribe(check_creds_file(creds["client-e1"]), subject)
    # Nothing is left of the default names, which this mesh does not use.
    for stream in DEFAULTS:
        for who in (edge, worker):
            assert named(who["pub"] + who["sub"], stream) == [], stream


def test_settings_passed_in_win_over_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MESH_STREAM_NAME", "FROM_ENV")
    minted = mint(
        tmp_path,
        edges=["e1"],
        workers=["w1"],
        stream=StreamSettings(name="PASSED_INFER", answer_stream="PASSED_TOK"),
    )
    worker = permissions(minted.users["worker-w1"])
    assert "$JS.ACK.PASSED_INFER.>" in worker["pub"]
    assert "$JS.API.DIRECT.GET.PASSED_TOK" in worker["pub"]
    assert named(worker["pub"], "FROM_ENV") == []
    # Unset, the defaults' permissions are what they always were.
    monkeypatch.delenv("MESH_STREAM_NAME")
    default = permissions(mint(tmp_path / "d", edges=[], workers=["w1"]).users["worker-w1"])
    assert "$JS.ACK.MESH_INFER.>" in default["pub"]
    assert "$JS.API.DIRECT.GET.MESH_TOK" in default["pub"]


def _env(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)


async def test_a_mesh_on_renamed_streams_runs_under_its_minted_credentials(
    tmp_path: Path,
) -> None:
    """A worker, an edge and a client, each under its own credentials minted for the renamed
    streams, on a hub in operator mode: the worker provisions and serves the renamed queue, the
    answer comes back, and the server refuses nothing."""
    minted = mint(
        tmp_path,
        edges=["site-a"],
        workers=["w1"],
        expires_in=3600,
        stream=load_settings(environ=RENAMED).stream,
    )
    conf = tmp_path / "hub.conf"
    conf.write_text(
        f'port: -1\njetstream {{ store_dir: "{tmp_path / "js"}" }}\n'
        f'include "{minted.auth_conf.name}"\n'
    )
    async with NatsServer(config=str(conf)) as server:

        def settings(user: str) -> Any:
            env = _env(tmp_path / f"{user}.env")
            env.pop("MESH_NATS_HUB_DOMAIN", None)  # the edge runs on the hub itself
            return load_settings(
                environ={
                    **env,
                    **RENAMED,
                    "MESH_NATS_URL": server.url,
                    "MESH_NATS_REQUEST_TIMEOUT": "2",
                    "MESH_WORKER_MODEL_BACKEND": "deterministic",
                    "MESH_EDGE_MODEL_BACKEND": "deterministic",
                    "MESH_WORKER_FETCH_TIMEOUT": "0.5",
                    "MESH_EDGE_HTTP_PORT": "-1",
                }
            )

        worker, edge = settings("worker-w1"), settings("edge-site-a")
        async with contextlib.AsyncExitStack() as stack:
            wconn = await stack.enter_async_context(Connection(worker.nats, "w1"))
            await stack.enter_async_context(
                Worker(worker, wconn, DeterministicBackend(worker.worker.model))
            )
            econn = await stack.enter_async_context(Connection(edge.nats, "edge"))
            await stack.enter_async_context(
                EdgeNode(edge, econn, DeterministicBackend(edge.edge.model), HeuristicRouter())
            )
            async with MeshClient(settings=settings("client-site-a")) as client:
                answer = await client.complete("[tag:r] hi", route="cloud", max_tokens=12)
            assert answer.path == "cloud" and answer.end.served_by == "cloud:w1"
            assert answer.text == "".join(f" r{i}" for i in range(12))
            async with Connection(settings("operator").nats, "op") as op:
                streams = {s.config.name for s in await op.jsm().streams_info()}
        assert {"OTHER_INFER", "OTHER_TOK"} <= streams
        assert not streams & set(DEFAULTS)
        assert server.log_path is not None
        refused = [
            line
            for line in server.log_path.read_text().splitlines()
            if "Violation" in line and "Authorization Violation" not in line
        ]
        assert refused == []
