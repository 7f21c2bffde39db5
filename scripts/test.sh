#!/usr/bin/env bash
# Set up with the test tools, lint, type-check, and run the whole test suite (real nats-server,
# real GGUF model). GPU tests skip, saying why, where no CUDA GPU and vLLM exist.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh dev
# A real compose implementation validates compose/docker-compose.yml (no engine needed):
# Debian's docker-compose, installed when missing and this machine can (root, apt).
if ! command -v docker-compose >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "==> installing docker-compose (Debian) to validate the compose file"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker-compose; } \
        >/dev/null 2>&1 || echo "    (not installed: the compose validation test will say it skipped)"
fi
echo "==> ruff"
.venv/bin/ruff check .
echo "==> mypy (strict on protocol/)"
.venv/bin/mypy protocol mesh mesh_app edge_node cloud_node
echo "==> pytest"
exec .venv/bin/pytest "$@"
