#!/usr/bin/env bash
# llama.cpp's RPC backend (issue 52): builds llama-cpp-python with -DGGML_RPC=on into its own venv
# with the project installed beside it, then runs the tests marked rpc there (they start
# `appliance worker` processes on loopback; on the default CPU build they skip with the reason).
#
# From the repository root:
#   bash scripts/rpc_check.sh
# Settings (environment): RPC_VENV (.venv-rpc), RPC_OUT (test-artifacts/rpc: logs),
# RPC_REBUILD=1 builds llama-cpp-python again even when the venv already has the RPC backend,
# RPC_SETUP_ONLY=1 stops after the build.
set -euo pipefail
cd "$(dirname "$0")/.."
T0=$(date +%s)
VENV=${RPC_VENV:-.venv-rpc}
OUT=${RPC_OUT:-test-artifacts/rpc}
LLAMA_CPP_PYTHON=llama-cpp-python==0.3.36   # the version pyproject.toml pins
mkdir -p "$OUT"
step() { printf '\n== %s  (%ds)\n' "$*" $(( $(date +%s) - T0 )); }

[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
has_rpc() {
  "$VENV/bin/python" -c 'import sys, llama_cpp
from appliance.engine.runners.ggml_rpc import available
sys.exit(llama_cpp.__version__ != "0.3.36" or available() is not None)' 2>/dev/null
}
t=$(date +%s)
if [ "${RPC_REBUILD:-0}" = 1 ] || ! has_rpc; then
  step "llama-cpp-python with the RPC backend into $VENV"
  # pip's wheel cache ignores CMAKE_ARGS: no cache, no binary, forced; its dependencies come next
  CMAKE_ARGS="-DGGML_RPC=on" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
    "$VENV/bin/pip" install -q --no-cache-dir --force-reinstall --no-deps --no-binary llama-cpp-python \
    "$LLAMA_CPP_PYTHON" > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
fi
BUILD_S=$(( $(date +%s) - t ))
step "the project and its test extra into $VENV (pip's cache for everything but llama-cpp-python)"
"$VENV/bin/pip" install -q -e '.[test]' > "$OUT/project-install.log" 2>&1 || { tail -40 "$OUT/project-install.log"; exit 1; }
has_rpc || { echo "FAIL: the venv's llama-cpp-python has no RPC backend after the build" >&2; exit 1; }
echo "llama-cpp-python build ${BUILD_S}s (0 when the venv had it)"
[ "${RPC_SETUP_ONLY:-0}" = 1 ] && { step "setup done"; exit 0; }

step "the tests marked rpc, in $VENV"
"$VENV/bin/python" -m pytest -q -p no:cacheprovider -rs -m rpc tests/engine/test_rpc.py \
  2>&1 | tee "$OUT/pytest-rpc.log" | tail -15
step "done"
