"""Deployment as a user does it (compose/, `mesh creds`, the docs' commands, the MESH_*
settings). Each test marked "Before the fix" failed on the code before it (review S17z); its
comment says what a user met then."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from mesh.config import load_settings
from mesh.connection import Connection
from mesh.hub import provision_hub
from mesh.nats_server import NatsServer, find_nats_server
from mesh.testing.chaos import MeshProcess, free_port, wait_for_worker
from protocol.errors import InvalidRequestError
from tests.conftest import make_settings
from tests.test_compose_nats import _deployment, _env
from tests.test_security import read_env

ROOT = Path(__file__).resolve().parent.parent
ENV = {k: v for k, v in os.environ.items() if not k.startswith("MESH_")}


# -- settings --------------------------------------------------------------------------------


# Before the fix (typed): a misspelt MESH_* variable is silently ignored. A user who writes
# MESH_WORKER_SLOTS=64 (for MESH_WORKER_MODEL_SLOTS) gets a 1-slot worker; MESH_NATS_CRED_FILE
# (for MESH_NATS_CREDS_FILE) connects without credentials; MESH_WORKER_METRIC_PORT leaves the
# metrics off, so Prometheus scrapes nothing; no word at start about any of them.
@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("MESH_WORKER_SLOTS", "64"),
        ("MESH_NATS_CRED_FILE", "/etc/mesh/creds/worker-gpu-1.creds"),
        ("MESH_WORKER_METRIC_PORT", "9464"),
        ("MESH_EDGE_HTTP_HOSTS", "0.0.0.0"),
    ],
)
def test_a_misspelt_mesh_setting_is_refused_naming_it(name: str, value: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        load_settings(environ={name: value})
    assert name in caught.value.message


# Before the fix (typed): the same, as a user meets it: `mesh status` with a misspelt
# credentials variable runs (unauthenticated, exit 0) instead of saying which name is unknown.
def test_mesh_status_with_a_misspelt_setting_says_so(nats_server: NatsServer) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "mesh_app.cli", "status"],
        env={
            **ENV,
            "PYTHONPATH": str(ROOT),
            "MESH_NATS_URL": nats_server.url,
            "MESH_NATS_CRED_FILE": "/etc/mesh/creds/operator.creds",
        },
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2, result.stdout
    assert "MESH_NATS_CRED_FILE" in result.stderr


# Before the fix (minor): docs/deployment.md lists MESH_STREAM_PLACEMENT_TAGS ("only servers
# carrying all these server_tags") with no format; the natural `MESH_STREAM_PLACEMENT_TAGS=zone-a`
# is refused with pydantic's "Input should be a valid list", which does not say to write a JSON
# list (["zone-a"]). Either take a comma-separated value or say how to write one.
@pytest.mark.parametrize(
    ("name", "value", "path"),
    [
        ("MESH_STREAM_PLACEMENT_TAGS", "zone-a", ("stream", "placement_tags")),
        ("MESH_EDGE_CLOUD_FALLBACKS", "qwen-small", ("edge", "cloud_fallbacks")),
    ],
)
def test_a_list_setting_from_a_plain_env_value(
    name: str, value: str, path: tuple[str, str]
) -> None:
    refused: InvalidRequestError | None = None
    try:
        settings = load_settings(environ={name: value})
    except InvalidRequestError as err:
        refused = err
    if refused is not None:
        assert "JSON" in refused.message or '["' in refused.message, refused.message
    else:
        assert getattr(getattr(settings, path[0]), path[1]) == [value]


# -- `mesh creds`: a site's leaf outside a container (docs/deployment.md, Jetson) --------------


# Before the fix (minor, deployment): docs/deployment.md's Jetson section says to run the site's
# leaf with `nats-server -c leaf-<edge>.conf`; the minted config always stores JetStream in
# /data/jetstream (mesh_app.creds.mint's leaf_store_dir, which no `mesh creds` option sets), so
# run by an ordinary user it dies at once: "Can't start JetStream: could not create storage
# directory - mkdir /data: permission denied".
def test_the_minted_leaf_config_starts_as_an_ordinary_user() -> None:
    from mesh_app.cli import main

    if Path("/data/jetstream").exists():
        pytest.skip("/data/jetstream exists on this machine")
    work = Path(tempfile.mkdtemp(prefix="s17z-leaf-"))
    try:
        work.chmod(0o755)
        out = work / "creds"
        argv = ["creds", "--out", str(out), "--edge", "jetson-1"]
        assert main([*argv, "--hub-leaf-url", f"nats-leaf://127.0.0.1:{free_port()}"]) == 0
        for path in [out, *out.iterdir()]:
            path.chmod(0o755 if path.is_dir() else 0o644)
        out.chmod(0o777)  # the leaf's user owns the files where it runs
        # As minted; only the client port moves off 4222, which this machine may be using.
        conf = out / "leaf-jetson-1.conf"
        conf.write_text(conf.read_text().replace("port: 4222", f"port: {free_port()}"))
        extra = {"user": 65534, "group": 65534} if os.geteuid() == 0 else {}
        proc = subprocess.Popen(
            [find_nats_server(), "-c", str(conf)],
            cwd=work,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            **extra,  # type: ignore[call-overload]
        )
        try:
            deadline = time.monotonic() + 10
            lines: list[str] = []
            assert proc.stdout is not None
            while time.monotonic() < deadline:
                line = proc.stdout.readline()
                if not line:
                    break  # it exited
                lines.append(line)
                if "Server is ready" in line:
                    break
            log = "".join(lines)
            assert "Server is ready" in log, log
        finally:
            if proc.poll() is None:
                proc.terminate()
            proc.wait(10)
    finally:
        shutil.rmtree(work, ignore_errors=True)


# -- `mesh provision` ------------------------------------------------------------------------


# Before the fix (minor): provisioning is not idempotent: every `mesh provision` and every
# worker's start updates MESH_ANSWERS and MESH_LEASES again ("updating stream" in the log, a
# STREAM.UPDATED advisory, a Raft round on a cluster), because the server reports an unset
# max_msgs / max_bytes as -1 and mesh.kept's configs leave them None (mesh.provision.ensure_config
# compares the two).
async def test_provisioning_twice_updates_nothing_the_second_time(own_server: NatsServer) -> None:
    settings = make_settings(own_server.url)
    async with Connection(settings.nats, "s17z-provision") as conn:
        events: list[str] = []

        async def seen(msg: object) -> None:
            events.append(msg.subject)  # type: ignore[attr-defined]

        sub = await conn.nc.subscribe("$JS.EVENT.ADVISORY.STREAM.*.>", cb=seen)
        await provision_hub(conn.jsm(), settings.stream, ["qwen"])
        deadline = time.monotonic() + 5
        while not any(".CREATED.MESH_ANSWERS" in s for s in events):
            assert time.monotonic() < deadline, events
            await asyncio.sleep(0.02)
        events.clear()
        await provision_hub(conn.jsm(), settings.stream, ["qwen"])
        await conn.nc.flush()
        await asyncio.sleep(1.0)  # advisories of the second pass, if any, have arrived
        await sub.unsubscribe()
    assert [s for s in events if ".UPDATED." in s] == []


# -- the compose deployment, as processes (hub.conf, the minted leaf, the .env files) ---------


def _mesh(*argv: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mesh_app.cli", *argv],
        env={**ENV, "PYTHONPATH": str(ROOT), **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


# Before the fix (minor): in the compose deployment the only credentials inside a container are
# the client's (`docker compose run --rm client ...`). `mesh status` run there read the site's
# own JetStream (the client's .env named no hub domain) and printed, with exit 0, "workers
# alive: 0 (slots 0, free 0)" and "queue: not provisioned" while a worker served. Now the
# client's .env names the hub's domain, and a status that can read neither the hub's registry
# nor its queue says so and exits 1.
async def test_mesh_status_at_a_site_does_not_report_a_serving_fleet_as_absent(
    tmp_path: Path,
) -> None:
    async with _deployment(tmp_path) as (hub, leaf, creds, _proxy):
        worker = MeshProcess(
            "worker",
            "cpu-1",
            _env(
                "worker-cpu",
                creds,
                MESH_NATS_URL=hub.url,
                MESH_WORKER_METRICS_PORT="-1",
                MESH_WORKER_MODEL_BACKEND="deterministic",
            ),
            tmp_path / "worker.log",
        )
        operator = load_settings(
            environ={**read_env(creds / "operator.env"), "MESH_NATS_URL": hub.url}
        )
        try:
            await worker.start()
            async with Connection(operator.nats, "operator") as op:
                await wait_for_worker(op, "cpu-1", timeout=30, process=worker)
            client_env = {**read_env(creds / "client-site1.env"), "MESH_NATS_URL": leaf.url}
            result = await asyncio.to_thread(_mesh, "status", "--json", env=client_env)
        finally:
            await worker.stop()
    if result.returncode == 0:
        status = json.loads(result.stdout)
        assert [w["node_id"] for w in status["workers"]] == ["cpu-1"], status
        assert status["queue"] is not None, status
    else:
        assert "hub" in result.stderr, result.stderr


# Before the fix (typed): the same client credentials asking the cloud directly
# (`mesh ask --via cloud --model qwen`, which docs/cli.md shows) got "unknown_model: no worker
# pool serves model 'qwen'" while the qwen pool served: they read the site's JetStream, not the
# hub's. Now they read the hub's (cannot tell: the request goes), and the queue's silence says
# these credentials may not queue there (ask through an edge).
async def test_ask_via_cloud_under_client_credentials_names_the_real_reason(
    tmp_path: Path,
) -> None:
    async with _deployment(tmp_path) as (hub, leaf, creds, _proxy):
        worker = MeshProcess(
            "worker",
            "cpu-1",
            _env(
                "worker-cpu",
                creds,
                MESH_NATS_URL=hub.url,
                MESH_WORKER_METRICS_PORT="-1",
                MESH_WORKER_MODEL_BACKEND="deterministic",
            ),
            tmp_path / "worker.log",
        )
        operator = load_settings(
            environ={**read_env(creds / "operator.env"), "MESH_NATS_URL": hub.url}
        )
        try:
            await worker.start()
            async with Connection(operator.nats, "operator") as op:
                await wait_for_worker(op, "cpu-1", timeout=30, process=worker)
            client_env = {**read_env(creds / "client-site1.env"), "MESH_NATS_URL": leaf.url}
            result = await asyncio.to_thread(
                _mesh,
                "ask",
                "--via",
                "cloud",
                "--model",
                "qwen",
                "--max-tokens",
                "4",
                "Hi",
                env=client_env,
            )
        finally:
            await worker.stop()
    assert result.returncode != 0  # these credentials may not queue: an error is right
    assert "unknown_model" not in result.stderr, result.stderr
    assert "these credentials may not queue there (ask through an edge)" in result.stderr
