"""Each edge in its own lane: `mesh creds` permissions enforced by a real nats-server.

The hub runs in operator mode with the auth.conf that `mesh creds` writes; every process
connects with the .creds and .env minted for its role. Nothing here is mocked: what an edge,
a client or a worker may not do, the server refuses.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import nats
import nats.errors
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from cloud_node.worker import Worker
from edge_node.node import EdgeNode
from edge_node.router import HeuristicRouter
from mesh.answer_store import AnswerStore
from mesh.backends.deterministic import DeterministicBackend
from mesh.client import MeshClient
from mesh.config import MeshSettings, load_settings
from mesh.connection import Connection
from mesh.nats_server import NatsServer
from mesh_app.creds import Minted, mint
from protocol.errors import MeshError, UnauthorizedError
from protocol.subjects import token_subject
from tests.helpers import eventually

EDGES = ("site-a", "site-b")


TEST_ENV = {
    "MESH_NATS_CONNECT_TIMEOUT": "3",
    "MESH_NATS_REQUEST_TIMEOUT": "2",
    "MESH_WORKER_MODEL_BACKEND": "deterministic",
    "MESH_EDGE_MODEL_BACKEND": "deterministic",
    "MESH_WORKER_FETCH_TIMEOUT": "0.5",
    "MESH_EDGE_HTTP_PORT": "-1",
}
"""Short timeouts and the deterministic backend for every process these tests start."""


def read_env(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)


@dataclass
class Hub:
    server: NatsServer
    minted: Minted

    def settings(self, user: str, **env: str) -> MeshSettings:
        """A process's settings from the .env file minted for ``user``, as it would run."""
        minted_env = read_env(self.minted.out / f"{user}.env")
        minted_env.pop("MESH_NATS_HUB_DOMAIN", None)  # these edges run on the hub itself
        environ = {
            **minted_env,
            "MESH_NATS_URL": self.server.url,
            **TEST_ENV,
            **env,
        }
        return load_settings(environ=environ)

    def violations(self) -> list[str]:
        assert self.server.log_path is not None
        return [
            line
            for line in self.server.log_path.read_text().splitlines()
            if "Violation" in line and "Authorization Violation" not in line
        ]


def hub_conf(tmp: Path, minted: Minted) -> Path:
    conf = tmp / "hub.conf"
    conf.write_text(
        f'port: -1\njetstream {{ store_dir: "{tmp / "js"}" }}\ninclude "{minted.auth_conf.name}"\n'
    )
    # nats-server resolves include paths against the including file's directory.
    assert conf.parent == minted.auth_conf.parent
    return conf


@pytest.fixture
async def hub(tmp_path: Path) -> AsyncIterator[Hub]:
    minted = mint(
        tmp_path,
        edges=list(EDGES),
        workers=["w1", "w2"],
        clients=[("site-a", "kiosk")],
        expires_in=3600,
    )
    async with NatsServer(config=str(hub_conf(tmp_path, minted))) as server:
        yield Hub(server, minted)


class Denials:
    """A raw nats-py connection under some role's creds, recording the server's refusals."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.nc: Client | None = None

    async def connect(self, hub: Hub, user: str) -> Denials:
        env = read_env(hub.minted.out / f"{user}.env")

        async def on_error(exc: Exception) -> None:
            self.errors.append(str(exc))

        self.nc = await nats.connect(
            hub.server.url,
            user_credentials=env["MESH_NATS_CREDS_FILE"],
            inbox_prefix=env.get("MESH_NATS_INBOX_PREFIX", "_INBOX"),
            error_cb=on_error,
            allow_reconnect=False,
        )
        return self

    async def refused(self, what: str, subject: str) -> None:
        """Wait for the server's "Permissions Violation for <what> to <subject>" (nats-py
        lower-cases the whole message)."""
        expected = f'violation for {what} to "{subject}"'.lower()

        async def seen() -> bool:
            return any(expected in e.lower() for e in self.errors)

        await eventually(seen, timeout=5, what=f"server to refuse {what} {subject}")

    async def cannot_subscribe(self, subject: str) -> None:
        """Subscribe to ``subject`` and wait for the server to refuse it."""
        assert self.nc is not None
        await self.nc.subscribe(subject)
        await self.refused("Subscription", subject)

    async def close(self) -> None:
        if self.nc is not None:
            with contextlib.suppress(Exception):
                await self.nc.close()


@pytest.fixture
async def mesh(hub: Hub) -> AsyncIterator[Hub]:
    """A worker and two edges on the secured hub, each under its own minted identity."""
    worker_settings = hub.settings("worker-w1")
    edges = [hub.settings(f"edge-{e}") for e in EDGES]
    async with contextlib.AsyncExitStack() as stack:
        wconn = await stack.enter_async_context(Connection(worker_settings.nats, "w1"))
        backend = DeterministicBackend(worker_settings.worker.model)
        await stack.enter_async_context(Worker(worker_settings, wconn, backend))
        for settings in edges:
            econn = await stack.enter_async_context(Connection(settings.nats, "edge"))
            local = DeterministicBackend(settings.edge.model)
            await stack.enter_async_context(EdgeNode(settings, econn, local, HeuristicRouter()))
        yield hub


async def _ask(hub: Hub, edge: str, prompt: str, tokens: int = 40) -> str:
    settings = hub.settings(f"client-{edge}")
    async with MeshClient(settings=settings) as client:
        answer = await client.complete(prompt, route="cloud", max_tokens=tokens)
    assert answer.path == "cloud" and answer.end.served_by == "cloud:w1"
    return answer.text


async def test_edges_work_under_their_own_credentials_and_nothing_is_refused(mesh: Hub) -> None:
    texts = await asyncio.gather(
        _ask(mesh, "site-a", "[tag:a] hi", 30), _ask(mesh, "site-b", "[tag:b] hi", 30)
    )
    assert texts[0] == "".join(f" a{i}" for i in range(30))
    assert texts[1] == "".join(f" b{i}" for i in range(30))
    # Every call the edges, the clients and the worker made was within their permissions.
    assert mesh.violations() == []


async def test_edge_a_cannot_read_cancel_or_impersonate_edge_b(mesh: Hub) -> None:
    spy = await Denials().connect(mesh, "edge-site-a")
    try:
        assert spy.nc is not None
        seen: list[str] = []

        async def record(msg: Msg) -> None:
            seen.append(msg.subject)

        for subject in ("mesh.v1.tok.site-b.*", "mesh.v1.tok.>", "mesh.v1.ans.>", ">", "_INBOX.>"):
            await spy.nc.subscribe(subject, cb=record)
            await spy.refused("Subscription", subject)
        # B's request runs while A publishes cancels for every id it might guess, in B's scope.
        victim = asyncio.ensure_future(_ask(mesh, "site-b", "[tag:v] long", 200))
        for _ in range(20):
            await spy.nc.publish("mesh.v1.cancel.site-b.x", b"")
            await asyncio.sleep(0.01)
        await spy.refused("Publish", "mesh.v1.cancel.site-b.x")
        await spy.nc.publish("mesh.v1.worker.w1.cancel.site-b.x", b"")  # addressed, B's scope
        await spy.refused("Publish", "mesh.v1.worker.w1.cancel.site-b.x")
        # A cannot queue work as B (B's token subject would get the answer) ...
        await spy.nc.publish("mesh.v1.infer.smollm2.site-b", b'{"id": "fake", "prompt": "x"}')
        await spy.refused("Publish", "mesh.v1.infer.smollm2.site-b")
        # ... nor reach JetStream's API beyond its needs: no deletes, purges, direct gets.
        for api in (
            "$JS.API.STREAM.DELETE.MESH_INFER",
            "$JS.API.STREAM.PURGE.MESH_TOK",
            "$JS.API.DIRECT.GET.MESH_TOK",
            "$JS.API.STREAM.MSG.DELETE.MESH_INFER",
            "$JS.API.CONSUMER.CREATE.MESH_TOK.spy.mesh.v1.tok.site-b.*",
            # B's kept answers: neither B's collector consumer nor one of A's own over them.
            "$JS.API.CONSUMER.MSG.NEXT.MESH_ANSWERS.site_site-b",
            "$JS.hub.API.CONSUMER.MSG.NEXT.MESH_ANSWERS.site_site-b",
            "$JS.API.CONSUMER.CREATE.MESH_ANSWERS.site_site-a.mesh.v1.ans.site-b.*",
            "$JS.API.DIRECT.GET.MESH_ANSWERS.mesh.v1.ans.site-b.x",
        ):
            await spy.nc.publish(api, b"{}")
            await spy.refused("Publish", api)
        text = await victim
        assert text == "".join(f" v{i}" for i in range(200))  # whole, never cancelled
        assert seen == []  # not one of B's messages reached A
        # The streams are all still there.
        operator = mesh.settings("operator")
        async with Connection(operator.nats, "op") as op:
            names = {s.config.name for s in await op.jsm().streams_info()}
        assert {"MESH_INFER", "MESH_TOK"} <= names
        # The server logged each refusal (what the first test relies on, seeing none).
        assert any('"mesh.v1.tok.site-b.*"' in line for line in mesh.violations())
    finally:
        await spy.close()


async def test_edge_repairs_only_from_its_own_answers(mesh: Hub) -> None:
    text = await _ask(mesh, "site-a", "[tag:r] x", 12)
    settings = mesh.settings("edge-site-a")
    async with Connection(settings.nats, "reader") as conn:
        store = AnswerStore(conn, settings.stream)
        assert store.filtered  # least privilege: read through the workers, its own scope only
        # Its own answers: whatever the client's request id was, they are all under site-a.
        operator = mesh.settings("operator")
        async with Connection(operator.nats, "op") as op:
            info = await op.jsm().stream_info("MESH_TOK", subjects_filter="mesh.v1.tok.>")
        subjects = set((info.state.subjects or {}).keys())
        own = [s for s in subjects if s.startswith("mesh.v1.tok.site-a.")]
        assert own and all(s.split(".")[3] in EDGES for s in subjects)
        events = await store.replay(own[0])
        assert events and "".join(getattr(e, "text", "") for e in events) == text
        # Someone else's: the server refuses the reader before anything is read.
        with pytest.raises(MeshError):
            await store.replay(token_subject("site-b", "anything"), timeout=1.5)


async def test_worker_cannot_publish_outside_token_subjects(mesh: Hub) -> None:
    worker = await Denials().connect(mesh, "worker-w1")
    try:
        assert worker.nc is not None
        for subject in (
            "mesh.v1.infer.smollm2.site-a",
            "mesh.v1.edge.site-a.infer",
            "mesh.v1.cancel.site-a.x",
            "_INBOX.edge.site-a.x",
            "$JS.API.STREAM.DELETE.MESH_INFER",
            "$KV.mesh_nodes.worker.smollm2.w2",  # another worker's registry entry
        ):
            await worker.nc.publish(subject, b"{}")
            await worker.refused("Publish", subject)
        await worker.nc.publish("mesh.v1.tok.site-a.x", b"")  # where it does answer
        await worker.nc.flush()
        assert not any("mesh.v1.tok.site-a.x" in e for e in worker.errors)
    finally:
        await worker.close()


async def test_a_client_of_an_edge_may_only_call_that_edge(mesh: Hub) -> None:
    client = await Denials().connect(mesh, "client-site-a")
    try:
        assert client.nc is not None
        for subject in ("mesh.v1.edge.site-b.infer", "mesh.v1.infer.smollm2.site-a"):
            await client.nc.publish(subject, b"hi")
            await client.refused("Publish", subject)
    finally:
        await client.close()
    # An app minted on its own (--client site-a:kiosk) cannot read the other apps' replies.
    kiosk = await Denials().connect(mesh, "client-site-a-kiosk")
    try:
        await kiosk.cannot_subscribe("_INBOX.client.site-a-apps.>")
    finally:
        await kiosk.close()


async def test_wrong_expired_or_missing_credentials_fail_at_start_with_a_reason(
    hub: Hub, tmp_path: Path
) -> None:
    # Minted by another operator: the hub does not know its account.
    other = mint(tmp_path / "other", edges=["site-a"], workers=[])
    # Minted by this hub's keys, but already expired.
    expired = mint(hub.minted.out, edges=["old"], workers=[], expires_in=60, now=time.time() - 120)
    cases = {
        "wrong": {"MESH_NATS_CREDS_FILE": str(other.users["edge-site-a"])},
        "expired": {"MESH_NATS_CREDS_FILE": str(expired.users["edge-old"])},
        "missing file": {"MESH_NATS_CREDS_FILE": str(tmp_path / "nope.creds")},
        "none": {"MESH_NATS_CREDS_FILE": ""},
    }
    for name, env in cases.items():
        settings = hub.settings("edge-site-a", **env)
        if not env["MESH_NATS_CREDS_FILE"]:
            settings.nats.creds_file = None
        began = time.monotonic()
        with pytest.raises(UnauthorizedError) as excinfo:
            await Connection(settings.nats, name).connect()
        assert time.monotonic() - began < 5, name  # an answer, not a hang
        message = str(excinfo.value)
        expected = {
            "wrong": "refused this process's credentials",
            "expired": "expired at",
            "missing file": "cannot read NATS credentials",
            "none": "refused this process's credentials",
        }[name]
        assert expected in message, (name, message)


def test_minted_files_are_secret_and_the_auth_conf_names_no_seed(hub: Hub) -> None:
    out = hub.minted.out
    for path in [*hub.minted.users.values(), *(out / "keys").iterdir()]:
        assert path.stat().st_mode & 0o077 == 0, path  # readable by its owner only
    auth = hub.minted.auth_conf.read_text()
    seeds = [(out / "keys" / f"{k}.nk").read_text().strip() for k in ("operator", "account")]
    seeds += [
        p.read_text().split("USER NKEY SEED-----")[1].split()[0] for p in hub.minted.users.values()
    ]
    assert all(seed.startswith("S") and seed not in auth for seed in seeds)
    assert read_env(out / "edge-site-a.env")["MESH_NATS_SCOPE"] == "site-a"


def test_mesh_creds_command_writes_every_file_and_refuses_bad_ids(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from mesh_app.cli import main

    out = tmp_path / "creds"
    args = ["creds", "--out", str(out), "--edge", "jetson-1", "--worker", "gpu-1"]
    args += ["--client", "jetson-1:kiosk"]
    assert main([*args, "--expires-in", "30d", "--mount", "/etc/mesh"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert set(listed["creds"]) == {
        "operator",
        "edge-jetson-1",
        "client-jetson-1",
        "client-jetson-1-kiosk",
        "worker-gpu-1",
    }
    kiosk = read_env(out / "client-jetson-1-kiosk.env")
    assert kiosk["MESH_NATS_INBOX_PREFIX"] == "_INBOX.client.kiosk"
    assert all(Path(p).exists() for p in listed["creds"].values())
    env = read_env(out / "worker-gpu-1.env")
    assert env["MESH_NATS_CREDS_FILE"] == "/etc/mesh/worker-gpu-1.creds"
    assert env["MESH_WORKER_NODE_ID"] == "gpu-1" and env["MESH_NATS_LEAST_PRIVILEGE"] == "true"
    load_settings(environ=env)  # every variable written is a valid setting
    from mesh.credentials import check_creds_file

    claims = check_creds_file(listed["creds"]["edge-jetson-1"])
    assert 29 * 86400 < claims["exp"] - time.time() <= 30 * 86400
    assert main(["creds", "--out", str(tmp_path / "x"), "--edge", "a.b"]) == 2
    assert "not a valid edge, worker or app id" in capsys.readouterr().err
    assert main([*args[:3], "--expires-in", "soon"]) == 2
    assert main(["creds", "--out", str(tmp_path / "y"), "--edge", "a", "--client", "b:x"]) == 2
    assert "not among --edge" in capsys.readouterr().err
    # An app named as the site's shared apps user would share its inbox prefix (review S17b).
    assert main(["creds", "--out", str(tmp_path / "z"), "--edge", "a", "--client", "a:a-apps"]) == 2
    assert "shared apps user" in capsys.readouterr().err


@dataclass
class Certs:
    ca: Path
    cert: Path
    key: Path
    other_ca: Path


@pytest.fixture
def certs(tmp_path: Path) -> Certs:
    """A test CA and a server certificate for 127.0.0.1, made now (trustme), plus an unrelated
    CA a client might wrongly trust."""
    import trustme

    ca, other = trustme.CA(), trustme.CA()
    issued = ca.issue_cert("127.0.0.1", "localhost")
    paths = Certs(
        tmp_path / "ca.pem", tmp_path / "server.pem", tmp_path / "server.key", tmp_path / "x.pem"
    )
    ca.cert_pem.write_to_path(str(paths.ca))
    other.cert_pem.write_to_path(str(paths.other_ca))
    issued.cert_chain_pems[0].write_to_path(str(paths.cert))
    issued.private_key_pem.write_to_path(str(paths.key))
    return paths


async def test_tls_client_connections_with_credentials(tmp_path: Path, certs: Certs) -> None:
    minted = mint(tmp_path, edges=["site-a"], workers=["w1"])
    conf = hub_conf(tmp_path, minted)
    conf.write_text(
        conf.read_text()
        + f'tls {{ cert_file: "{certs.cert}"\n key_file: "{certs.key}"\n timeout: 2 }}\n'
    )
    async with NatsServer(config=str(conf)) as server:
        hub = Hub(server, minted)
        worker_settings = hub.settings("worker-w1", MESH_NATS_TLS_CA_FILE=str(certs.ca))
        edge_settings = hub.settings("edge-site-a", MESH_NATS_TLS_CA_FILE=str(certs.ca))
        client_settings = hub.settings("client-site-a", MESH_NATS_TLS_CA_FILE=str(certs.ca))
        async with contextlib.AsyncExitStack() as stack:
            wconn = await stack.enter_async_context(Connection(worker_settings.nats, "w1"))
            assert wconn.nc.connected_url is not None
            backend = DeterministicBackend(worker_settings.worker.model)
            await stack.enter_async_context(Worker(worker_settings, wconn, backend))
            econn = await stack.enter_async_context(Connection(edge_settings.nats, "edge"))
            local = DeterministicBackend(edge_settings.edge.model)
            await stack.enter_async_context(
                EdgeNode(edge_settings, econn, local, HeuristicRouter())
            )
            async with MeshClient(settings=client_settings) as client:
                answer = await client.complete("[tag:s] hi", route="cloud", max_tokens=20)
            assert answer.text == "".join(f" s{i}" for i in range(20))
            writer = econn.nc._transport._io_writer  # type: ignore[union-attr]
            assert writer.get_extra_info("ssl_object") is not None  # the link is TLS
        # A client trusting another CA is refused at start, with the reason, not a hang.
        wrong = hub.settings("edge-site-a", MESH_NATS_TLS_CA_FILE=str(certs.other_ca))
        began = time.monotonic()
        with pytest.raises(MeshError) as excinfo:
            await Connection(wrong.nats, "wrong-ca").connect()
        assert time.monotonic() - began < 5
        assert "TLS" in str(excinfo.value) or "certificate" in str(excinfo.value).lower()
        assert hub.violations() == []


@pytest.mark.chaos
async def test_a_killed_workers_answer_continues_at_once_under_credentials(
    hub: Hub, tmp_path: Path
) -> None:
    """The fast takeover works within the roles' permissions: the edge asks the dead worker,
    then the live ones (its own scope only), and a live worker hands the delivery back; nothing
    is refused. ack_wait is 30 s, so only that path explains a continuation within seconds."""
    from mesh.testing.chaos import MeshProcess, wait_for_worker

    slow = {"MESH_STREAM_ACK_WAIT": "30", "MESH_WORKER_MODEL_TOKEN_DELAY_MS": "20"}
    doomed_env = {
        **read_env(hub.minted.out / "worker-w1.env"),
        **TEST_ENV,
        **slow,
        "MESH_NATS_URL": hub.server.url,
    }
    doomed = MeshProcess("worker", "w1", doomed_env, tmp_path / "w1.log")
    edge_settings = hub.settings("edge-site-a", **slow)
    async with contextlib.AsyncExitStack() as stack:
        await doomed.start()
        stack.push_async_callback(doomed.stop)
        econn = await stack.enter_async_context(Connection(edge_settings.nats, "edge"))
        await wait_for_worker(econn, "w1", process=doomed)
        local = DeterministicBackend(edge_settings.edge.model)
        await stack.enter_async_context(EdgeNode(edge_settings, econn, local, HeuristicRouter()))
        client = await stack.enter_async_context(MeshClient(settings=hub.settings("client-site-a")))
        first: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        texts: list[str] = []

        async def read() -> object:
            async for event in client.stream("[tag:k] go", route="cloud", max_tokens=80):
                text = getattr(event, "text", None)
                if text is not None:
                    texts.append(text)
                    if not first.done():
                        first.set_result(None)
                last = event
            return last

        answer = asyncio.ensure_future(read())
        await asyncio.wait_for(first, 20)
        w2_settings = hub.settings("worker-w2", **slow)
        w2conn = await stack.enter_async_context(Connection(w2_settings.nats, "w2"))
        w2 = await stack.enter_async_context(
            Worker(w2_settings, w2conn, DeterministicBackend(w2_settings.worker.model))
        )
        killed = time.monotonic()
        doomed.kill()
        end = await asyncio.wait_for(answer, 20)
        took = time.monotonic() - killed
        assert "".join(texts) == "".join(f" k{i}" for i in range(80))
        assert getattr(end, "served_by", "") == "cloud:w2"
        assert took < 10, f"the answer ended {took:.1f}s after the kill (ack_wait is 30 s)"
        assert w2.orphans.handed_back == 1
    assert hub.violations() == []
