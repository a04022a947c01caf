"""Several machines through llama.cpp's RPC backend (issue 52): `appliance worker` and
`--rpc`. The unmarked tests run anywhere in well under a second (addresses, refusals). The tests
marked rpc need llama-cpp-python built with -DGGML_RPC=on (scripts/rpc_check.sh, in .venv-rpc)
and skip elsewhere, saying why: they start workers on loopback (CPU devices) and load the
embedded model with its layers on them, each head in its own process, because a worker that
goes away aborts the process that talks to it (llama.cpp's GGML_ABORT) and a registered worker
stays registered for the life of a process.
"""
from __future__ import annotations

import json
import random
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from appliance.cli import main
from appliance.config import EngineConfig
from appliance.endpoints import Endpoint, is_loopback, parse_endpoints
from appliance.engine.runners import ggml_rpc


def test_endpoints_are_parsed_and_bad_ones_named():
    assert parse_endpoints("127.0.0.1:50052, box2:7000") == (Endpoint("127.0.0.1", 50052), Endpoint("box2", 7000))
    with pytest.raises(ValueError, match="IPv4 only"):
        parse_endpoints("[::1]:9")
    for bad in ("box", "box:", ":1", "box:0", "box:99999", "a:1,a:1"):
        with pytest.raises(ValueError, match="--rpc"):
            parse_endpoints(bad)


def test_loopback_is_told_apart():
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3") and not is_loopback("no.such.host.invalid")


def test_serve_takes_several_workers_and_the_gpus_shares():
    assert EngineConfig(rpc="a:1,b:2", tensor_split="3,1").rpc == "a:1,b:2"
    with pytest.raises(ValueError, match="HOST:PORT"):
        EngineConfig(rpc="nope")
    for bad in ("3;1", "1,-1", "0,0", "nan,1", "inf"):
        with pytest.raises(ValueError, match="--tensor-split"):
            EngineConfig(tensor_split=bad)


def test_the_worker_refuses_a_public_address_without_the_flag(capsys):
    assert main(["worker", "--host", "0.0.0.0"]) == 2
    assert "--allow-remote" in capsys.readouterr().err
    assert main(["worker", "--host", "localhost"]) == 2     # llama.cpp's server binds IPv4 addresses only
    assert "IPv4" in capsys.readouterr().err
    for facts_port in ("50052", "0", "65536"):
        assert main(["worker", "--facts-port", facts_port]) == 2
        assert f"--facts-port {facts_port} is not a port other than --port 50052" in capsys.readouterr().err


def test_the_worker_help_says_the_protocol_has_no_authentication(capsys):
    with pytest.raises(SystemExit):
        main(["worker", "--help"])
    assert "NO authentication" in capsys.readouterr().out


WHY = ggml_rpc.available()


@pytest.mark.skipif(WHY is None, reason="this build has the RPC backend")
def test_a_build_without_rpc_refuses_the_worker_with_how_to_build_it(capsys):
    assert main(["worker"]) == 2
    assert "-DGGML_RPC=on" in capsys.readouterr().err


needs_rpc = pytest.mark.skipif(WHY is not None, reason=WHY or "")


def _local_gpu() -> str | None:
    """A GPU of this host's beside the RPC backend (lavapipe, in the venv VULKAN_CMAKE_EXTRA=-DGGML_RPC=on
    bash scripts/vulkan_check.sh builds), else None."""
    if WHY is not None:
        return None
    from appliance.engine.runners import ggml_devices

    return next((d.name for d in ggml_devices.devices() if d.kind in ("gpu", "igpu") and not d.remote), None)


LOCAL_GPU = _local_gpu()
# the CPU-only splits below: this host's GPU would join them (the local-GPU test covers that)
cpu_only = pytest.mark.skipif(LOCAL_GPU is not None, reason=f"this host's {LOCAL_GPU} would join the split")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def port_pair() -> int:
    """A port P with P and P + 1 (a worker's RPC and facts ports) both free, below the ephemeral
    range. Not free_port() + 1 (issue 68): bind(0) hands out odd ports and connect() even ones on
    Linux, so the port after a free_port() is one every client connection of the suite draws its
    own from, held while open and 60 s after in TIME_WAIT, and the worker's facts server then
    cannot bind it. Nothing else in the suite binds below the ephemeral range."""
    top = _ephemeral_low() - 2
    bottom = 10000 if top > 11000 else 1024
    for _ in range(1000):
        port = random.randrange(bottom, top)
        if _bindable(port) and _bindable(port + 1):
            return port
    raise AssertionError(f"no two free ports side by side in {bottom}-{top}")


class Worker:
    """`appliance worker` started here: its stdout (and stderr) read as it comes; unpacks as
    (endpoint, process)."""

    def __init__(self, port: int, extra: tuple[str, ...]):
        self.ep = f"127.0.0.1:{port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "appliance", "worker", "--port", str(port),
                                      "--threads", "1", *extra],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self._said = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._said:
                self.lines.append(line)
                self._said.notify_all()
        with self._said:
            self.lines.append("")          # the end
            self._said.notify_all()

    def wait_for(self, *needles: str, timeout: float = 120.0) -> str | None:
        """The first line saying one of `needles`; None when the worker's output ends first."""
        deadline = time.monotonic() + timeout
        seen = 0
        with self._said:
            while True:
                for line in self.lines[seen:]:
                    if line == "":
                        return None
                    if any(n in line for n in needles):
                        return line
                seen = len(self.lines)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"the worker said none of {needles} in {timeout} s:\n{self.output(0)}")
                self._said.wait(left)

    def output(self, timeout: float = 30.0) -> str:
        """What it printed (all of it once it has exited)."""
        self._reader.join(timeout)
        with self._said:
            return "".join(self.lines)

    def listens(self, timeout: float = 120.0) -> bool:
        port = int(self.ep.rpartition(":")[2])
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return True
            except OSError:
                time.sleep(0.1)
        return False

    def __iter__(self):
        return iter((self.ep, self.proc))


@pytest.fixture
def worker():
    """`worker(*args)` starts `appliance worker` on loopback on a port pair of its own (port_pair)
    and returns once it serves RPC and, unless --no-facts, says it serves its facts; a pair taken
    meanwhile (the worker says its facts are not served, or exits) is retried with another, a few
    times. `worker(*args, port=P)`: on P, once it serves RPC and says whether it serves its facts.
    Returns the started Worker, which unpacks as (endpoint, process)."""
    started = []

    def start(*extra: str, port: int | None = None) -> Worker:
        if port is not None:            # this port, whatever it says of its facts
            w = Worker(port, extra)
            started.append(w)
            assert w.wait_for("hostcheck facts") and w.listens(), w.output()
            return w
        for _ in range(5):
            w = Worker(port_pair(), extra)
            started.append(w)
            facts = "--no-facts" in extra or w.wait_for("hostcheck facts at", "hostcheck facts NOT served")
            if facts and "NOT served" not in str(facts) and w.listens():
                return w
            w.proc.kill()
            w.proc.wait()
            if "hostcheck facts NOT served" not in w.output() and "did not start" not in w.output():
                raise AssertionError(f"the worker did not start:\n{w.output()}")
        raise AssertionError(f"no worker started on 5 port pairs; the last said:\n{w.output()}")

    yield start
    for w in started:
        w.proc.kill()
        w.proc.wait()
        w.output()


HEAD = textwrap.dedent("""
    import json, sys
    from appliance.config import EngineConfig
    from appliance.engine.runners.llamacpp import LlamaCppRunner
    from appliance.models import embedded_model_path
    from tests.engine.test_placement import greedy
    out = {}
    for name, kw in json.loads(sys.argv[1]):
        r = LlamaCppRunner(EngineConfig(plan="off", n_slots=1, n_ctx=256, **kw), embedded_model_path(), "m")
        summary = r.placed.summary()
        out[name] = {"tokens": greedy(r)[0], "placement": summary}
    print(json.dumps(out))
""")


def head(runs: list) -> dict:
    """Run each (name, EngineConfig kwargs) in one fresh process, in order; greedy tokens and placement."""
    done = subprocess.run([sys.executable, "-c", HEAD, json.dumps(runs)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.rpc
@needs_rpc
@pytest.mark.parametrize("layers", ["all", "15"])
@cpu_only
def test_layers_on_a_worker_give_the_local_greedy_tokens_as_planned(worker, layers):
    ep, proc = worker()
    got = head([["local", {"n_gpu_layers": "0"}], ["split", {"rpc": ep, "n_gpu_layers": layers}]])
    assert got["split"]["tokens"] == got["local"]["tokens"]
    p = got["split"]["placement"]
    remote = [d for d in p["llama_devices"] if d["name"].startswith("RPC")]
    assert [d["description"] for d in remote] == [ep]
    allocated = next(v for k, v in p["allocated"].items() if k.startswith("RPC0"))
    planned = sum(p["devices"]["GPU0"]["weights"].values())
    assert abs(allocated["model"] - planned) <= max(planned // 20, 2**20), (allocated, planned)


def allocated_on(placement: dict, device: str) -> dict:
    return placement["allocated"].get(device, {})


@pytest.mark.rpc
@needs_rpc
@cpu_only
def test_layers_split_over_two_workers_give_the_local_greedy_tokens_as_planned(worker):
    """CPU, RPC0 and RPC1 hold layers (20 of 31 on the workers: their split by memory, then 1:3):
    the tokens are the local run's, and what llama.cpp allocated on each worker is what the
    planner put there, for the model and for the KV."""
    (ep0, _), (ep1, _) = worker(), worker()
    got = head([["local", {"n_gpu_layers": "0"}],
                ["split", {"rpc": f"{ep0},{ep1}", "n_gpu_layers": "20"}],
                ["shares", {"rpc": f"{ep0},{ep1}", "n_gpu_layers": "all", "tensor_split": "1,3"}]])
    for run in ("split", "shares"):
        assert got[run]["tokens"] == got["local"]["tokens"], run
        p = got[run]["placement"]
        assert p["names"] == {"GPU0": "RPC0", "GPU1": "RPC1"}
        assert [d["description"] for d in p["llama_devices"] if d["name"].startswith("RPC")] == [ep0, ep1]
        for g, name in p["names"].items():
            planned, have = p["devices"][g], allocated_on(p, name)
            for kind, want in (("model", sum(planned["weights"].values())), ("KV", planned["kv"])):
                assert want > 0 and abs(have[kind] - want) <= max(want // 20, 2**20), (run, g, kind, have, want)
        assert not [n for n in p["notes"] if "allocated" in n], p["notes"]
    kv = {run: [got[run]["placement"]["devices"][g]["kv"] for g in ("GPU0", "GPU1")] for run in ("split", "shares")}
    layer = kv["shares"][0] // 8            # 1:3 over 31: layers 0-7 on RPC0, 8-29 and the output on RPC1
    assert kv["shares"] == [8 * layer, 22 * layer]
    # 20 by (nearly) equal free memory: layers 11-20 or 11-21 on RPC0, as the two workers' free memory
    # rounds, and the rest with the output on RPC1
    assert sum(kv["split"]) == 19 * layer and kv["split"][0] in (10 * layer, 11 * layer)




@pytest.mark.rpc
@pytest.mark.vulkan
@needs_rpc
@pytest.mark.skipif(LOCAL_GPU is None, reason="no GPU of this host's beside the RPC backend (VULKAN_VENV=.venv-vkrpc "
                    "VULKAN_CMAKE_EXTRA=-DGGML_RPC=on bash scripts/vulkan_check.sh builds one, with lavapipe)")
def test_a_worker_and_a_local_gpu_share_the_layers_as_planned(worker):
    """The worker's device first, this host's GPU after it, half the layers each: what llama.cpp
    allocated on each is the plan (model and KV within 5%), and the local GPU, which takes the big
    batches (op offload), holds the planned compute buffer (within 15%, as the Vulkan tests ask)."""
    ep, _ = worker("--device", "CPU")
    got = head([["split", {"rpc": ep, "n_gpu_layers": "all", "tensor_split": "1,1"}]])
    p = got["split"]["placement"]
    assert p["names"] == {"GPU0": "RPC0", "GPU1": LOCAL_GPU} and p["split"] == {"GPU0": 0.5, "GPU1": 0.5}
    for g, name in p["names"].items():
        planned, have = p["devices"][g], allocated_on(p, name)
        for kind, want in (("model", sum(planned["weights"].values())), ("KV", planned["kv"])):
            assert want > 0 and abs(have[kind] - want) <= max(want // 20, 2**20), (g, kind, have, want)
    want, have = p["devices"]["GPU1"]["compute"], allocated_on(p, LOCAL_GPU)["compute"]
    assert abs(have - want) <= want * 0.15, (have, want)
    assert len(got["split"]["tokens"]) > 0


@pytest.mark.rpc
@needs_rpc
def test_a_worker_that_does_not_answer_is_refused_with_its_address():
    from appliance.engine.runners.llamacpp import LlamaCppRunner
    from appliance.errors import ModelLoadError
    from appliance.models import embedded_model_path

    ep = f"127.0.0.1:{free_port()}"
    with pytest.raises(ModelLoadError, match=ep.replace(".", r"\.")):
        LlamaCppRunner(EngineConfig(plan="off", n_slots=1, n_ctx=256, rpc=ep), embedded_model_path(), "m")


@pytest.mark.rpc
@needs_rpc
def test_the_worker_says_what_it_offers_and_answers_for_its_host(worker):
    from appliance import worker_facts

    w = worker()
    ep, proc = w
    facts = worker_facts.fetch(parse_endpoints(ep)[0], timeout_s=60)
    offers = LOCAL_GPU or "CPU"             # every GPU, else the CPU (rpc-server's choice)
    assert "worker" in facts, facts.get("error")
    assert facts["worker"]["endpoint"] == ep and [d["name"] for d in facts["worker"]["offers"]] == [offers]
    assert facts["snapshot"]["memory"]["total_bytes"] > 0 and facts["llama_cpp"]["devices"][0]["name"] == "CPU"
    proc.terminate()
    proc.wait(10)
    text = w.output()
    assert f"serving at {ep}" in text and f"offers {offers}" in text and "MiB free" in text
    assert f"hostcheck facts at http://127.0.0.1:{int(ep.rpartition(':')[2]) + 1}/hostcheck\n" in text


@pytest.mark.rpc
@needs_rpc
def test_a_worker_whose_facts_port_is_taken_says_so_and_the_head_says_they_are_not_its(worker):
    """Issue 68: another program on the port after the worker's RPC port. The worker says its
    facts are not served there (and serves RPC); the head, asking there, gets that program's
    answer and says it is not the worker's. With --facts-port on a free port, the head told that
    port gets the worker's facts."""
    from appliance import worker_facts
    from tests.test_worker_facts import answering

    port = port_pair()
    foreign = answering(port + 1, 200, b'{"status": "ok"}')
    try:
        w = worker(port=port)
        assert "hostcheck facts NOT served at 127.0.0.1:%d" % (port + 1) in w.output(0)
        facts = worker_facts.fetch(Endpoint("127.0.0.1", port), timeout_s=60)
        assert list(facts) == ["error"] and f"not as the worker at 127.0.0.1:{port}" in facts["error"]
    finally:
        foreign.shutdown()
        foreign.server_close()
    rpc = port_pair()
    facts_port = next(p for p in iter(port_pair, None) if p not in (rpc, rpc + 1))
    w = worker("--facts-port", str(facts_port), port=rpc)
    assert f"hostcheck facts at http://127.0.0.1:{facts_port}/hostcheck (not the RPC port + 1" in w.output(0)
    facts = worker_facts.fetch(Endpoint("127.0.0.1", rpc), timeout_s=60, facts_port=facts_port)
    assert facts.get("worker", {}).get("endpoint") == f"127.0.0.1:{rpc}", facts.get("error")


@pytest.mark.rpc
@needs_rpc
@cpu_only
def test_a_server_over_two_workers_answers_as_the_local_one_and_survives_losing_one(worker, tmp_path):
    """The appliance served over two workers (every layer on them): the local server's greedy
    reply, every device reported; then a worker killed mid-stream is an engine_crashed error, the
    server stays up and /health names the worker it cannot reach."""
    import requests

    from tests.web.conftest import running_server, wait_until

    (ep0, _), (ep1, proc1) = worker(), worker()
    chat = {"messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 24, "temperature": 0}

    def reply(srv) -> str:
        r = requests.post(srv.url + "/v1/chat/completions", json=chat, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]

    with running_server(tmp_path, "--n-ctx", "512", "--n-slots", "1") as local:
        want = reply(local)
    with running_server(tmp_path, "--rpc", f"{ep0},{ep1}", "--n-gpu-layers", "all", "--n-ctx", "512",
                        "--n-slots", "1") as srv:
        p = srv.health()["placement"]
        assert [(d["name"], d["description"]) for d in p["llama_devices"] if d["name"].startswith("RPC")] == \
            [("RPC0", ep0), ("RPC1", ep1)]
        assert p["names"] == {"GPU0": "RPC0", "GPU1": "RPC1"} and p["n_gpu_layers"] == 31
        assert all(sum(p["devices"][g]["weights"].values()) > 0 for g in ("GPU0", "GPU1"))
        assert f"RPC1 (RPC worker {ep1})" in srv.log()          # the start-up lines: what each holds
        assert reply(srv) == want
        body = {**chat, "messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 400,
                "stream": True}
        with requests.post(srv.url + "/v1/chat/completions", json=body, stream=True, timeout=60) as r:
            lines = r.iter_lines()
            next(lines)
            proc1.kill()
            rest = b"\n".join(ln for ln in lines if ln)
        assert b"engine_crashed" in rest, rest[-500:]   # llama.cpp aborts the engine; the request is told
        # the server stays up; the engine's restart is refused, and /health names the worker
        said = wait_until(lambda: ep1 in requests.get(srv.url + "/health", timeout=5).json().get("reason", ""),
                          timeout=30)
        assert said and srv.proc.poll() is None


def test_fit_rpc_refuses_what_it_cannot_plan(capsys):
    assert main(["fit", "--rpc", "127.0.0.1:1", "--host", "snap.json"]) == 2
    assert "without --host" in capsys.readouterr().err
    assert main(["fit", "--tensor-split", "1,1"]) == 2       # a share per GPU, and this host has none
    assert "one non-negative share per GPU" in capsys.readouterr().err
    assert main(["fit", "--rpc", "127.0.0.1:1"]) == 2    # no RPC build, or no worker there: said which
    assert ("-DGGML_RPC=on" if WHY else "127.0.0.1:1 does not answer") in capsys.readouterr().err


@pytest.mark.rpc
@needs_rpc
def test_fit_rpc_plans_the_workers_device_as_serve_places_it(worker):
    ep, proc = worker()
    done = subprocess.run([sys.executable, "-m", "appliance", "fit", "--rpc", ep, "--n-gpu-layers", "15", "--json"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    plan = json.loads(done.stdout)
    assert plan["n_gpu_layers"] == 15 and sum(plan["devices"]["GPU0"]["weights"].values()) > 0
