#!/usr/bin/env bash
# The main job on its embedded default: set up, start a local nats-server + cloud worker + edge,
# stream answers to two sample prompts (one answered on the edge, one escalated to the cloud)
# with the path and time to first token, then stop. Extra arguments go to `mesh demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/mesh demo "$@"
