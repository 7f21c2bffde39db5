"""Every code example in the README and in docs/ runs, exactly as printed, or is validated.

Each fenced block names how it is checked in an HTML comment right above it:

- ``<!-- check: run -->``: run as a file against a real ``mesh up`` started here on its default
  ports (NATS on 127.0.0.1:4222, HTTP on 127.0.0.1:8080), as a reader would after starting it.
  Python blocks run with this interpreter, shell blocks with bash (``set -e``), with the
  checkout's ``.venv/bin`` on ``PATH`` and a stand-in for the ``nats`` CLI
  (``tests/docs_bin/nats``) that speaks the same protocol.
- ``<!-- check: validate -->``: what the test machines cannot run (a container engine, a GPU, a
  3-node hub, the test run itself). Checked instead: the syntax, every ``mesh`` command line
  against the CLI's own parser, every compose file it names with ``docker-compose config``
  where one is installed. The text beside such a block must say it is not run.

Blocks in ``text`` are diagrams and sample output, not code. Every ``MESH_*`` name anywhere in
the docs must be a real setting (or, for the few that are not settings, appear in the code).
"""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from mesh.config import describe_settings
from mesh_app.args import build_parser

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHIM_DIR = ROOT / "tests" / "docs_bin"
FENCE = re.compile(r"^```(\S*)\s*$")
CHECK = re.compile(r"^<!-- check: (run|validate) -->$")


@dataclass
class Block:
    path: Path
    line: int
    lang: str
    check: str | None
    code: str
    note: str  # the prose between the check comment and the block

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def _blocks() -> list[Block]:
    blocks: list[Block] = []
    for path in DOCS:
        lines = path.read_text().split("\n")
        i = 0
        while i < len(lines):
            match = FENCE.match(lines[i])
            if not match:
                i += 1
                continue
            start, lang = i, match.group(1)
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            check, note = None, []
            for k in range(start - 1, max(start - 8, -1), -1):
                found = CHECK.match(lines[k].strip())
                if found:
                    check = found.group(1)
                    # ... and the paragraph right above the comment
                    m = k - 1
                    while m >= 0 and not lines[m].strip():
                        m -= 1
                    while m >= 0 and lines[m].strip() and k - m < 8:
                        note.append(lines[m])
                        m -= 1
                    break
                if lines[k].startswith("```"):
                    break
                note.append(lines[k])
            blocks.append(
                Block(
                    path, start + 1, lang, check, "\n".join(lines[start + 1 : end]), " ".join(note)
                )
            )
            i = end + 1
    return blocks


BLOCKS = _blocks()
CODE = [b for b in BLOCKS if b.lang != "text"]
RUN = [b for b in CODE if b.check == "run"]


def test_the_docs_have_examples_to_run() -> None:
    assert len(DOCS) >= 10, [p.name for p in DOCS]
    assert any(b.lang == "python" for b in RUN) and any(b.lang == "sh" for b in RUN)


@pytest.mark.parametrize("block", CODE, ids=lambda b: b.name)
def test_every_example_says_how_it_is_checked(block: Block) -> None:
    assert block.lang in ("python", "sh", "yaml", "json"), f"{block.name}: unknown language"
    assert block.check is not None, f"{block.name}: no <!-- check: run|validate --> above it"
    if block.check == "validate":
        assert "not run" in block.note.lower(), f"{block.name}: say beside it that it is not run"


@pytest.mark.parametrize("block", CODE, ids=lambda b: b.name)
def test_every_example_is_valid(block: Block) -> None:
    if block.lang == "python":
        ast.parse(block.code, block.name)
    elif block.lang == "sh":
        result = subprocess.run(
            ["bash", "-n"], input=block.code, check=False, capture_output=True, text=True
        )
        assert result.returncode == 0, f"{block.name}: {result.stderr}"
        for command in _mesh_commands(block.code):
            try:
                build_parser().parse_args(command)
            except SystemExit as exc:
                pytest.fail(f"{block.name}: `mesh {shlex.join(command)}` does not parse ({exc})")
        composes = re.findall(r"-f (\S+\.ya?ml)", block.code)
        if composes:
            _validate_compose(block, composes)
    elif block.lang == "yaml":
        yaml.safe_load(block.code)
    elif block.lang == "json":
        json.loads(block.code)


def _mesh_commands(code: str) -> list[list[str]]:
    """Every ``mesh ...`` command line in a shell block, as argv after ``mesh``."""
    joined = code.replace("\\\n", " ")
    commands = []
    for raw in joined.split("\n"):
        line = raw.split(" #", 1)[0].strip()
        words = shlex.split(line) if line and not line.startswith("#") else []
        for i, word in enumerate(words):
            if word in ("mesh", ".venv/bin/mesh"):
                commands.append(words[i + 1 :])
                break
    return commands


def _validate_compose(block: Block, files: list[str]) -> None:
    """Run the block's ``mesh creds`` lines in a copy of the checkout's compose/ directory, as
    a reader would, then have docker-compose validate each file with each profile named."""
    for name in files:
        assert (ROOT / name).exists(), f"{block.name}: {name} does not exist"
    tool = shutil.which("docker-compose")
    if tool is None:
        return  # tests/test_compose_nats.py says that it skipped, and why
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copytree(
            ROOT / "compose", Path(tmp) / "compose", ignore=shutil.ignore_patterns("creds")
        )
        for command in _mesh_commands(block.code):
            if command[:1] == ["creds"]:
                minted = subprocess.run(
                    [sys.executable, "-m", "mesh_app.cli", *command],
                    cwd=tmp,
                    env={**os.environ, "PYTHONPATH": str(ROOT)},
                    check=False,
                    capture_output=True,
                    text=True,
                )
                assert minted.returncode == 0, f"{block.name}: {minted.stderr}"
        for name in files:
            for profile in sorted(set(re.findall(r"--profile (\S+)", block.code))) or [""]:
                argv = [
                    tool,
                    "-f",
                    str(Path(tmp) / name),
                    *(["--profile", profile] if profile else []),
                ]
                result = subprocess.run(
                    [*argv, "config", "-q"], check=False, capture_output=True, text=True
                )
                assert result.returncode == 0, f"{block.name} ({profile}): {result.stderr}"


def test_every_setting_named_in_the_docs_exists() -> None:
    settings = {env for env, _default, _doc in describe_settings()}
    code = "\n".join(p.read_text() for p in ROOT.glob("*/**/*.py") if ".venv" not in p.parts)
    unknown = set()
    for path in DOCS:
        for name in re.findall(r"\bMESH_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()):
            if name not in settings and name not in code and not name.startswith("MESH_TOK"):
                unknown.add(f"{path.name}: {name}")
    stream_names = {"MESH_INFER", "MESH_TOK", "MESH_ANSWERS", "MESH_LEASES", "MESH_OUTBOX"}
    assert not {u for u in unknown if u.split(": ")[1] not in stream_names}, sorted(unknown)


def test_every_link_between_pages_resolves() -> None:
    for path in DOCS:
        for target in re.findall(r"\]\(((?:docs/)?[\w.-]+\.md)(?:#[\w-]+)?\)", path.read_text()):
            assert (path.parent / target).exists(), f"{path.name} links to missing {target}"


# --- running the examples against a real `mesh up` --------------------------------------------


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


def _ready(proc: subprocess.Popen[bytes], log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"mesh up exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen("http://127.0.0.1:8080/ready", timeout=2) as resp:
                body = json.loads(resp.read())
                last = str(body)
                if body.get("status") == "ready":
                    return
        except OSError as exc:
            last = str(exc)
        time.sleep(0.2)
    raise AssertionError(f"mesh up was not ready in {timeout} s: {last}")


@pytest.fixture(scope="module")
def mesh_up(tmp_path_factory: pytest.TempPathFactory) -> object:
    if not (_port_free(4222) and _port_free(8080)):
        pytest.skip("ports 4222 and 8080, which the examples name, are taken on this machine")
    workdir = tmp_path_factory.mktemp("mesh-up")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESH_")}
    log_path = workdir / "mesh-up.log"
    log = log_path.open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "mesh_app.cli", "up"],
        cwd=workdir,
        env={**env, "PYTHONPATH": str(ROOT)},
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        _ready(proc, log_path, 120)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.mark.slow
@pytest.mark.parametrize("block", RUN, ids=lambda b: b.name)
def test_example_runs_as_printed(block: Block, mesh_up: object, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESH_")}
    env["PATH"] = os.pathsep.join([str(SHIM_DIR), str(Path(sys.executable).parent), env["PATH"]])
    env["PYTHONPATH"] = str(ROOT)
    if block.lang == "python":
        script = tmp_path / "example.py"
        script.write_text(block.code + "\n")
        argv = [sys.executable, str(script)]
    else:
        script = tmp_path / "example.sh"
        script.write_text("set -euo pipefail\n" + block.code + "\n")
        argv = ["bash", str(script)]
    result = subprocess.run(
        argv, cwd=tmp_path, env=env, check=False, capture_output=True, text=True, timeout=150
    )
    assert result.returncode == 0, f"{block.name}:\n{result.stdout}\n{result.stderr}"
    assert result.stdout.strip(), f"{block.name} printed nothing"
    assert "Traceback" not in result.stderr, f"{block.name}:\n{result.stderr}"
    if block.lang == "python":
        # Library manners: a program using the SDK gets nothing on stderr (no log lines, no
        # warnings) unless it configures logging. Commands may print hints there.
        assert result.stderr == "", f"{block.name} wrote to stderr:\n{result.stderr}"
