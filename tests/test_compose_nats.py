"""The compose deployment, checked two ways:

- the compose file itself, validated by a real compose implementation (Debian's docker-compose)
  against credentials that `mesh creds` wrote, with each profile;
- the same topology as real processes without containers: the hub from compose/nats/hub.conf,
  the edge site's leaf from the config `mesh creds` wrote, `mesh worker` and `mesh edge` started
  with the .env files and the environment the compose file gives them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import socket
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
import yaml

from mesh.client import MeshClient
from mesh.config import load_settings
from mesh.connection import Connection
from mesh.nats_server import NatsServer, find_nats_server
from mesh.testing.chaos import MeshProcess, wait_for_edge, wait_for_worker
from mesh.testing.proxy import TcpProxy
from mesh_app.creds import mint
from protocol.subjects import orphan_subject, worker_alive_subject, worker_cancel_subject
from tests.helpers import eventually
from tests.test_security import read_env

COMPOSE = Path(__file__).resolve().parent.parent / "compose"
SERVICES = yaml.safe_load((COMPOSE / "docker-compose.yml").read_text())["services"]
CREDS = ["--edge", "site1", "--worker", "gpu-1", "--worker", "cpu-1"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _localize(conf: str, replacements: dict[str, str]) -> str:
    for old, new in replacements.items():
        assert old in conf, f"config no longer contains {old!r}"
        conf = conf.replace(old, new)
    return conf


def test_compose_file_is_valid_for_each_profile(tmp_path: Path) -> None:
    tool = shutil.which("docker-compose")
    if tool is None:
        pytest.skip("docker-compose is not installed (scripts/test.sh installs Debian's)")
    from mesh_app.cli import main

    copy = tmp_path / "compose"
    shutil.copytree(COMPOSE, copy, ignore=shutil.ignore_patterns("creds"))
    assert main(["creds", "--out", str(copy / "creds"), "--mount", "/etc/mesh/creds", *CREDS]) == 0
    for profile in ("gpu", "cpu", "tools"):
        result = subprocess.run(
            [tool, "-f", str(copy / "docker-compose.yml"), "--profile", profile, "config"],
            capture_output=True,
            text=True,
            check=False,
            timeout=60,
        )
        assert result.returncode == 0, result.stderr
        services = yaml.safe_load(result.stdout)["services"]
        assert {"nats-hub", "edge-nats", "edge"} <= set(services)
        assert {"gpu": "vllm", "cpu": "worker-cpu", "tools": "client"}[profile] in services
        # The .env files reach the services, with the paths the containers see.
        edge_env = services["edge"]["environment"]
        assert edge_env["MESH_NATS_CREDS_FILE"] == "/etc/mesh/creds/edge-site1.creds"
        assert edge_env["MESH_NATS_HUB_DOMAIN"] == "hub"


def test_compose_environment_names_real_settings() -> None:
    from mesh.config import describe_settings

    known = {env for env, _d, _doc in describe_settings()}
    for name, service in SERVICES.items():
        for var in service.get("environment", {}):
            if var.startswith("MESH_"):  # other images (Grafana...) have settings of their own
                assert var in known, f"{name}: {var} is not a mesh setting"
    assert (
        SERVICES["edge"]["environment"]["MESH_EDGE_CLOUD_MODEL"]
        == (SERVICES["worker-cpu"]["environment"]["MESH_WORKER_MODEL_NAME"])
    )
    assert SERVICES["worker"]["environment"]["MESH_WORKER_MODEL_BASE_URL"] == "http://vllm:8000/v1"


def _env(service: str, creds: Path, **overrides: str) -> dict[str, str]:
    """What the compose file gives ``service``: its env_file, then its environment."""
    env_file = SERVICES[service]["env_file"].replace("./creds", str(creds))
    return {**read_env(Path(env_file)), **SERVICES[service]["environment"], **overrides}


def _cpu_worker(creds: Path, hub: NatsServer, tmp_path: Path) -> MeshProcess:
    """The compose file's CPU worker, on the hub, as a process (not started)."""
    return MeshProcess(
        "worker",
        "cpu-1",
        _env("worker-cpu", creds, MESH_NATS_URL=hub.url, MESH_WORKER_METRICS_PORT="-1"),
        tmp_path / "worker.log",
    )


@contextlib.asynccontextmanager
async def _deployment(
    tmp_path: Path, *, uplink_proxy: bool = False
) -> AsyncIterator[tuple[NatsServer, NatsServer, Path, TcpProxy | None]]:
    """The hub from compose/nats/hub.conf and site1's leaf from the config `mesh creds` wrote;
    ``uplink_proxy``: the leaf dials the hub through a proxy that can be cut (what sits in front
    of a hub in a deployment: a load balancer, a NAT's public address)."""
    creds = tmp_path / "creds"
    leaf_port = _free_port()
    proxy = await TcpProxy(leaf_port).start() if uplink_proxy else None
    mint(
        creds,
        edges=["site1"],
        workers=["gpu-1", "cpu-1"],
        hub_leaf_url=f"nats-leaf://127.0.0.1:{proxy.port if proxy else leaf_port}",
        leaf_store_dir="/data/jetstream",  # as in compose's containers
    )
    hub_port, site_port = _free_port(), _free_port()
    hub_conf = tmp_path / "hub.conf"
    hub_conf.write_text(
        _localize(
            (COMPOSE / "nats/hub.conf").read_text(),
            {
                "port: 4222": f"port: {hub_port}",
                "http_port: 8222": "http_port: -1",
                "store_dir: /data/jetstream": f"store_dir: {tmp_path / 'hub'}",
                "port: 7422": f"port: {leaf_port}",
            },
        )
    )
    leaf_conf = tmp_path / "leaf.conf"
    leaf_conf.write_text(
        _localize(
            (creds / "leaf-site1.conf").read_text(),
            {
                "port: 4222": f"port: {site_port}",
                'store_dir: "/data/jetstream"': f'store_dir: "{tmp_path / "site"}"',
            },
        )
    )
    hub = await NatsServer(config=str(hub_conf), port=hub_port).start()
    leaf = await NatsServer(config=str(leaf_conf), port=site_port).start()
    try:
        await eventually(_seen(leaf, LINKED, 1), timeout=10, what="leaf node to connect to the hub")
        yield hub, leaf, creds, proxy
    finally:
        await leaf.stop()
        await hub.stop()
        if proxy is not None:
            await proxy.stop()


LINKED = "Leafnode connection created"
UNLINKED = "Leafnode connection closed"


def _leaf_log(leaf: NatsServer) -> str:
    assert leaf.log_path is not None
    return leaf.log_path.read_text()


def _seen(leaf: NatsServer, line: str, times: int) -> Callable[[], Awaitable[bool]]:
    """A check for :func:`eventually`: ``line`` is in the leaf's log at least ``times`` times."""

    async def check() -> bool:
        return _leaf_log(leaf).count(line) >= times

    return check


@pytest.fixture
async def deployed(tmp_path: Path) -> AsyncIterator[tuple[NatsServer, NatsServer, Path]]:
    async with _deployment(tmp_path) as (hub, leaf, creds, _proxy):
        yield hub, leaf, creds


def test_the_minted_leaf_config_passes_nats_servers_own_config_test(tmp_path: Path) -> None:
    """nats-server 2.15 refused the leaf config's `reconnect: 1` in its config test ("reconnect
    should be converted to a duration") and warned at start; the minted config passes."""
    mint(
        tmp_path / "creds",
        edges=["site1"],
        workers=[],
        hub_leaf_url="nats-leaf://127.0.0.1:7422",
        leaf_store_dir="/data/jetstream",  # as in compose's containers
    )
    conf = tmp_path / "leaf.conf"
    conf.write_text(
        _localize(
            (tmp_path / "creds" / "leaf-site1.conf").read_text(),
            {'store_dir: "/data/jetstream"': f'store_dir: "{tmp_path / "site"}"'},
        )
    )
    checked = subprocess.run(
        [find_nats_server(), "-c", str(conf), "-t"], check=False, capture_output=True, text=True
    )
    assert checked.returncode == 0, checked.stderr + checked.stdout


async def test_a_leaf_behind_a_proxy_redials_only_the_proxy(tmp_path: Path) -> None:
    """After its uplink drops, a site's leaf dials the hub again through the address it was
    given, not around it: the hub advertises no leafnode URLs of its own (``no_advertise``). A
    leaf that had gone around the proxy would keep its link when the proxy is cut for good."""
    async with _deployment(tmp_path, uplink_proxy=True) as (_hub, leaf, _creds, proxy):
        assert proxy is not None
        proxy.cut(1.5)  # the uplink drops; the leaf redials meanwhile
        await eventually(_seen(leaf, LINKED, 2), timeout=15, what="the leaf to relink")
        proxy.cut(3600)  # now only a link around the proxy would survive
        await eventually(
            _seen(leaf, UNLINKED, 2), timeout=10, what="the relinked leaf to lose its link"
        )


async def test_the_compose_topology_runs_as_processes(
    deployed: tuple[NatsServer, NatsServer, Path], tmp_path: Path
) -> None:
    hub, leaf, creds = deployed
    worker = _cpu_worker(creds, hub, tmp_path)
    edge = MeshProcess(
        "edge",
        "site1",
        _env("edge", creds, MESH_NATS_URL=leaf.url, MESH_EDGE_HTTP_PORT="-1"),
        tmp_path / "edge.log",
    )
    client_settings = load_settings(environ=_env("client", creds, MESH_NATS_URL=leaf.url))
    operator = load_settings(environ={**read_env(creds / "operator.env"), "MESH_NATS_URL": hub.url})
    try:
        await worker.start()
        await edge.start()
        async with Connection(operator.nats, "operator") as op:
            await wait_for_worker(op, "cpu-1", timeout=60)
        async with Connection(client_settings.nats, "probe") as probe:
            await wait_for_edge(probe, "site1", timeout=60)
        async with MeshClient(settings=client_settings) as client:
            await asyncio.sleep(0.5)  # the edge's registry view sees the worker's heartbeat
            cloud = await client.complete("Say hi.", route="cloud", max_tokens=8, temperature=0)
            local = await client.complete("Say hi.", route="local", max_tokens=8, temperature=0)
            held = await client.complete(
                "Say hi.", route="cloud", max_tokens=8, temperature=0, deferrable=True
            )
    finally:
        await edge.stop()
        await worker.stop()
    assert cloud.path == "cloud" and cloud.end.served_by == "cloud:cpu-1" and cloud.text.strip()
    assert local.path == "local" and local.end.served_by == "edge:site1"
    assert held.path == "cloud" and held.text == cloud.text  # greedy: the same answer


async def test_an_edge_site_reaches_the_workers_words_across_its_leaf_node(
    deployed: tuple[NatsServer, NatsServer, Path], tmp_path: Path
) -> None:
    """From a site's leaf node, under the edge's own credentials, the subjects a worker listens
    on for one request (are you there, a cancel addressed to it, a worker gone) reach the hub's
    worker. The hub passes a subscription's interest to a leaf only when the leaf's permissions
    match it, which ``*.*`` subscriptions never did: every one of these was "no responders"
    from a site before."""
    hub, leaf, creds = deployed
    worker = _cpu_worker(creds, hub, tmp_path)
    operator = load_settings(environ={**read_env(creds / "operator.env"), "MESH_NATS_URL": hub.url})
    edge = load_settings(environ={**read_env(creds / "edge-site1.env"), "MESH_NATS_URL": leaf.url})
    try:
        await worker.start()
        async with Connection(operator.nats, "operator") as op:
            await wait_for_worker(op, "cpu-1", timeout=60, process=worker)
        async with Connection(edge.nats, "edge") as conn:
            for subject in (
                worker_alive_subject("cpu-1", "site1", "r1"),
                worker_cancel_subject("cpu-1", "site1", "r1"),
                orphan_subject("site1", "r1"),
            ):
                reply = await conn.nc.request(subject, b"", timeout=5)
                answer = json.loads(reply.data)
                assert answer in ({"held": False}, {"verdict": "not started"}), (subject, answer)
    finally:
        await worker.stop()


def test_the_compose_file_publishes_what_has_no_login_on_this_host_only() -> None:
    """Before the fix: the hub's monitoring port (8222: every connection's address, user and
    subscriptions), Prometheus (9090) and Grafana (3000, anonymous viewers, the image's default
    admin password) were published on every interface of the host. What clients and leaf nodes
    need (4222, 7422) and the edge's HTTP API (8080, API keys) stay public."""
    published = {
        str(port).rsplit(":", 1)[-1]: str(port)
        for service in SERVICES.values()
        for port in service.get("ports", [])
    }
    for port in ("8222", "9090", "3000"):
        assert published[port].startswith("127.0.0.1:"), published[port]
    for port in ("4222", "7422", "8080"):
        assert not published[port].startswith("127.0.0.1:"), published[port]
