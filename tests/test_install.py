"""Installs per role: `pip install nats-llm-mesh` gives the SDK and the `mesh ask` / `mesh status`
CLI without compiling llama.cpp; the engines come with the role extras."""

from __future__ import annotations

import os
import subprocess
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_the_base_install_is_the_sdk_without_llama_cpp_or_numpy(tmp_path: Path) -> None:
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    install = subprocess.run(
        [
            str(python),
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "-c",
            str(REPO / "constraints.txt"),
            str(REPO),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        check=False,
    )
    assert install.returncode == 0, install.stderr[-2000:]
    check = (
        "import importlib.util as u, mesh.client, mesh.status, protocol; "
        "print([m for m in ('llama_cpp', 'numpy', 'openai', 'vllm') if u.find_spec(m)])"
    )
    found = subprocess.run(
        [str(python), "-c", check],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        check=False,
    )
    assert found.returncode == 0, found.stderr[-2000:]
    assert found.stdout.strip() == "[]"  # none of the engines came with the SDK
    for command in (["ask", "--help"], ["status", "--help"]):
        cli = subprocess.run(
            [str(env_dir / "bin" / "mesh"), *command],
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp_path,
            check=False,
        )
        assert cli.returncode == 0, cli.stderr[-2000:]
    # A role the base install cannot play says which extra it needs.
    edge = subprocess.run(
        [str(env_dir / "bin" / "mesh"), "edge", "--nats-url", "nats://127.0.0.1:1"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=60,
        check=False,
    )
    assert edge.returncode != 0
    assert "nats-llm-mesh[edge]" in edge.stderr + edge.stdout
