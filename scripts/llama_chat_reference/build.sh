#!/usr/bin/env bash
# Builds `chat_ref` (chat_ref.cpp: llama.cpp's chat layer, apply and parse, as llama-server drives it) and,
# with a third argument `harvest`, `harvest` (a patched copy of llama.cpp's tests/test-chat.cpp that writes
# each of its template cases as a JSON line). The objects of llama.cpp's common/ are the ones
# scripts/llama_template_render/build.sh compiles (it runs first, into the same BUILD_DIR, and builds
# `render` too), linked against the libllama of the installed llama-cpp-python. About 5 minutes on
# 2 cores the first time; the objects are kept in BUILD_DIR/obj.
#
#   pip download llama-cpp-python==0.3.36 --no-binary :all: --no-deps -d /tmp/lcp && tar -C /tmp/lcp -xzf /tmp/lcp/*.tar.gz
#   scripts/llama_chat_reference/build.sh /tmp/lcp/llama_cpp_python-0.3.36/vendor/llama.cpp BUILD_DIR [harvest]
set -euo pipefail
L=${1:?the llama.cpp source tree: the sdist vendor/llama.cpp}
OUT=${2:-/tmp/llama_chat_reference}
HERE=$(cd "$(dirname "$0")" && pwd)
"$HERE/../llama_template_render/build.sh" "$L" "$OUT" >/dev/null
LIB=$(python -c 'import llama_cpp, os; print(os.path.join(os.path.dirname(llama_cpp.__file__), "lib"))')
FLAGS="-std=c++17 -O1 -g0 -w -I$L/common -I$L/include -I$L/ggml/include -I$L/vendor -I$L/src"
# common/ and the stubs, without render's main
COMMON=$(ls "$OUT"/obj/*.o | grep -v '_render\.cpp\.o$')
mkdir -p "$OUT/ref"
g++ $FLAGS -c "$HERE/chat_ref.cpp" -o "$OUT/ref/chat_ref.o"
g++ -o "$OUT/chat_ref" "$OUT/ref/chat_ref.o" $COMMON -L"$LIB" -lllama -lggml -lggml-base -Wl,-rpath,"$LIB" -lpthread
echo "$OUT/chat_ref"
if [ "${3:-}" = harvest ]; then
    python "$HERE/harvest_patch.py" "$L/tests/test-chat.cpp" "$OUT/ref/test-chat-harvest.cpp"
    g++ $FLAGS -I"$L/tests" -I"$L/tools/server" -c "$OUT/ref/test-chat-harvest.cpp" -o "$OUT/ref/harvest.o"
    g++ -o "$OUT/harvest" "$OUT/ref/harvest.o" $COMMON -L"$LIB" -lllama -lggml -lggml-base -Wl,-rpath,"$LIB" -lpthread
    echo "$OUT/harvest"
fi
