#!/usr/bin/env bash
# Builds `render`: llama.cpp's own chat templating (common/chat.cpp and its Jinja engine, as
# llama-server calls them) against the libllama of the installed llama-cpp-python, to write
# tests/engine/chat_templates/llama_server.json (expected.py). About 5 minutes on 2 cores.
#
#   pip download llama-cpp-python==0.3.36 --no-binary :all: --no-deps -d /tmp/lcp && tar -C /tmp/lcp -xzf /tmp/lcp/*.tar.gz
#   scripts/llama_template_render/build.sh /tmp/lcp/llama_cpp_python-0.3.36/vendor/llama.cpp BUILD_DIR
set -euo pipefail
L=${1:?the llama.cpp source tree: the sdist vendor/llama.cpp}
OUT=${2:-/tmp/llama_template_render}
HERE=$(cd "$(dirname "$0")" && pwd)
LIB=$(python -c 'import llama_cpp, os; print(os.path.join(os.path.dirname(llama_cpp.__file__), "lib"))')
mkdir -p "$OUT/obj"
FLAGS="-std=c++17 -O1 -g0 -w -I$L/common -I$L/include -I$L/ggml/include -I$L/vendor -I$L/src"
cat > "$OUT/build-info.cpp" <<'CPP'
#include "build-info.h"
int llama_build_number(void) { return 0; }
const char * llama_commit(void) { return "sdist"; }
const char * llama_compiler(void) { return "g++"; }
const char * llama_build_target(void) { return "render"; }
const char * llama_build_info(void) { return "sdist"; }
void llama_print_build_info(const char *, FILE *) {}
CPP
SRCS="$HERE/render.cpp $HERE/stubs.cpp $OUT/build-info.cpp"
for f in chat chat-auto-parser-generator chat-auto-parser-helpers chat-diff-analyzer chat-peg-parser peg-parser \
         json-schema-to-grammar json-schema json log common unicode trie; do SRCS="$SRCS $L/common/$f.cpp"; done
SRCS="$SRCS $(ls $L/common/parsers/*.cpp $L/common/jinja/*.cpp)"
for s in $SRCS; do
    o="$OUT/obj/$(echo "$s" | tr / _).o"
    [ -f "$o" ] || g++ $FLAGS -c "$s" -o "$o"
done
g++ -o "$OUT/render" "$OUT"/obj/*.o -L"$LIB" -lllama -lggml -lggml-base -Wl,-rpath,"$LIB" -lpthread
echo "$OUT/render"
