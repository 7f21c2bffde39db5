"""An edge site as deployed: its own leaf-node nats-server dialling the hub over TLS with the
edge's credentials (the configs `mesh creds` writes), the edge daemon and its apps on the leaf,
the worker on the hub. Real nats-server processes, no mocks."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from nats.aio.msg import Msg

from cloud_node.worker import Worker
from edge_node.api_keys import parse_keys
from edge_node.node import EdgeNode
from edge_node.router import HeuristicRouter
from mesh import kept
from mesh.backends.deterministic import DeterministicBackend
from mesh.client import Completion, MeshClient
from mesh.config import MeshSettings, load_settings
from mesh.connection import Connection
from mesh.nats_server import NatsServer
from mesh.queue import MSG_ID_HEADER
from mesh.testing.chaos import expected_text, paused
from mesh.testing.proxy import TcpProxy
from mesh_app.creds import Minted, mint
from protocol.codec import WireFormat, dump
from protocol.errors import (
    DuplicateRequestError,
    MeshError,
    PayloadTooLargeError,
    UnavailableError,
)
from protocol.messages import Answer
from protocol.subjects import (
    CLAIMS_STREAM,
    KEPT_STREAM,
    claim_subject,
    edge_answer_subject,
    infer_subject,
    kept_subject,
    token_subject,
)
from tests.helpers import eventually
from tests.test_security import TEST_ENV, Certs, certs, read_env  # noqa: F401 - certs is a fixture

SITES = ("site-a", "site-b")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Topology:
    tmp: Path
    minted: Minted
    certs: Certs
    hub: NatsServer
    leaf_port: int
    leaves: dict[str, NatsServer] = field(default_factory=dict)
    uplinks: dict[str, TcpProxy] = field(default_factory=dict)
    edges: dict[str, EdgeNode] = field(default_factory=dict)
    backend: DeterministicBackend | None = None

    def hub_settings(self, user: str, **extra: str) -> MeshSettings:
        env = read_env(self.minted.out / f"{user}.env")
        return _settings(env, self.hub.url, MESH_NATS_TLS_CA_FILE=str(self.certs.ca), **extra)

    def site_settings(self, site: str, user: str = "edge") -> MeshSettings:
        """A process at the site, on the leaf, with its minted .env (the leaf carries the hub
        credentials; it has no auth of its own)."""
        env = read_env(self.minted.out / f"{user}-{site}.env")
        # The minted .env as it is: a leaf without auth of its own ignores the credentials.
        return _settings(env, self.leaves[site].url)

    async def start_leaf(self, site: str, *, cuttable: bool = False) -> NatsServer:
        """Start the site's leaf from its minted config; ``cuttable``: through a proxy whose
        cut stands for the uplink going down."""
        port = free_port()
        conf = self.tmp / f"leaf-{site}.local.conf"
        text = (
            self.minted.leaf_confs[site]
            .read_text()
            .replace("port: 4222", f"port: {port}")
            .replace('store_dir: "/data/jetstream"', f'store_dir: "{self.tmp / site}"')
        )
        if cuttable:
            proxy = await TcpProxy(self.leaf_port).start()
            self.uplinks[site] = proxy
            text = text.replace(f"127.0.0.1:{self.leaf_port}", f"127.0.0.1:{proxy.port}")
        conf.write_text(text)
        leaf = await NatsServer(config=str(conf), port=port).start()
        self.leaves[site] = leaf
        assert leaf.log_path is not None
        log_path = leaf.log_path

        async def linked() -> bool:
            return "Leafnode connection created" in log_path.read_text()

        await eventually(linked, timeout=10, what=f"leaf {site} to connect to the hub")
        return leaf


def _settings(env: dict[str, str], url: str, **extra: str) -> MeshSettings:
    return load_settings(
        environ={
            **env,
            "MESH_NATS_URL": url,
            **TEST_ENV,
            **extra,
        }
    )


@pytest.fixture
async def topology(tmp_path: Path, certs: Certs) -> AsyncIterator[Topology]:  # noqa: F811
    leaf_port = free_port()
    minted = mint(
        tmp_path,
        edges=list(SITES),
        workers=["w1"],
        clients=[("site-a", "kiosk")],
        hub_leaf_url=f"nats-leaf://127.0.0.1:{leaf_port}",
        leaf_tls_ca=str(certs.ca),
        leaf_store_dir="/data/jetstream",  # replaced per site below
    )
    tls = f'tls {{ cert_file: "{certs.cert}"\n key_file: "{certs.key}"\n timeout: 2 }}'
    hub_conf = tmp_path / "hub.conf"
    hub_conf.write_text(
        f'port: -1\njetstream {{ store_dir: "{tmp_path / "hub-js"}", domain: hub }}\n'
        f'include "{minted.auth_conf.name}"\n{tls}\n'
        # As compose's hub.conf: a leaf redials the URL it was given (the uplink's proxy), never
        # an address the hub advertises (review S27d: redials wasted, relinks 1.2-1.9 s late).
        f"leafnodes {{ port: {leaf_port}\n no_advertise: true\n {tls} }}\n"
    )
    async with NatsServer(config=str(hub_conf)) as hub:
        topo = Topology(tmp_path, minted, certs, hub, leaf_port)
        try:
            for site in SITES:
                await topo.start_leaf(site, cuttable=site == "site-a")
            yield topo
        finally:
            for leaf in topo.leaves.values():
                await leaf.stop()
            for proxy in topo.uplinks.values():
                await proxy.stop()


@contextlib.asynccontextmanager
async def running_mesh(
    topo: Topology, *, http: bool = False, edge_timeout: float | None = None
) -> AsyncIterator[None]:
    # A one-slot worker taking 150 ms per answer: answers keep landing for a while.
    worker_settings = topo.hub_settings("worker-w1", MESH_WORKER_MODEL_PREFILL_DELAY_MS="150")
    async with contextlib.AsyncExitStack() as stack:
        wconn = await stack.enter_async_context(Connection(worker_settings.nats, "w1"))
        backend = DeterministicBackend(worker_settings.worker.model)
        topo.backend = backend
        await stack.enter_async_context(Worker(worker_settings, wconn, backend))
        for site in topo.leaves:
            settings = topo.site_settings(site)
            if http:
                settings.edge.http_port = 0
            if edge_timeout is not None:  # a request without a deadline of its own gets this
                settings.edge.request_timeout = edge_timeout
            econn = await stack.enter_async_context(Connection(settings.nats, f"edge-{site}"))
            local = DeterministicBackend(settings.edge.model)
            topo.edges[site] = await stack.enter_async_context(
                EdgeNode(settings, econn, local, HeuristicRouter())
            )
        yield


@contextlib.asynccontextmanager
async def site_edge_and_worker(
    topo: Topology, site: str, *, token_delay_ms: int, edge_via: TcpProxy | None = None
) -> AsyncIterator[tuple[DeterministicBackend, EdgeNode, MeshClient]]:
    """A hub worker (``token_delay_ms`` a token), ``site``'s edge on its leaf once it sees the
    worker (linked through ``edge_via``, a proxy to the leaf, if given), and a client of that
    edge."""
    worker_settings = topo.hub_settings(
        "worker-w1", MESH_WORKER_MODEL_TOKEN_DELAY_MS=str(token_delay_ms)
    )
    async with contextlib.AsyncExitStack() as stack:
        wconn = await stack.enter_async_context(Connection(worker_settings.nats, "w1"))
        backend = DeterministicBackend(worker_settings.worker.model)
        await stack.enter_async_context(Worker(worker_settings, wconn, backend))
        settings = topo.site_settings(site)
        if edge_via is not None:
            settings.nats.url = edge_via.url
        econn = await stack.enter_async_context(Connection(settings.nats, f"edge-{site}"))
        local = DeterministicBackend(settings.edge.model)
        edge = await stack.enter_async_context(EdgeNode(settings, econn, local, HeuristicRouter()))
        model = settings.edge.cloud_model

        async def seen() -> bool:
            return edge.nodes.serves(model) is True

        await eventually(seen, what="the worker seen")
        client = await stack.enter_async_context(
            MeshClient(
                settings=topo.site_settings(site, "client"), first_event_timeout=30, idle_timeout=30
            )
        )
        yield backend, edge, client


async def test_edges_on_their_leaf_nodes_escalate_to_the_hub_over_tls(topology: Topology) -> None:
    async with running_mesh(topology):
        # Someone at site B listens to every mesh subject on B's leaf, while A's answer streams.
        spy_settings = topology.site_settings("site-b")
        seen: list[str] = []

        async def record(msg: Msg) -> None:
            seen.append(msg.subject)

        async with Connection(spy_settings.nats, "spy") as spy:
            await spy.nc.subscribe("mesh.v1.tok.>", cb=record)
            await spy.nc.subscribe("_INBOX.>", cb=record)
            answers = []
            for site, tag in (("site-a", "a"), ("site-b", "b")):
                async with MeshClient(settings=topology.site_settings(site, "client")) as client:
                    answers.append(
                        await client.complete(f"[tag:{tag}] hi", route="cloud", max_tokens=25)
                    )
        for answer, tag in zip(answers, "ab", strict=True):
            assert answer.path == "cloud" and answer.end.served_by == "cloud:w1"
            assert answer.text == expected_text(tag, 25)
        # B's own answer reached B's leaf; nothing of A's ever crossed into it.
        assert any(s.startswith("mesh.v1.tok.site-b.") for s in seen)
        assert not any("site-a" in s for s in seen)


@pytest.mark.chaos
async def test_an_offline_site_holds_requests_that_can_wait_and_loses_none(
    topology: Topology,
) -> None:
    site = "site-a"
    uplink = topology.uplinks[site]
    async with running_mesh(topology):
        edge = topology.edges[site]
        assert edge.site is not None and topology.backend is not None
        async with MeshClient(settings=topology.site_settings(site, "client")) as client:
            # Link up: a request that can wait is answered through the cloud, and kept.
            first = await client.complete(
                "[tag:w] x", route="cloud", max_tokens=12, deferrable=True, request_id="warm-1"
            )
            assert first.path == "cloud" and first.text == expected_text("w", 12)
            assert (await client.answer("warm-1")).text == expected_text("w", 12)

            # The uplink goes down.
            uplink.cut(3600)

            async def no_live_worker() -> bool:
                return edge.nodes.serves("smollm2") is False

            await eventually(no_live_worker, timeout=15, what="the edge to see the cloud gone")
            # Interactive: answered locally at once, saying why.
            local = await client.complete("[tag:i] x", route="cloud", max_tokens=6)
            assert local.path == "local" and local.end.fallback, local.end
            assert "worker" in local.end.fallback

            # Requests that can wait are held at the site, in the order they came.
            ids = [f"held-{i}" for i in range(10)]
            waits = []
            for i, rid in enumerate(ids):
                waits.append(
                    asyncio.ensure_future(
                        client.complete(
                            f"[tag:h{i}] x",
                            route="cloud",
                            max_tokens=20,
                            deferrable=True,
                            request_id=rid,
                            deadline=time.time() + 3600,
                        )
                    )
                )
                await eventually(
                    functools.partial(_held, edge, i + 1), timeout=10, what=f"{i + 1} held"
                )
            assert edge.site.links.forwarded == 1  # only the warm-up went out
            started_before = topology.backend.started

            # The uplink comes back: everything held flows to the hub, in order.
            uplink.restore()
            await eventually(lambda: _forwarded(edge, 11), timeout=30, what="held forwarded")
            assert list(edge.site.links.forward_order)[1:] == ids
            # ... and the link drops again at once, while the worker is still answering: those
            # answers wait on the hub, and the site collects them when the link returns.
            uplink.cut(2)
            collected_in_outage = edge.site.links.collected
            answers = await asyncio.wait_for(asyncio.gather(*waits), timeout=60)
            for i, answer in enumerate(answers):
                assert answer.path == "cloud" and answer.text == expected_text(f"h{i}", 20)
            assert collected_in_outage < len(ids)  # the flap did fall mid-way
            # Asked again by id, each answer comes from the site's own store.
            for i, rid in enumerate(ids):
                assert (await client.answer(rid)).text == expected_text(f"h{i}", 20)
        generated = topology.backend.started - started_before
        print(
            f"\nheld 10, forwarded {edge.site.links.forwarded - 1}, answered {len(answers)}, "
            f"generated {generated}, lost 0, duplicated {generated - len(ids)}"
        )
        assert generated == len(ids)  # no request was generated twice


async def _held(edge: EdgeNode, n: int) -> bool:
    assert edge.site is not None
    return await edge.site.held() >= n


async def _forwarded(edge: EdgeNode, n: int) -> bool:
    assert edge.site is not None
    return edge.site.links.forwarded >= n


@pytest.mark.chaos
async def test_held_requests_survive_an_edge_restart_and_a_reused_id_gets_no_foreign_answer(
    topology: Topology,
) -> None:
    site = "site-a"
    uplink = topology.uplinks[site]
    async with running_mesh(topology):
        edge = topology.edges[site]

        async def cloud_gone() -> bool:
            return edge.nodes.serves("smollm2") is False

        uplink.cut(3600)
        await eventually(cloud_gone, timeout=15, what="the edge to see the cloud gone")
        settings = topology.site_settings(site, "client")
        async with MeshClient(settings=settings) as first, MeshClient(settings=settings) as other:

            def ask(client: MeshClient, name: str) -> asyncio.Future[Completion]:
                return asyncio.ensure_future(
                    client.complete(
                        f"[tag:{name}] x",
                        route="cloud",
                        max_tokens=10,
                        deferrable=True,
                        request_id="shared-id",
                        deadline=time.time() + 3600,
                    )
                )

            asks = {"first": ask(first, "first")}
            await eventually(functools.partial(_held, edge, 1), timeout=10, what="first held")
            asks["other"] = ask(other, "other")
            await eventually(functools.partial(_held, edge, 2), timeout=10, what="other held")
            uplink.restore()
            done = await asyncio.wait_for(
                asyncio.gather(*asks.values(), return_exceptions=True), timeout=60
            )
            results = dict(zip(asks, done, strict=True))
            # The first gets its answer; the other, under the same id with other content, a
            # typed duplicate error: never the first one's answer.
            first_answer = results["first"]
            assert not isinstance(first_answer, BaseException), first_answer
            assert first_answer.text == expected_text("first", 10)
            assert isinstance(results["other"], DuplicateRequestError), results["other"]
            assert (await first.answer("shared-id")).text == expected_text("first", 10)

        # Held while the edge daemon restarts: the site's streams keep it.
        uplink.cut(3600)
        await eventually(cloud_gone, timeout=15, what="the edge to see the cloud gone")
        async with MeshClient(settings=settings) as client:
            waiting = asyncio.ensure_future(
                client.complete(
                    "[tag:r] x",
                    route="cloud",
                    max_tokens=10,
                    deferrable=True,
                    request_id="across-restart",
                    deadline=time.time() + 3600,
                )
            )
            await eventually(functools.partial(_held, edge, 1), timeout=10, what="held")
            stopping = time.monotonic()
            await edge.stop()  # its default grace: the held request is safe in the outbox
            stopped_in = time.monotonic() - stopping
            print(f"edge stopped in {stopped_in:.2f}s with its uplink down and a request held")
            assert stopped_in < 5.0  # 20 s before: 10 s grace for answers that could not come
            with pytest.raises(MeshError):
                await waiting  # the daemon went away: a typed error, the request still held
            restarted = EdgeNode(
                topology.site_settings(site), edge.conn, edge.backend, HeuristicRouter()
            )
            await restarted.start()
            try:
                uplink.restore()

                async def answered() -> bool:
                    return await restarted.site.kept("across-restart") is not None  # type: ignore[union-attr]

                await eventually(answered, timeout=30, what="the held request to be answered")
                assert (await client.answer("across-restart")).text == expected_text("r", 10)
            finally:
                await restarted.stop(grace=0.5)


async def test_a_request_the_hub_refuses_for_good_gets_a_typed_error_and_blocks_nothing(
    topology: Topology,
) -> None:
    site = "site-a"
    async with running_mesh(topology):
        operator = topology.hub_settings("operator")
        async with Connection(operator.nats, "op") as op:
            config = (await op.jsm().stream_info("MESH_INFER")).config
            config.max_msg_size = 2048  # the hub refuses bigger requests, for good
            await op.jsm().update_stream(config)
        async with MeshClient(settings=topology.site_settings(site, "client")) as client:
            too_big = asyncio.ensure_future(
                client.complete(
                    "[tag:z] " + "x" * 4000,
                    route="cloud",
                    max_tokens=5,
                    deferrable=True,
                    request_id="too-big",
                )
            )
            after = await client.complete(
                "[tag:n] x", route="cloud", max_tokens=5, deferrable=True, request_id="next"
            )
            assert after.text == expected_text("n", 5)  # held behind it, forwarded all the same
            with pytest.raises(PayloadTooLargeError, match="refused") as refused:
                await too_big
            assert refused.value.retryable is False  # it was a retryable unavailable
            with pytest.raises(PayloadTooLargeError, match="refused"):
                await client.answer("too-big")  # asked again: the same typed error


async def test_an_answer_too_large_to_keep_is_kept_as_its_typed_error(
    topology: Topology,
) -> None:
    """A whole answer larger than one message of the hub (1 MiB) cannot be kept: each keep
    failed and handed the request back, until JetStream gave up on it and the keep failed
    there too. The client heard nothing but its deadline, then "not yet" for ever."""
    big = "x" * 300  # 4,096 tokens of over 300 bytes: about 1.3 MB
    async with site_edge_and_worker(topology, "site-b", token_delay_ms=0) as (backend, _e, client):
        began = time.monotonic()
        with pytest.raises(PayloadTooLargeError, match="streamed, not deferred"):
            await client.complete(
                f"[tag:{big}] go", route="cloud", max_tokens=4096, deferrable=True, request_id="big"
            )
        assert time.monotonic() - began < 15
        with pytest.raises(PayloadTooLargeError):
            await client.answer("big")  # asked again: the same typed error
        assert backend.started == 1, "generated once, not once per delivery"


async def test_a_kept_answer_too_large_as_json_is_a_typed_error_to_a_json_ask(
    topology: Topology,
) -> None:
    """A site keeps answers in msgpack; the ``answer`` endpoint replies in the ask's format.
    JSON escapes quotes and line ends: an answer that fit as msgpack could not go as one JSON
    message, and the asker heard nothing until its timeout. The SDK asks in msgpack."""
    text = '{"k": "v"}\n' * 80_000  # 880 kB of JSON lines: 1.28 MB as a JSON string
    answer = Answer(id="big-json", text=text)
    site = "site-b"
    async with site_edge_and_worker(topology, site, token_delay_ms=0) as (_b, edge, client):
        limit = edge.conn.nc.max_payload
        assert len(dump(answer, WireFormat.MSGPACK)) < limit < len(dump(answer, WireFormat.JSON))
        async with Connection(topology.site_settings(site).nats, "planting") as leaf:
            await leaf.publish_acked(  # held without a key: anyone at the site may ask
                claim_subject("big-json"),
                json.dumps({"fp": "f", "key": None}).encode(),
                stream=CLAIMS_STREAM,
            )
            await leaf.publish_acked(
                kept_subject("big-json"),
                dump(answer, WireFormat.MSGPACK),
                stream=KEPT_STREAM,
                headers={MSG_ID_HEADER: "big-json", kept.FINGERPRINT_HEADER: "f"},
            )
            asked = json.dumps({"id": "big-json"}).encode()  # as `nats req` sends it
            reply = await leaf.nc.request(edge_answer_subject(edge.edge_id), asked, timeout=5)
        event = json.loads(reply.data)
        assert event["t"] == "err" and event["code"] == "payload_too_large", event
        assert "msgpack" in event["message"]
        kept_answer = await client.answer("big-json")
        assert kept_answer.text == text


async def test_a_foreign_message_in_the_outbox_holds_up_nothing(topology: Topology) -> None:
    """Anyone on a site's leaf may publish into its outbox (the leaf asks no credentials of its
    own). A message under another site's scope is one the hub never takes from this edge: the
    forwarder, one request at a time, tried it for ever, and every request held after it
    waited behind it."""
    site = "site-a"
    async with site_edge_and_worker(topology, site, token_delay_ms=0) as (_b, edge, client):
        model = edge.settings.edge.cloud_model
        async with Connection(topology.site_settings(site).nats, "someone") as someone:
            await someone.nc.publish(
                f"mesh.v1.outbox.{model}.site-b", b"\x81\xa1x\x01", headers={"Mesh-Id": "evil-1"}
            )
            await someone.nc.flush()
        began = time.monotonic()
        answer = await client.complete(
            "[tag:v] x", route="cloud", max_tokens=5, deferrable=True, request_id="victim-1"
        )
        assert answer.text == expected_text("v", 5)
        assert time.monotonic() - began < 10


async def test_a_slow_ask_for_a_kept_answer_holds_up_no_other(topology: Topology) -> None:
    """The answer endpoint's callbacks run one at a time: an ask whose read of the site's store
    was slow (its JetStream busy) held every ask after it, for up to the read's timeout each."""
    site = "site-a"
    async with site_edge_and_worker(topology, site, token_delay_ms=0) as (_b, edge, client):
        assert edge.site is not None
        fetch = edge.site.fetch

        async def slow_for_one(request_id: str, key: str | None) -> object:
            if request_id == "slow-1":
                await asyncio.sleep(1.5)  # within the ask's own timeout
            return await fetch(request_id, key)

        edge.site.fetch = slow_for_one  # type: ignore[method-assign]
        slow = asyncio.ensure_future(client.answer("slow-1"))
        await asyncio.sleep(0.1)  # asked first
        began = time.monotonic()
        with pytest.raises(UnavailableError, match="no answer kept"):
            await client.answer("fast-1")
        assert time.monotonic() - began < 1.0
        with pytest.raises(UnavailableError, match="no answer kept"):
            await slow


async def test_an_ask_for_a_kept_answer_that_fails_is_answered_typed(topology: Topology) -> None:
    """An ask whose handling failed unexpectedly (a bug; a site store holding what it should
    not) is answered ``internal``, not left to its asker's timeout."""
    site = "site-a"
    async with site_edge_and_worker(topology, site, token_delay_ms=0) as (_b, edge, client):
        assert edge.site is not None

        async def broken(request_id: str, key: str | None) -> object:
            raise AttributeError("'list' object has no attribute 'get' (scripted)")

        edge.site.fetch = broken  # type: ignore[method-assign]
        began = time.monotonic()
        with pytest.raises(MeshError) as failed:
            await client.answer("any-1")
        assert failed.value.code.value == "internal", failed.value
        assert time.monotonic() - began < 1.0


async def test_a_kept_answer_goes_only_to_who_holds_its_key(topology: Topology) -> None:
    site = "site-a"
    settings = topology.site_settings(site, "client")
    async with running_mesh(topology):
        async with MeshClient(settings=settings) as mine, MeshClient(settings=settings) as other:
            first = await mine.complete(
                "[tag:k] x", route="cloud", max_tokens=6, deferrable=True, request_id="job-1"
            )
            assert first.text == expected_text("k", 6)
            assert (await mine.answer("job-1")).text == expected_text("k", 6)  # its own key
            # Another app at the site, asking for the same id: as if nothing were kept.
            with pytest.raises(UnavailableError, match="not for this key"):
                await other.answer("job-1")
        # After a restart, the key the app keeps itself proves it is the app's.
        async with MeshClient(settings=settings) as app:
            await app.complete(
                "[tag:q] x",
                route="cloud",
                max_tokens=6,
                deferrable=True,
                request_id="job-2",
                cancel_key="the-apps-own-secret",
            )
        async with MeshClient(settings=settings) as restarted:
            answer = await restarted.answer("job-2", cancel_key="the-apps-own-secret")
            assert answer.text == expected_text("q", 6)
            with pytest.raises(UnavailableError):
                await restarted.answer("job-2")  # its per-instance key is not that one


async def test_an_http_request_that_can_wait_is_kept_for_its_sender_only(
    topology: Topology,
) -> None:
    """OpenAI's ``service_tier: flex``: the sender asks again by sending the same request
    under the same id and gets the kept answer, generated once. The edge's HTTP API takes the
    keys `mesh creds` minted, each naming an app: another app at the site cannot have the
    answer, neither over HTTP with its own key (same id, same request) nor by id over NATS."""
    import aiohttp

    site = "site-a"
    keys = {
        app: key
        for key, app in parse_keys((topology.minted.out / f"api-keys-{site}").read_text()).items()
    }
    body = {
        "messages": [{"role": "user", "content": "[tag:h] summarise the week"}],
        "max_tokens": 6,
        "service_tier": "flex",
    }

    def as_app(app: str) -> dict[str, str]:
        return {
            "X-Request-Id": "http-job-1",
            "X-Mesh-Route": "cloud",
            "Authorization": f"Bearer {keys[app]}",
        }

    async with running_mesh(topology, http=True):
        edge = topology.edges[site]
        assert edge.http is not None and topology.backend is not None
        async with aiohttp.ClientSession(edge.http.url) as web:
            headers = {k: v for k, v in as_app("kiosk").items() if k != "Authorization"}
            async with web.post("/v1/chat/completions", json=body, headers=headers) as resp:
                assert resp.status == 401  # the minted edge listens with keys
            async with web.post("/v1/chat/completions", json=body, headers=as_app("kiosk")) as resp:
                first = await resp.json()
            assert resp.status == 200, first
            assert first["choices"][0]["message"]["content"] == expected_text("h", 6)
            generated = topology.backend.started
            async with MeshClient(settings=topology.site_settings(site, "client")) as other:
                with pytest.raises(UnavailableError, match="not for this key"):
                    await other.answer("http-job-1")
            other_app = as_app(f"{site}-apps")
            async with web.post("/v1/chat/completions", json=body, headers=other_app) as resp:
                refused = await resp.json()
            assert resp.status == 409, refused
            assert refused["error"]["code"] == "duplicate"
            assert "another sender" in refused["error"]["message"]
            async with web.post("/v1/chat/completions", json=body, headers=as_app("kiosk")) as resp:
                again = await resp.json()
            assert resp.status == 200, again
            assert again["choices"][0]["message"]["content"] == expected_text("h", 6)
            assert topology.backend.started == generated  # kept, not generated again


async def test_another_site_cannot_keep_a_held_request_out_of_the_hubs_queue(
    topology: Topology,
) -> None:
    """JetStream drops a publish whose message id it has seen, whoever sent it, and a sender may
    put any id on a message in its own lane. Site A queues a request of its own under the id
    site B's forward would have carried (``<scope>.<id>``): B's held request is still queued,
    answered, and collected."""
    squatter = topology.hub_settings("edge-site-a")
    async with running_mesh(topology):
        async with Connection(squatter.nats, "squatter") as sq:
            answered = asyncio.Event()

            async def on_event(msg: Msg) -> None:
                if b'"end"' in msg.data or b"\xa3end" in msg.data:
                    answered.set()

            await sq.nc.subscribe(token_subject("site-a", "squat-1"), cb=on_event)
            await sq.nc.publish(
                infer_subject(squatter.edge.cloud_model, "site-a"),
                b'{"id": "squat-1", "prompt": "[tag:z] x", "max_tokens": 2}',
                headers={MSG_ID_HEADER: "site-b.job-9"},
            )
            await asyncio.wait_for(answered.wait(), 10)  # queued (and answered) at the hub
        settings = topology.site_settings("site-b", "client")
        async with MeshClient(settings=settings) as client:
            answer = await asyncio.wait_for(
                client.complete(
                    "[tag:b] x", route="cloud", max_tokens=6, deferrable=True, request_id="job-9"
                ),
                20,
            )
    assert answer.text == expected_text("b", 6)
    assert answer.end.served_by.startswith("cloud:")


async def test_a_site_that_stops_answering_ends_a_request_that_can_wait_at_its_deadline(
    topology: Topology,
) -> None:
    """The site's leaf nats-server frozen (SIGSTOP by its PID) when a request that can wait comes
    in over HTTP: each read of the site's JetStream would wait out its own timeout (1 s for the
    served check, then 2 s for the kept answer here), but the edge's request timeout (1.5 s; an
    HTTP request has no deadline of its own) bounds them all: at 1.5 s a typed `unavailable`,
    send it again, not an error 3 s in. Once the leaf runs again, the same request sent again is
    held and answered."""
    import aiohttp

    site = "site-a"
    key = next(
        key
        for key, app in parse_keys((topology.minted.out / f"api-keys-{site}").read_text()).items()
        if app == "kiosk"
    )
    body = {
        "messages": [{"role": "user", "content": "[tag:f] plan the quarter"}],
        "max_tokens": 5,
        "service_tier": "flex",
    }
    headers = {
        "X-Request-Id": "frozen-1",
        "X-Mesh-Route": "cloud",
        "Authorization": f"Bearer {key}",
    }
    async with running_mesh(topology, http=True, edge_timeout=1.5):
        edge, leaf = topology.edges[site], topology.leaves[site]
        assert edge.http is not None and leaf.pid is not None
        async with aiohttp.ClientSession(edge.http.url) as web:
            with paused(leaf.pid):
                began = time.monotonic()
                async with web.post("/v1/chat/completions", json=body, headers=headers) as resp:
                    refused = await resp.json()
                took = time.monotonic() - began
            assert resp.status == 503, refused
            assert refused["error"]["code"] == "unavailable"
            assert "send it again" in refused["error"]["message"]
            assert 1.4 < took < 2.2, took

            async def answered() -> bool:
                async with web.post("/v1/chat/completions", json=body, headers=headers) as resp:
                    reply = await resp.json()
                if resp.status != 200:  # not held yet, or its answer not come yet: again
                    assert reply["error"]["code"] == "unavailable", reply
                    return False
                assert reply["choices"][0]["message"]["content"] == expected_text("f", 5)
                return True

            await eventually(answered, timeout=30, what="the request held and answered")


@pytest.mark.chaos
async def test_a_held_request_whose_deadline_passes_is_over_not_asked_for_again(
    topology: Topology,
) -> None:
    """The uplink is down; a request that can wait, with a deadline 1.5 s away, is held. At its
    deadline its client hears ``deadline_exceeded``, not "held, ask again later": no worker
    starts a request past its deadline. The site's forwarder keeps it so (before, it held it
    until the link returned and the hub refused it), and that is what asking by id gets;
    nothing is generated for it."""
    from protocol.errors import DeadlineExceededError

    site = "site-a"
    async with running_mesh(topology):
        edge = topology.edges[site]
        assert topology.backend is not None

        async def cloud_gone() -> bool:
            return edge.nodes.serves("smollm2") is False

        topology.uplinks[site].cut(3600)
        await eventually(cloud_gone, timeout=15, what="the edge to see the cloud gone")
        async with MeshClient(settings=topology.site_settings(site, "client")) as client:
            deadline = time.time() + 1.5
            body = {"id": "past-1", "prompt": "[tag:p] x", "route": "cloud", "max_tokens": 5}
            body |= {"deferrable": True, "deadline": deadline}
            # As the nats CLI sends it (JSON, one reply): the edge's word, not the SDK's clock.
            reply = await client.conn.nc.request(edge.subject, json.dumps(body).encode(), 5)
            event = json.loads(reply.data)
            assert (event["t"], event["code"]) == ("err", "deadline_exceeded"), event
            assert time.time() - deadline < 0.5
            generated = topology.backend.started

            async def kept_as_past_its_deadline() -> bool:
                try:
                    await client.answer("past-1")
                except DeadlineExceededError:
                    return True
                except UnavailableError:  # not kept yet
                    return False
                raise AssertionError("answered past its deadline")

            # Kept so by the site's forwarder, the uplink still down: it no longer holds the
            # requests after it back until the hub refuses it.
            await eventually(kept_as_past_its_deadline, timeout=10, what="the kept refusal")
            topology.uplinks[site].restore()
            after = await client.complete(
                "[tag:n] x", route="cloud", max_tokens=5, deferrable=True, request_id="next-1"
            )
            assert after.text == expected_text("n", 5)
            assert topology.backend.started == generated + 1  # the next one only
