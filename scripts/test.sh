#!/usr/bin/env bash
# Set up with the test tools, lint, type-check, and run the whole test suite (real nats-server,
# real GGUF model). GPU tests skip, saying why, where no CUDA GPU and vLLM exist.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh dev
echo "==> ruff"
.venv/bin/ruff check .
echo "==> mypy (strict on protocol/)"
.venv/bin/mypy protocol mesh mesh_app edge_node cloud_node
echo "==> pytest"
exec .venv/bin/pytest "$@"
