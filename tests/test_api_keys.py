"""API keys on the edge's HTTP API, as ``vllm serve --api-key``: each key names an app.

A real edge and worker on a real nats-server; the clients are the official ``openai`` client
and plain aiohttp. (The per-app lanes of kept answers are tested at a real site, in
``tests/test_edge_site.py``.)
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import openai
import pytest

from cloud_node.worker import Worker
from edge_node import api_keys
from edge_node.api_keys import parse_keys
from edge_node.node import EdgeNode
from edge_node.router import HeuristicRouter
from mesh.backends.deterministic import DeterministicBackend, Script
from mesh.config import MeshSettings, ModelSettings, load_settings
from mesh.connection import Connection
from mesh_app.creds import mint
from protocol.errors import InvalidRequestError
from tests.helpers import eventually

KEY_A = "key-of-app-a-0123456789"
KEY_B = "key-of-app-b-0123456789"
PROMPT = "[tag:ak] say something"
WANT = Script(tag="ak").answer(6)


def deterministic() -> DeterministicBackend:
    return DeterministicBackend(ModelSettings(backend="deterministic", slots=4))


@pytest.fixture
def keys_file(tmp_path: Path) -> Path:
    path = tmp_path / "api-keys"
    path.write_text(f"# apps of this edge\napp-a {KEY_A}\napp-b {KEY_B}  # the kiosk\n")
    return path


@pytest.fixture
async def keyed_edge(
    settings: MeshSettings, conn: Connection, keys_file: Path
) -> AsyncIterator[EdgeNode]:
    settings.edge.http_port = 0
    settings.edge.api_keys_file = str(keys_file)
    async with (
        Worker(settings, conn, deterministic()),
        EdgeNode(settings, conn, deterministic(), HeuristicRouter()) as edge,
    ):
        yield edge


def _rewrite(path: Path, text: str | None) -> None:
    """What an operator does to the keys file: write it anew, or delete it (None)."""
    if text is None:
        path.unlink()
    else:
        path.write_text(text)


def _client(edge: EdgeNode, key: str) -> openai.AsyncOpenAI:
    assert edge.http is not None
    return openai.AsyncOpenAI(base_url=f"{edge.http.url}/v1", api_key=key, max_retries=0)


async def _ask(client: openai.AsyncOpenAI) -> str | None:
    answer = await client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": PROMPT}], max_tokens=6
    )
    return answer.choices[0].message.content


async def test_requests_without_a_valid_key_are_refused_and_each_key_is_served(
    keyed_edge: EdgeNode,
) -> None:
    for key in (KEY_A, KEY_B):
        async with _client(keyed_edge, key) as client:
            assert await _ask(client) == WANT
    for key in ("not-a-key-of-this-edge", KEY_A[:-1]):
        async with _client(keyed_edge, key) as client:
            with pytest.raises(openai.AuthenticationError) as refused:
                await _ask(client)
        assert refused.value.status_code == 401
        assert refused.value.code == "unauthorized"
    assert keyed_edge.http is not None
    async with aiohttp.ClientSession(keyed_edge.http.url) as web:
        async with web.get("/v1/models") as resp:  # no Authorization header at all
            body = await resp.json()
            assert resp.status == 401 and body["error"]["code"] == "unauthorized"
            assert "Bearer" in body["error"]["message"]
            assert resp.headers["WWW-Authenticate"] == "Bearer"
        async with web.get("/v1/models", headers={"Authorization": f"Basic {KEY_A}"}) as resp:
            assert resp.status == 401
        # Probes stay open, as vLLM leaves them.
        for path in ("/health", "/ready", "/metrics"):
            async with web.get(path) as resp:
                assert resp.status == 200, path


async def test_a_key_removed_from_the_file_stops_working_without_a_restart(
    keyed_edge: EdgeNode, keys_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(api_keys, "RECHECK_S", 0.0)  # the file is looked at on every request
    new_key = "a-key-added-later-0123456789"
    async with (
        _client(keyed_edge, KEY_A) as old,
        _client(keyed_edge, new_key) as new,
    ):
        assert await _ask(old) == WANT
        _rewrite(keys_file, f"app-a {new_key}\n")

        async def swapped() -> bool:
            try:
                await old.models.list()
            except openai.AuthenticationError:
                return True
            return False

        await eventually(swapped, timeout=5, what="the removed key to be refused")
        assert await _ask(new) == WANT
        # A file broken by a bad edit keeps the keys last read: nobody is locked out.
        _rewrite(keys_file, "app-a short\n")
        assert await _ask(new) == WANT
        _rewrite(keys_file, None)
        assert await _ask(new) == WANT


def test_a_bad_keys_file_is_refused_naming_the_line() -> None:
    with pytest.raises(InvalidRequestError, match="line 2: expected '<app> <key>'"):
        parse_keys(f"app-a {KEY_A}\njust-one-word\n")
    with pytest.raises(InvalidRequestError, match="shorter than 16"):
        parse_keys("app-a short\n")
    with pytest.raises(InvalidRequestError, match="line 2: a key listed twice"):
        parse_keys(f"app-a {KEY_A}\napp-b {KEY_A}\n")
    with pytest.raises(InvalidRequestError, match="not \\[A-Za-z0-9_-\\]"):
        parse_keys(f"app.a {KEY_A}\n")
    with pytest.raises(InvalidRequestError, match="lists no key"):
        parse_keys("# nothing yet\n")


def test_an_api_beyond_loopback_must_have_keys(keys_file: Path) -> None:
    with pytest.raises(InvalidRequestError, match="beyond loopback, without API keys"):
        load_settings(environ={"MESH_EDGE_HTTP_HOST": "0.0.0.0"})
    keyed = load_settings(
        environ={"MESH_EDGE_HTTP_HOST": "0.0.0.0", "MESH_EDGE_API_KEYS_FILE": str(keys_file)}
    )
    assert keyed.edge.api_keys_file == str(keys_file)
    for loopback in ("127.0.0.1", "::1", "localhost"):
        assert load_settings(environ={"MESH_EDGE_HTTP_HOST": loopback}).edge.http_host == loopback
    # No HTTP API at all: nothing to protect.
    load_settings(environ={"MESH_EDGE_HTTP_HOST": "0.0.0.0", "MESH_EDGE_HTTP_PORT": "-1"})


def test_mesh_creds_writes_a_key_per_app_and_keeps_those_handed_out(tmp_path: Path) -> None:
    minted = mint(tmp_path, edges=["site1"], workers=[], clients=[("site1", "kiosk")])
    keys = {app: key for key, app in parse_keys((tmp_path / "api-keys-site1").read_text()).items()}
    assert set(keys) == {"site1-apps", "kiosk"}
    assert (tmp_path / "api-keys-site1").stat().st_mode & 0o077 == 0
    edge_env = (tmp_path / "edge-site1.env").read_text()
    assert f"MESH_EDGE_API_KEYS_FILE={(tmp_path / 'api-keys-site1').resolve()}" in edge_env
    assert f"OPENAI_API_KEY={keys['kiosk']}" in (tmp_path / "client-site1-kiosk.env").read_text()
    assert f"OPENAI_API_KEY={keys['site1-apps']}" in (tmp_path / "client-site1.env").read_text()
    # Run again with one more app: the keys handed out stay valid.
    mint(tmp_path, edges=["site1"], workers=[], clients=[("site1", "kiosk"), ("site1", "tv")])
    again = {app: key for key, app in parse_keys((tmp_path / "api-keys-site1").read_text()).items()}
    assert again["kiosk"] == keys["kiosk"] and again["site1-apps"] == keys["site1-apps"]
    assert set(again) == {"site1-apps", "kiosk", "tv"}
    assert minted.out == tmp_path
