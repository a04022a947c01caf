#!/usr/bin/env bash
# llama.cpp's real Vulkan backend on a software device (Mesa's lavapipe, which runs on the CPU),
# so that placement, fit and offload run against GPU buffers on a machine with no GPU (issue 45).
#
# From the repository root of a fresh clone, as root (or with sudo) on Debian 12:
#   bash scripts/vulkan_check.sh
# It installs the apt packages of scripts/vulkan-packages.txt (the Containerfile's BACKEND=vulkan
# line reads the same file), unpacks Debian 13's libvulkan-dev headers into a prefix (Debian 12's
# 1.3.239 headers are too old for the vendored llama.cpp: vk::LayerSettingEXT), builds
# llama-cpp-python with -DGGML_VULKAN=on into its own venv with the project installed beside it,
# then runs the checks and prints a table (docs/gpu.md, "A software GPU").
#
# Settings (environment): VULKAN_VENV (.venv-vulkan), VULKAN_PREFIX (.vulkan-prefix),
# VULKAN_OUT (test-artifacts/vulkan: logs and the table's JSON), VULKAN_REBUILD=1 builds
# llama-cpp-python again even when the venv already has a Vulkan build, VULKAN_SETUP_ONLY=1
# stops after the build, VULKAN_CHECKS=serve,moe runs only those checks (vulkan_checks.py --only),
# VULKAN_CMAKE_EXTRA adds to the build's CMAKE_ARGS (-DGGML_RPC=on: a worker beside lavapipe,
# tests/engine/test_rpc.py's split over a worker and a local GPU; give it its own VULKAN_VENV).
# The machine's own apt sources are never touched. Measured on a 2-core VM (docs/gpu.md): the
# build 17 minutes, the tests and checks 27 (the greedy agreement check 23 of them).
set -euo pipefail
cd "$(dirname "$0")/.."
T0=$(date +%s)
VENV=${VULKAN_VENV:-.venv-vulkan}
PREFIX=${VULKAN_PREFIX:-.vulkan-prefix}
OUT=${VULKAN_OUT:-test-artifacts/vulkan}
LLAMA_CPP_PYTHON=llama-cpp-python==0.3.36   # the version pyproject.toml pins
mkdir -p "$OUT" "$PREFIX"
PREFIX=$(cd "$PREFIX" && pwd)
SUDO=; [ "$(id -u)" = 0 ] || SUDO=sudo
step() { printf '\n== %s  (%ds)\n' "$*" $(( $(date +%s) - T0 )); }
declare -A SECONDS_OF

t=$(date +%s)
mapfile -t PACKAGES < <(grep -v '^\s*$' scripts/vulkan-packages.txt)
# and what building llama-cpp-python needs, where the machine lacks it
command -v g++ >/dev/null || PACKAGES+=(g++)
command -v cmake >/dev/null || PACKAGES+=(cmake)
python3 -c 'import ensurepip' 2>/dev/null || PACKAGES+=(python3-venv)
step "apt packages: ${PACKAGES[*]}"
if [ "$(dpkg-query -W -f='${Status}\n' "${PACKAGES[@]}" 2>/dev/null | grep -c 'install ok installed')" = "${#PACKAGES[@]}" ]; then
  echo "already installed"
else
  $SUDO apt-get -o DPkg::Lock::Timeout=900 update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get -o DPkg::Lock::Timeout=900 install -y -qq --no-install-recommends "${PACKAGES[@]}" >/dev/null
fi
SECONDS_OF[apt]=$(( $(date +%s) - t ))

step "Debian 13's Vulkan headers into $PREFIX (a trixie source list in its own apt state)"
t=$(date +%s)
if [ ! -f "$PREFIX/usr/include/vulkan/vulkan.hpp" ] || ! grep -q LayerSettingEXT "$PREFIX/usr/include/vulkan/vulkan_structs.hpp" 2>/dev/null; then
  # the mirror the machine already uses (deb.debian.org if none is named)
  MIRROR=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
  [ -n "$MIRROR" ] || MIRROR=$(awk '$1 == "deb" && $3 !~ /security/ {print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)
  MIRROR=${MIRROR:-http://deb.debian.org/debian}
  A="$PREFIX/apt"
  mkdir -p "$A/state/lists/partial" "$A/cache/archives/partial" "$A/etc" "$A/debs"
  echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $MIRROR trixie main" > "$A/etc/trixie.list"
  APT_OPTS=(-o "Dir::Etc::sourcelist=$A/etc/trixie.list" -o "Dir::Etc::sourceparts=-"
            -o "Dir::State=$A/state" -o "Dir::Cache=$A/cache" -o "Debug::NoLocking=1"
            -o "APT::Sandbox::User=root")
  apt-get "${APT_OPTS[@]}" update -qq
  (cd "$A/debs" && apt-get "${APT_OPTS[@]}" download libvulkan-dev)
  dpkg -x "$A"/debs/libvulkan-dev_*.deb "$PREFIX"
fi
grep -m1 -o 'VK_HEADER_VERSION [0-9]*' "$PREFIX/usr/include/vulkan/vulkan_core.h"
SECONDS_OF[headers]=$(( $(date +%s) - t ))

step "llama-cpp-python with the Vulkan backend into $VENV, the project beside it"
t=$(date +%s)
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
# llama.cpp lists a CPU-type Vulkan device (lavapipe) only when GGML_VK_VISIBLE_DEVICES names it
export GGML_VK_VISIBLE_DEVICES=${GGML_VK_VISIBLE_DEVICES:-0}
has_vulkan() {   # the build has the backend, and the backend a device
  "$VENV/bin/python" - <<'EOF' 2>/dev/null
import pathlib, sys, llama_cpp
built = (pathlib.Path(llama_cpp.__file__).parent / "lib" / "libggml-vulkan.so").exists()
sys.exit(0 if built and llama_cpp.__version__ == "0.3.36" and llama_cpp.llama_supports_gpu_offload() else 1)
EOF
}
if [ "${VULKAN_REBUILD:-0}" = 1 ] || ! has_vulkan; then
  # pip's wheel cache ignores CMAKE_ARGS, and a find-links directory may hold a CPU wheel:
  # no cache, no binary, forced
  CMAKE_ARGS="-DGGML_VULKAN=on -DVulkan_INCLUDE_DIR=$PREFIX/usr/include ${VULKAN_CMAKE_EXTRA:-}" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
    "$VENV/bin/pip" install -q --no-cache-dir --force-reinstall --no-binary llama-cpp-python "$LLAMA_CPP_PYTHON" \
    > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
  SECONDS_OF[build]=$(( $(date +%s) - t ))
else
  echo "the venv already has a Vulkan build (VULKAN_REBUILD=1 builds it again)"
  SECONDS_OF[build]=0
fi
t=$(date +%s)
# the project and pytest: the Vulkan tests need no torch (the test extra would bring it)
"$VENV/bin/pip" install -q -e . pytest > "$OUT/project-install.log" 2>&1 || { tail -40 "$OUT/project-install.log"; exit 1; }
has_vulkan || { echo "FAIL: the venv's llama-cpp-python has no GPU offload after the build" >&2; exit 1; }
SECONDS_OF[project]=$(( $(date +%s) - t ))
printf 'apt %ss, headers %ss, llama-cpp-python build %ss, project install %ss\n' \
  "${SECONDS_OF[apt]}" "${SECONDS_OF[headers]}" "${SECONDS_OF[build]}" "${SECONDS_OF[project]}"
[ "${VULKAN_SETUP_ONLY:-0}" = 1 ] && { step "setup done"; exit 0; }

step "the tests marked vulkan, in $VENV"
t=$(date +%s)
# the tests marked vulkan (those modules: the device check's is issue 72's), and the Vulkan loader's probe (unmarked: it runs anywhere)
"$VENV/bin/python" -m pytest -q -p no:cacheprovider -rs tests/engine/test_vulkan.py \
  tests/engine/test_vulkan_device_check.py tests/hostcheck/test_vulkan.py > "$OUT/pytest-vulkan.log" 2>&1 && PYTEST_RC=0 || PYTEST_RC=$?
tail -3 "$OUT/pytest-vulkan.log"
grep -E "^(FAILED|ERROR|SKIPPED)" "$OUT/pytest-vulkan.log" | head -20 || true
SECONDS_OF[tests]=$(( $(date +%s) - t ))

step "the checks (scripts/vulkan_checks.py: each starts the appliance on the device)"
t=$(date +%s)
"$VENV/bin/python" scripts/vulkan_checks.py --out "$OUT" ${VULKAN_CHECKS:+--only "$VULKAN_CHECKS"} \
  > "$OUT/vulkan-checks.md" 2> "$OUT/vulkan-checks.err" && CHECKS_RC=0 || CHECKS_RC=$?
SECONDS_OF[checks]=$(( $(date +%s) - t ))
cat "$OUT/vulkan-checks.md"

step "done"
printf 'times: apt %ss, headers %ss, llama-cpp-python build %ss, project install %ss, vulkan tests %ss (exit %s), checks %ss (exit %s); total %ss\n' \
  "${SECONDS_OF[apt]}" "${SECONDS_OF[headers]}" "${SECONDS_OF[build]}" "${SECONDS_OF[project]}" \
  "${SECONDS_OF[tests]}" "$PYTEST_RC" "${SECONDS_OF[checks]}" "$CHECKS_RC" $(( $(date +%s) - T0 ))
echo "logs, the table as JSON and each server's output: $OUT"
[ "$PYTEST_RC" = 0 ] && [ "$CHECKS_RC" = 0 ]
