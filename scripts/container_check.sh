#!/usr/bin/env bash
# The container image, built and run (issue 46): from a checkout, make a Debian base from the
# machine's apt mirror, build the Containerfile, then run docs/container.md's podman commands
# and check what each does, printing every check with its time and the image's size.
#
# As root, from the repository root (Debian 12; it installs podman, buildah and debootstrap when
# they are missing):
#   bash scripts/container_check.sh                    # the default image: llama.cpp on the CPU
#   bash scripts/container_check.sh --extras torch     # the torch runner's image (--engine torch)
#   bash scripts/container_check.sh --backend vulkan   # llama.cpp's Vulkan backend, on Debian 13
#
# podman cannot start containers on the development machines (crun's setrlimit is refused), so
# each `podman run` line of the docs is carried out by `buildah run --isolation chroot`, which
# shares the host's network and has no named volumes: `to_buildah` says how each flag is
# translated, and docs/container.md what that leaves unchecked. The script stops at the first
# check that fails.
#
# Kept for a rerun: the base image (localhost/debian:SUITE; `podman rmi` it to make it again)
# and the build's layers (the llama.cpp layer is rebuilt only when its pin changes). Scratch
# files and logs: $CONTAINER_CHECK_DIR (default /var/tmp/appliance-container).
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE=${CONTAINER_CHECK_DIR:-/var/tmp/appliance-container}
BACKEND=cpu
EXTRAS=
while [ $# -gt 0 ]; do
  case $1 in
    --backend) BACKEND=$2; shift 2 ;;
    --extras) EXTRAS=$2; shift 2 ;;
    -h|--help) sed -n '2,21p' "$0"; exit 0 ;;
    *) echo "container_check: unknown argument $1 (--backend B, --extras E)" >&2; exit 2 ;;
  esac
done
# Debian 12's Vulkan headers (1.3.239) are too old for the vendored llama.cpp (vk::LayerSettingEXT)
SUITE=bookworm; [ "$BACKEND" = vulkan ] && SUITE=trixie
BASE=localhost/debian:$SUITE
tag=(); [ "$BACKEND" = cpu ] || tag+=("$BACKEND"); [ -z "$EXTRAS" ] || tag+=("${EXTRAS//,/-}")
TAG=$(IFS=-; echo "${tag[*]:-latest}")
IMAGE=localhost/appliance:$TAG
RUN=$CACHE/run-$TAG
KEY=check-$RANDOM$RANDOM            # the API key the served line reads from the environment
SECOND=SmolLM2-135M-Instruct-Q4_0   # the second model, made from the embedded one at run time

# The docs' commands, verbatim (the script fails if docs/container.md does not hold each one)
DOC_BUILD='podman build --format docker -t appliance -f Containerfile .'
DOC_RUN='podman run --rm -p 127.0.0.1:8080:8080 appliance'
DOC_SERVE='podman run -d --name appliance -p 127.0.0.1:8080:8080 -v ~/models:/models:ro -v appliance-data:/var/lib/appliance -e APPLIANCE_API_KEY appliance'
DOC_STOP='podman stop -t 40 appliance'
DOC_HOSTCHECK='podman run --rm appliance hostcheck'
DOC_BENCH='podman run --rm -v appliance-data:/var/lib/appliance appliance bench --prompts prose --tokens 16 --runs 1 --no-depth --concurrency= --agent-conversations 0 --no-needle --no-raw --quiet'
DOC_RESULTS='podman run --rm -v appliance-data:/var/lib/appliance appliance results'

# -- reporting: each check begins, passes, or the script stops naming it -----------------------

RESULTS=()
CHECK=setup
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN {printf "%.1f", b - a}'; }
begin() { CHECK=$1; CHECK_T=$(now); printf '\n== %s\n' "$1"; }
pass() {
  local dt; dt=$(since "$CHECK_T")
  RESULTS+=("$(printf '%8ss  ok  %s%s' "$dt" "$CHECK" "${1:+: $1}")")
  printf -- '-- ok (%ss)%s\n' "$dt" "${1:+: $1}"
}
fail() { echo "FAIL: $*" >&2; exit 1; }
summary() {
  printf '\n== summary: %s (%s, base %s)\n' "$IMAGE" "$([ "$1" = 0 ] && echo passed || echo "FAILED at: $CHECK")" "$BASE"
  printf '%s\n' "${RESULTS[@]}"
}

# -- cleanup: only what this run started --------------------------------------------------------

CTRS=()
SERVER_BG=
cleanup() {
  local rc=$?
  set +e
  if [ -n "$SERVER_BG" ] && kill -0 "$SERVER_BG" 2>/dev/null; then
    local pid; pid=$(entry_pid "$SERVER_BG")
    [ -n "$pid" ] && kill -TERM "$pid"
    sleep 5; kill -0 "$SERVER_BG" 2>/dev/null && kill -KILL "$SERVER_BG"
    wait "$SERVER_BG" 2>/dev/null
  fi
  [ ${#CTRS[@]} = 0 ] || buildah rm "${CTRS[@]}" >/dev/null
  rm -f "$RUN"/bind/models/*.gguf
  summary "$rc"
}
trap cleanup EXIT

# -- tools, base, pip settings ----------------------------------------------------------------

need_tools() {
  [ "$(id -u)" = 0 ] || fail "run as root (debootstrap, and buildah's chroot isolation)"
  local missing=() t
  for t in podman buildah debootstrap curl python3; do command -v "$t" >/dev/null || missing+=("$t"); done
  [ ${#missing[@]} = 0 ] && return
  echo "installing ${missing[*]}"
  apt-get -o DPkg::Lock::Timeout=900 update -qq
  DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=900 install -y -qq --no-install-recommends \
    podman buildah debootstrap curl python3 >/dev/null
}

mirror() {  # the Debian mirror apt already uses here (deb.debian.org if none is named)
  local m
  m=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
  [ -n "$m" ] || m=$(awk '$1 == "deb" && $3 !~ /security/ {print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)
  echo "${m:-http://deb.debian.org/debian}"
}

slim() {  # what Debian's -slim images leave out: documentation, manual pages, translations, apt's caches
  local root=$1
  mkdir -p "$root/etc/dpkg/dpkg.cfg.d"
  printf '%s\n' 'path-exclude /usr/share/doc/*' 'path-include /usr/share/doc/*/copyright' \
    'path-exclude /usr/share/man/*' 'path-exclude /usr/share/info/*' 'path-exclude /usr/share/locale/*' \
    'path-exclude /usr/share/groff/*' 'path-exclude /usr/share/lintian/*' > "$root/etc/dpkg/dpkg.cfg.d/slim"
  find "$root/usr/share/doc" ! -type d ! -name copyright -delete
  find "$root"/usr/share/{man,info,locale,groff,lintian} ! -type d -delete 2>/dev/null || true
  rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/cache/apt/archives/*.deb
}

make_base() {
  if podman image exists "$BASE"; then
    echo "$BASE: made $(podman image inspect --format '{{.Created}}' "$BASE" | cut -d. -f1) (podman rmi $BASE to make it again)"
    return
  fi
  local dir=$CACHE/rootfs-$SUITE m; m=$(mirror)
  rm -rf "$dir"
  echo "debootstrap --variant=minbase $SUITE $dir $m"
  debootstrap --variant=minbase "$SUITE" "$dir" "$m" > "$CACHE/debootstrap-$SUITE.log" 2>&1 \
    || { tail -20 "$CACHE/debootstrap-$SUITE.log"; fail "debootstrap $SUITE"; }
  slim "$dir"
  tar -C "$dir" -c . | podman import --quiet --message "debootstrap --variant=minbase $SUITE $m, slimmed" - "$BASE" >/dev/null
  rm -rf "$dir"
}

pip_settings() {
  # The machine's pip settings (`pip config list`: certificate store, local indexes, wheels,
  # constraints), for the build only: one pip.conf whose paths point under /mnt/host, and a
  # read-only mount for each path. /mnt exists in every base, so no mount point stays in a layer.
  PIP_ARGS=()
  local dir=$CACHE/pip host ctr
  rm -rf "$dir"; mkdir -p "$dir"
  python3 -m pip --version >/dev/null 2>&1 || { echo "no pip here: the build uses pip's defaults"; return; }
  python3 -m pip config list | python3 -c '
import ast, os, sys
root = sys.argv[1]
values, paths = {}, []
for line in sys.stdin:
    key, _, value = line.strip().partition("=")
    scope, name = key.rsplit(".", 1)
    if name == "config-file" or (name in values and scope != ":env:"):
        continue                                  # an environment variable wins over the files
    words = []
    for word in ast.literal_eval(value).split():
        url = word.startswith("file://")
        path = word[len("file://"):] if url else word
        if path.startswith("/"):
            # an index URL: mount its parent, which holds the files its pages link to
            paths.append(os.path.dirname(path.rstrip("/")) if url else path)
            word = ("file://" if url else "") + "/mnt/host" + path
        words.append(word)
    values[name] = " ".join(words)
with open(os.path.join(root, "pip.conf"), "w") as f:
    f.write("[global]\n" + "".join(f"{k} = {v}\n" for k, v in values.items()))
for p in sorted(set(paths)):
    if os.path.exists(p) and not any(p.startswith(q + "/") for q in paths):
        print(p)
' "$dir" > "$dir/mounts"
  PIP_ARGS=(-v "$dir:/mnt:ro")
  while read -r host; do
    ctr=$dir/host$host
    if [ -d "$host" ]; then mkdir -p "$ctr"; else mkdir -p "$(dirname "$ctr")"; touch "$ctr"; fi
    PIP_ARGS+=(-v "$host:/mnt/host$host:ro")
  done < "$dir/mounts"
  PIP_ARGS+=(--build-arg PIP_CONFIG_FILE=/mnt/pip.conf)
  sed 's/^/  /' "$dir/pip.conf"
}

# -- podman run, as buildah run --isolation chroot ---------------------------------------------

image_json() { podman image inspect --format "{{json $1}}" "$IMAGE"; }

to_buildah() {
  # One docs line `podman run [FLAGS] appliance [ARGS]` as buildah run's options (BR_OPTS) and
  # the process it starts (BR_ARGV: the image's ENTRYPOINT, then ARGS or its CMD, as podman does).
  #   -d --rm --name      nothing: the script waits for or stops the process, removes containers
  #   -p HOST:PORT:8080   nothing to publish (the host's network); the server takes a free port
  #                       ($PORT, by APPLIANCE_PORT) so a busy 8080 here does not matter
  #   -v DIR:PATH[:ro]    DIR's stand-in $RUN/bind/NAME; a named volume NAME is $RUN/volume/NAME,
  #                       owned by the image's user as podman's copy of the image's directory is
  #   -e NAME, --user U   the same
  local w i=2 spec src rest; read -r -a w <<< "$1"
  [ "${w[0]} ${w[1]}" = "podman run" ] || fail "not a podman run line: $1"
  BR_OPTS=(--env "APPLIANCE_PORT=$PORT")
  while [[ ${w[i]} == -* ]]; do
    case ${w[i]} in
      -d|--rm) ;;
      --name) i=$((i + 1)) ;;
      -p) i=$((i + 1)) ;;
      -e) i=$((i + 1)); BR_OPTS+=(--env "${w[i]}=${!w[i]}") ;;
      --user) i=$((i + 1)); BR_OPTS+=(--user "${w[i]}") ;;
      -v)
        i=$((i + 1)); spec=${w[i]}; src=${spec%%:*}; rest=${spec#*:}
        if [[ $src == */* ]]; then src=$RUN/bind/$(basename "$src"); mkdir -p "$src"
        else src=$RUN/volume/$src; [ -d "$src" ] || { mkdir -p "$src"; chown "$IMAGE_UID:$IMAGE_GID" "$src"; }
        fi
        BR_OPTS+=(-v "$src:$rest") ;;
      *) fail "to_buildah: ${w[i]} is not translated (a docs line uses a flag the script cannot check)" ;;
    esac
    i=$((i + 1))
  done
  [ "${w[i]}" = appliance ] || fail "to_buildah: the image is not 'appliance' in: $1"
  local args=("${w[@]:i+1}")
  [ ${#args[@]} -gt 0 ] || mapfile -t args < <(image_json .Config.Cmd | python3 -c 'import json, sys; print("\n".join(json.load(sys.stdin) or []))')
  mapfile -t BR_ARGV < <(image_json .Config.Entrypoint | python3 -c 'import json, sys; print("\n".join(json.load(sys.stdin) or []))')
  BR_ARGV+=("${args[@]}")
}

new_container() {  # CTR: a fresh working container of the image (removed at the end)
  CTR=$(buildah from --name "appliance-check-$TAG-$$-${#CTRS[@]}" "$IMAGE")
  CTRS+=("$CTR")
  # Without its VOLUME: given two -v or more, buildah 1.28's run at random mounts a volume of
  # its own at /var/lib/appliance over the one given there (3 runs in 10 here). A line with no
  # -v there writes into the container, as into podman's anonymous volume.
  buildah config --volume /var/lib/appliance- "$CTR"
}

prepare() {  # prepare LINE: BR_OPTS, BR_ARGV and CTR for the line, printed as it will run
  local line=$1; shift
  to_buildah "$line"
  new_container
  echo "\$ $line"
  echo "  = buildah run --isolation chroot ${BR_OPTS[*]} $* $CTR -- ${BR_ARGV[*]}" | sed "s/$KEY/\$KEY/g"
}

run_prepared() {  # run_prepared [EXTRA buildah run options...]
  buildah run --isolation chroot "${BR_OPTS[@]}" "$@" "$CTR" -- "${BR_ARGV[@]}"
}

run_doc() {  # run_doc LINE [EXTRA buildah run options...]: the line, in the foreground
  prepare "$@"
  shift
  run_prepared "$@"
}

descendants() {  # the processes under PID, breadth first
  local queue=("$1") p
  while [ ${#queue[@]} -gt 0 ]; do
    p=${queue[0]}; queue=("${queue[@]:1}")
    [ "$p" = "$1" ] || echo "$p"
    mapfile -t -O ${#queue[@]} queue < <(ps -o pid= --ppid "$p" | tr -d ' ')
  done
}

entry_pid() {  # the container's first process (podman's PID 1): the first under PID running appliance
  local p                                  # (not buildah's chroot helpers above it)
  for p in $(descendants "$1"); do
    [[ $(tr '\0' ' ' < "/proc/$p/cmdline" 2>/dev/null) == *python*' /opt/venv/bin/appliance '* ]] && { echo "$p"; return; }
  done
}

start_server() {  # start_server LINE LOG: the line in the background (SERVER_BG) until /health answers 200
  prepare "$1" "${VARIANT_ENV[@]}"
  run_prepared "${VARIANT_ENV[@]}" > "$2" 2>&1 &
  SERVER_BG=$!
  until [ "$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$PORT/health")" = 200 ]; do
    kill -0 "$SERVER_BG" 2>/dev/null || { cat "$2"; fail "the server exited"; }
    [ "$(since "$CHECK_T" | cut -d. -f1)" -lt 1900 ] || { tail -20 "$2"; fail "no /health 200 in 1900 s"; }
    sleep 1
  done
}

stop_server() {  # stop_server PID: SIGTERM to the entry point, as podman stop -t 40; exit status 0 within 40 s
  local rc
  [ -n "$1" ] || fail "no appliance process under buildah run"
  kill -TERM "$1"
  for _ in $(seq 400); do kill -0 "$SERVER_BG" 2>/dev/null || break; sleep 0.1; done
  kill -0 "$SERVER_BG" 2>/dev/null && { kill -KILL "$1"; fail "still running 40 s after SIGTERM"; }
  set +e; wait "$SERVER_BG"; rc=$?; set -e
  SERVER_BG=
  [ "$rc" = 0 ] || fail "exit status $rc after SIGTERM"
}

api() {  # api METHOD PATH [BODY]: curl against the served line, with its key; prints the body, then the status
  curl -s -o "$RUN/body" -w '%{http_code}' -X "$1" -H "Authorization: Bearer $KEY" \
    -H 'Content-Type: application/json' ${3:+-d "$3"} "http://127.0.0.1:$PORT$2"
}
field() { python3 -c "import json, sys; d = json.load(open('$RUN/body')); print($1)"; }

# -- the checks ---------------------------------------------------------------------------------

mkdir -p "$CACHE"
rm -rf "$RUN"; mkdir -p "$RUN"
echo "container_check: $IMAGE (BACKEND=$BACKEND${EXTRAS:+ EXTRAS=$EXTRAS}) on $BASE; scratch in $RUN"

begin "tools"
need_tools
pass "$(buildah --version), $(podman --version)"

begin "base image $BASE"
make_base
pass "$(podman image inspect --format '{{.Size}}' "$BASE" | awk '{printf "%.0f MB", $1 / 1e6}')"

begin "the docs hold the commands this script runs"
DOC_LINES=("$DOC_BUILD" "$DOC_RUN" "$DOC_SERVE" "$DOC_STOP" "$DOC_HOSTCHECK" "$DOC_BENCH" "$DOC_RESULTS")
for line in "${DOC_LINES[@]}"; do
  grep -qF -- "$line" docs/container.md || fail "docs/container.md lacks: $line"
done
pass "${#DOC_LINES[@]} lines"

begin "build $IMAGE"
pip_settings
read -r -a rest <<< "${DOC_BUILD#podman build }"
variant=(--build-arg "BASE=$BASE")
[ "$BACKEND" = cpu ] || variant+=(--build-arg "BACKEND=$BACKEND")
[ -z "$EXTRAS" ] || variant+=(--build-arg "EXTRAS=$EXTRAS")
rest=("${rest[@]/#appliance/$IMAGE}")
echo "\$ podman build --isolation chroot \$PIP_ARGS ${variant[*]} ${rest[*]}"
t=$(now)
podman build --isolation chroot "${PIP_ARGS[@]}" "${variant[@]}" "${rest[@]}" > "$RUN/build.log" 2>&1 \
  || { tail -40 "$RUN/build.log"; fail "the build (log: $RUN/build.log)"; }
echo "  $(grep -c 'Using cache' "$RUN/build.log" || true) of $(grep -c ' STEP ' "$RUN/build.log") steps from the layer cache"
BUILD_S=$(since "$t")
SIZE=$(podman image inspect --format '{{.Size}}' "$IMAGE" | awk '{printf "%.0f MB", $1 / 1e6}')
# the build stage alone is what a single-stage Containerfile would ship (compilers, headers)
podman build --isolation chroot "${PIP_ARGS[@]}" "${variant[@]}" --format docker --target build \
  -t "localhost/appliance-build:$TAG" -f Containerfile . > "$RUN/build-stage.log" 2>&1 || fail "the build stage (log: $RUN/build-stage.log)"
STAGE_SIZE=$(podman image inspect --format '{{.Size}}' "localhost/appliance-build:$TAG" | awk '{printf "%.0f MB", $1 / 1e6}')
CTR=$(buildah from "localhost/appliance-build:$TAG"); CTRS+=("$CTR")
echo "  runtime packages (what the built libraries link to): $(buildah run --isolation chroot "$CTR" -- cat /runtime-packages.txt | tr '\n' ' ')"
pass "$SIZE (the build stage, as a single-stage image would be: $STAGE_SIZE); build ${BUILD_S}s"

begin "the image's entry point, command, user, volume and health check"
[ "$(image_json .Config.Entrypoint)" = '["appliance"]' ] || fail "ENTRYPOINT is $(image_json .Config.Entrypoint)"
[ "$(image_json .Config.Cmd)" = '["serve"]' ] || fail "CMD is $(image_json .Config.Cmd)"
[ "$(image_json .Config.User)" = '"appliance"' ] || fail "USER is $(image_json .Config.User)"
[[ $(image_json .Config.Volumes) == *'"/var/lib/appliance"'* ]] || fail "no VOLUME /var/lib/appliance"
HEALTH=$(image_json .Config.Healthcheck)
[[ $HEALTH == *'"CMD"'* ]] || fail "no HEALTHCHECK (built without --format docker?)"
new_container
read -r IMAGE_UID IMAGE_GID < <(buildah run --isolation chroot "$CTR" -- sh -c 'echo $(id -u) $(id -g)')
[ "$IMAGE_UID" != 0 ] || fail "the image's user is root"
for leftover in /etc/pip.conf /mnt/pip.conf /mnt/host /root/.config/pip; do
  buildah run --isolation chroot --user root "$CTR" -- test ! -e "$leftover" || fail "$leftover is in the image"
done
pass "appliance serve, as uid $IMAGE_UID; data in /var/lib/appliance; no pip settings left in the image"

PORT=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
VARIANT_ENV=()
[ "$BACKEND" != vulkan ] || VARIANT_ENV+=(--env GGML_VK_VISIBLE_DEVICES=0)   # llama.cpp skips CPU-type devices (lavapipe) without it
# lavapipe compiles llama.cpp's pipelines at load: the engine was not loaded after serve's default
# 300 s here (2 shared cores, another lavapipe load beside it)
[ "$BACKEND" != vulkan ] || VARIANT_ENV+=(--env APPLIANCE_ENGINE_START_TIMEOUT=1800)
[[ ",$EXTRAS," != *,torch,* ]] || VARIANT_ENV+=(--env APPLIANCE_ENGINE=torch)
[ ${#VARIANT_ENV[@]} = 0 ] || echo "this variant's runs add: ${VARIANT_ENV[*]}"

begin "hostcheck inside the image"
run_doc "$DOC_HOSTCHECK" "${VARIANT_ENV[@]}"
pass

begin "a second model for the models volume: appliance quantize in the image"
mkdir -p "$RUN/bind/models"
new_container
buildah run --isolation chroot --user root -v "$RUN/bind/models:/out" "$CTR" -- \
  appliance quantize --to q4_0 embedded "/out/$SECOND.gguf"
pass "$(du -m "$RUN/bind/models/$SECOND.gguf" | cut -f1) MB, $SECOND"

begin "serve: the compose-style line, until /health answers 200"
export APPLIANCE_API_KEY=$KEY
start_server "$DOC_SERVE" "$RUN/serve.log"
head -3 "$RUN/serve.log" | sed "s/$KEY/\$KEY/g"
grep -m1 'serving' "$RUN/serve.log" || true
pass "port $PORT"

begin "serve: /health, the chat page, the API key"
[ "$(api GET /health)" = 200 ] || fail "/health: $(cat "$RUN/body")"
head -c 400 "$RUN/body"; echo " ..."
[ "$(curl -s -o "$RUN/page" -w '%{http_code}' "http://127.0.0.1:$PORT/")" = 200 ] || fail "the chat page"
grep -qi '<html' "$RUN/page" || fail "the chat page is not HTML"
echo "chat page: $(wc -c < "$RUN/page") bytes, $(grep -o -m1 '<title>[^<]*</title>' "$RUN/page")"
code=$(curl -s -o /dev/null -w '%{http_code}' -H 'Content-Type: application/json' \
  -d '{"messages": [{"role": "user", "content": "hi"}]}' "http://127.0.0.1:$PORT/v1/chat/completions")
[ "$code" = 401 ] || fail "a request without the key got $code, not 401"
[ "$(api POST /api/conversations '{"title": "container check"}')" = 201 ] || fail "a conversation: $(cat "$RUN/body")"
[ -s "$RUN/volume/appliance-data/conversations.db" ] || fail "the conversation is not on the data volume"
pass "/health 200, page 200, no key 401, a conversation stored on the data volume"

begin "serve: a chat completion on the embedded model"
[ "$(api POST /v1/chat/completions '{"messages": [{"role": "user", "content": "Name three rivers."}], "max_tokens": 24, "temperature": 0}')" = 200 ] \
  || fail "$(cat "$RUN/body")"
field '"reply: " + repr(d["choices"][0]["message"]["content"]) + "\nmodel " + d["model"] + ", usage " + json.dumps(d["usage"])'
[ -n "$(field 'd["choices"][0]["message"]["content"].strip()')" ] || fail "an empty reply"
pass "$(field 'd["model"]')"

begin "serve: the read-only models volume serves a second GGUF"
[ "$(api GET /v1/models)" = 200 ] || fail "/v1/models: $(cat "$RUN/body")"
field '", ".join(m["id"] for m in d["data"])'
[ "$(field "any(m['id'] == '$SECOND' for m in d['data'])")" = True ] || fail "/v1/models does not list $SECOND"
[ "$(api POST /v1/chat/completions '{"model": "'"$SECOND"'", "messages": [{"role": "user", "content": "Name three rivers."}], "max_tokens": 24, "temperature": 0}')" = 200 ] \
  || fail "$(cat "$RUN/body")"
field '"reply: " + repr(d["choices"][0]["message"]["content"])'
[ "$(field 'd["model"]')" = "$SECOND" ] || fail "answered by $(field 'd["model"]')"
pass "$SECOND from /models (:ro)"

begin "serve: the image's HEALTHCHECK command passes"
mapfile -t hc < <(echo "$HEALTH" | python3 -c 'import json, sys; print("\n".join(json.load(sys.stdin)["Test"][1:]))')
echo "HEALTHCHECK CMD ${hc[*]}"
new_container
buildah run --isolation chroot --env "APPLIANCE_PORT=$PORT" "$CTR" -- "${hc[@]}"
pass

begin "serve: the server and its engines run as the image's user"
SERVER_PID=$(entry_pid "$SERVER_BG")
[ -n "$SERVER_PID" ] || fail "no appliance process under buildah run"
mapfile -t procs < <(echo "$SERVER_PID"; descendants "$SERVER_PID")
for p in "${procs[@]}"; do
  uid=$(awk '/^Uid:/ {print $2}' "/proc/$p/status")
  printf '  pid %s uid %s: %s\n' "$p" "$uid" "$(tr '\0' ' ' < "/proc/$p/cmdline" | cut -c1-90)"
  [ "$uid" = "$IMAGE_UID" ] || fail "pid $p runs as uid $uid"
done
pass "${#procs[@]} processes, uid $IMAGE_UID"

begin "stop: $DOC_STOP (SIGTERM to the entry point, SIGKILL after 40 s)"
stop_server "$SERVER_PID"
tail -4 "$RUN/serve.log"
# multiprocessing's resource tracker outlives the server by a moment (it exits when its pipe
# closes); in a PID namespace it would go with PID 1 anyway
for _ in $(seq 100); do
  left=(); for p in "${procs[@]}"; do [ ! -e "/proc/$p" ] || left+=("$p"); done
  [ ${#left[@]} = 0 ] && break; sleep 0.1
done
[ ${#left[@]} = 0 ] || fail "still there 10 s after the server exited: ${left[*]}"
new_container
if buildah run --isolation chroot --env "APPLIANCE_PORT=$PORT" "$CTR" -- "${hc[@]}" 2>/dev/null; then
  fail "the HEALTHCHECK passes with no server"
fi
pass "exit 0, no process left, HEALTHCHECK now fails"

begin "serve: the page's first run line (no volumes, no key), until /health answers 200, then SIGTERM"
unset APPLIANCE_API_KEY
start_server "$DOC_RUN" "$RUN/run.log"
[ "$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$PORT/")" = 200 ] || fail "the chat page"
grep -m1 'no --api-key is set' "$RUN/run.log" | cut -c1-150 || fail "no warning that the API is open"
stop_server "$(entry_pid "$SERVER_BG")"
pass "/health 200, page 200, the open-API warning; exit 0 on SIGTERM"

begin "bench inside the image; its results and the conversation on the data volume"
run_doc "$DOC_BENCH" "${VARIANT_ENV[@]}" > "$RUN/bench.log" 2>&1 || { tail -30 "$RUN/bench.log"; fail "bench"; }
sed -n '1,2p;/^### /,$p' "$RUN/bench.log"
run_doc "$DOC_RESULTS"
echo "the data volume (appliance-data) holds:"
(cd "$RUN/volume/appliance-data" && find . -maxdepth 2 -printf '  %u %6s  %p\n' | sort -k3)
for f in results.db conversations.db; do
  [ -s "$RUN/volume/appliance-data/$f" ] || fail "no $f on the data volume"
done
pass

echo
echo "image $IMAGE: $SIZE (single-stage equivalent $STAGE_SIZE), built in ${BUILD_S}s"
echo "containers storage: $(du -sh /var/lib/containers/storage | cut -f1) on disk (the images and the build's cached layers)"
