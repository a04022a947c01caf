"""The bench's side of the wire: a streaming HTTP client of the OpenAI API, and the server it
measures (one it starts, or one given by --url).

Only the OpenAI routes are required of a server; /health (engine settings, model fingerprint,
engine stats) and /tokenize (llama-server's, or llama-cpp-python's /extras/tokenize) are used
when present, so the same bench can measure llama-server or llama_cpp.server side by side.
"""
from __future__ import annotations

import contextlib
import ctypes
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import requests
import urllib3

from .timing import StreamTrace


class BenchError(RuntimeError):
    """A problem found before or during a run, with a message a person acts on."""


class CellFailed(BenchError):
    """The server refused or failed one cell's request; the run goes on without that cell."""


class ServerGone(BenchError):
    """The server stopped answering in the middle of a run."""


class _Session(requests.Session):
    """requests' Session that sends a request once more when the server had closed the kept-alive
    connection it went out on, without an answer: llama-server's HTTP library closes a
    connection after a few requests, and the next one on it failed the run. Nothing was
    answered, so nothing measured is sent twice; a server that is really gone refuses the
    second try too."""

    def request(self, *args: Any, **kwargs: Any) -> requests.Response:
        try:
            return super().request(*args, **kwargs)
        except requests.ConnectionError as e:
            if not _dropped_unanswered(e):
                raise
        return super().request(*args, **kwargs)


def _dropped_unanswered(e: requests.ConnectionError) -> bool:
    """Whether the connection was closed or reset before any answer (urllib3's ProtocolError
    around http.client's RemoteDisconnected or a reset), not refused or timed out."""
    return any(isinstance(arg, urllib3.exceptions.ProtocolError)
               and any(isinstance(x, (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError))
                       for x in arg.args) for arg in e.args)


# what this appliance's /health "engine" counts as work still to do when no request runs
IDLE_WORK = ("slots_busy", "unsettled_tokens", "unsaved_slots", "disk_queued_bytes")


class Target:
    """A server speaking the OpenAI API at `url`."""

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 900.0) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.http = _Session()
        if api_key:
            self.http.headers["Authorization"] = f"Bearer {api_key}"
        self._tokenize_route: str | None = None
        self._counts: dict[str, int] = {}
        self._token_prompts: bool | None = None
        self.server: LocalServer | None = None   # set when the bench started the server
        self.restart_command: str | None = None  # how to restart one it did not start (agent replay)

    # -- what the server is ------------------------------------------------------------------
    def health(self) -> dict[str, Any] | None:
        """/health's body when the server has one that reports a loaded model, else None."""
        try:
            r = self.http.get(self.url + "/health", timeout=10)
        except requests.RequestException:
            return None
        if r.status_code != 200:
            return None
        try:
            body = r.json()
        except ValueError:
            return None
        return body if isinstance(body, dict) else None

    def restart_with(self, command: str, timeout: float = 600.0) -> None:
        """Restart a server the bench did not start, by the user's shell command (which must
        return once the server is stopped or is starting), then wait until /v1/models answers:
        so a replay can ask what another server's restart costs it."""
        done = subprocess.run(command, shell=True, timeout=timeout)
        if done.returncode != 0:
            raise BenchError(f"--restart-command exited with code {done.returncode}: {command}")
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self.http.get(self.url + "/v1/models", timeout=5).status_code == 200:
                    return
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                raise BenchError(f"{self.url} did not answer within {timeout:.0f} s of --restart-command")
            time.sleep(0.5)

    def wait_idle(self, timeout: float = 60.0, poll_s: float = 0.1) -> bool:
        """Wait until the server has no idle-time work left (this appliance's /health: reply
        tokens to settle, states not yet handed to or written by the disk tier), so that in an
        A/B run one server's background work never runs beside the other's measurement. A
        server that reports none of it (llama-server) has nothing to wait for. Its engine's
        statistics arrive a moment late, so a slot still busy counts as work (the release that
        ends a request comes with what it left to do). False when `timeout` passed first."""
        deadline = time.monotonic() + timeout
        while True:
            engine = (self.health() or {}).get("engine")
            if not isinstance(engine, dict) or "unsettled_tokens" not in engine or not any(
                    engine.get(k) for k in IDLE_WORK):
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(poll_s)

    def model_ids(self) -> list[str]:
        try:
            r = self.http.get(self.url + "/v1/models", timeout=10)
        except requests.ConnectionError as e:
            raise BenchError(f"nothing answers at {self.url} ({_reason(e)})") from None
        except requests.RequestException as e:
            raise BenchError(f"{self.url}/v1/models failed: {_reason(e)}") from None
        if r.status_code == 401:
            raise BenchError(f"{self.url} wants an API key (--api-key)")
        if r.status_code != 200:
            raise BenchError(f"{self.url}/v1/models answered HTTP {r.status_code}: {r.text[:200]}")
        try:
            return [m["id"] for m in r.json()["data"]]
        except (ValueError, KeyError, TypeError):
            raise BenchError(f"{self.url}/v1/models is not an OpenAI model list: {r.text[:200]}") from None

    # -- tokens ------------------------------------------------------------------------------
    def tokenize(self, text: str, add_special: bool = False) -> list[int]:
        routes = [self._tokenize_route] if self._tokenize_route else ["/tokenize", "/extras/tokenize"]
        for route in routes:
            body = ({"content": text, "add_special": add_special} if route == "/tokenize"
                    else {"input": text})
            try:
                r = self.http.post(self.url + route, json=body, timeout=60)
            except requests.RequestException as e:
                raise self._gone(route, e) from None
            if r.status_code == 200:
                self._tokenize_route = route
                return list(r.json()["tokens"])
        raise BenchError(f"{self.url} has no tokenizer route (/tokenize or /extras/tokenize); "
                         "the bench needs one to build prompts of a given length")

    def detokenize(self, ids: Sequence[int]) -> str | None:
        """The text of these tokens (llama-server's /detokenize, or llama-cpp-python's
        /extras/detokenize), or None from a server with neither."""
        for route, key in (("/detokenize", "content"), ("/extras/detokenize", "text")):
            try:
                r = self.http.post(self.url + route, json={"tokens": list(ids)}, timeout=60)
            except requests.RequestException as e:
                raise self._gone(route, e) from None
            if r.status_code == 200:
                return r.json().get(key)
        return None

    def accepts_token_prompts(self, model_id: str) -> bool:
        """Whether /v1/completions takes a prompt of token ids (llama-server and ours do;
        llama-cpp-python's server does not). Asked once, with a one-token request."""
        if self._token_prompts is None:
            ids = self.tokenize("Hello", add_special=True)
            try:
                r = self.http.post(self.url + "/v1/completions", timeout=60,
                                   json={"model": model_id, "prompt": ids, "max_tokens": 1})
            except requests.RequestException as e:
                raise self._gone("/v1/completions", e) from None
            self._token_prompts = r.status_code == 200
        return self._token_prompts

    def count_tokens(self, text: str) -> int:
        if not text:
            return 0
        n = self._counts.get(text)
        if n is None:
            n = self._counts[text] = len(self.tokenize(text))
        return n

    # -- streamed requests ---------------------------------------------------------------------
    def stream(self, route: str, body: dict[str, Any],
               on_first: Callable[[], None] | None = None) -> StreamTrace:
        """POST a streamed request and time every content chunk; `on_first` is called when the
        first content arrives. An HTTP error status comes back in the trace (a needle over the
        limit expects 400); a dead server raises ServerGone."""
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        trace = StreamTrace(t_send=time.perf_counter())
        try:
            with self.http.post(self.url + route, json=body, stream=True, timeout=self.timeout) as r:
                if r.status_code != 200:
                    trace.status, trace.error = r.status_code, _error_message(r)
                    return trace
                for line in r.iter_lines():
                    if line.startswith(b"data: [DONE]"):
                        trace.t_end = trace.t_end or time.perf_counter()
                    if not line.startswith(b"data: {"):
                        continue
                    now = time.perf_counter()
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        trace.status, trace.error = 500, str(chunk["error"].get("message", chunk["error"]))
                        return trace
                    had = bool(trace.chunks)
                    _take(trace, chunk, now)
                    if on_first is not None and not had and trace.chunks:
                        on_first()
        except (requests.ConnectionError, requests.exceptions.ChunkedEncodingError) as e:
            raise self._gone(route, e) from None
        return trace

    def _gone(self, route: str, e: BaseException) -> ServerGone:
        """One wording for a server lost mid-run, whichever request found it gone (the next
        /tokenize may find it before a stream does)."""
        return ServerGone(f"the server at {self.url} stopped answering ({route}: {_reason(e)})")

    def close(self) -> None:
        self.http.close()


def _take(trace: StreamTrace, chunk: dict[str, Any], now: float) -> None:
    for choice in chunk.get("choices") or []:
        text = choice.get("text")
        if text is None:
            delta = choice.get("delta") or {}
            text = (delta.get("content") or "") + (delta.get("reasoning_content") or "")
            for call in delta.get("tool_calls") or []:
                fn = call.get("function") or {}
                text += (fn.get("name") or "") + (fn.get("arguments") or "")
        if text:
            trace.chunks.append((now, text))
        if choice.get("finish_reason"):
            trace.finish_reason = choice["finish_reason"]
            trace.t_end = now
    if chunk.get("timings"):
        trace.timings = chunk["timings"]
    if chunk.get("usage"):
        trace.usage = chunk["usage"]


def _error_message(r: requests.Response, limit: int = 300) -> str:
    try:
        text = str(r.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        text = r.text
    return text if len(text) <= limit else text[:limit] + "..."


def _reason(e: BaseException) -> str:
    text = str(e)
    for marker in ("Connection refused", "Name or service not known", "timed out", "Read timed out"):
        if marker in text:
            return marker.lower()
    return text[:200]


# -- a server the bench starts ---------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop_with_parent() -> None:
    """In the server's process before exec: SIGTERM when the bench dies (Linux's
    PR_SET_PDEATHSIG), so a bench killed outright (kill -9, a caller's timeout) leaves no server
    behind spinning on the cores; SIGTERM stops it as it stops any time."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)   # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):   # not Linux: the bench's own exit paths stop it
        pass


class LocalServer:
    """`appliance serve` in a subprocess on a free loopback port, with its own prompt-cache
    directory (unless the flags name one), its log kept for the error message if it dies."""

    def __init__(self, serve_args: Sequence[str], start_timeout: float = 600.0) -> None:
        self.serve_args = list(serve_args)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._tmp = Path(tempfile.mkdtemp(prefix="appliance-bench-"))
        self.log_path = self._tmp / "server.log"
        self._env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if not any(a.startswith("--cache-dir") for a in self.serve_args):
            self._env["APPLIANCE_CACHE_DIR"] = str(self._tmp / "prompt-cache")
        self._start_timeout = start_timeout
        self._launch()

    def _launch(self) -> None:
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "appliance", "serve", "--port", str(self.port), *self.serve_args],
                stdout=log, stderr=subprocess.STDOUT, env=self._env, start_new_session=True,
                # the death signal follows the thread that started it: the main thread's only
                preexec_fn=_stop_with_parent if threading.current_thread() is threading.main_thread() else None)
        self._wait_healthy(self._start_timeout)

    def restart(self) -> None:
        """Stop the server as SIGTERM does (idle slots' prompt states go to the disk tier) and
        start it again on the same port with the same cache directory."""
        self._terminate(120)
        self._launch()

    def _terminate(self, grace: float) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                log = self.log_tail()
                self._cleanup()
                raise BenchError(f"appliance serve {' '.join(self.serve_args)} exited with code "
                                 f"{self.proc.returncode} before it was ready:\n{log}")
            try:
                r = requests.get(self.url + "/health", timeout=2)
                # a torch engine's first start on a machine serves on torch ops while its CPU
                # kernels build, then moves to them: measured is what it serves with after
                if r.status_code == 200 and (r.json().get("settings") or {}).get("cpu_kernels") != "building":
                    return
            except (requests.RequestException, ValueError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise BenchError(f"the server did not become healthy within {timeout:.0f} s")
            time.sleep(0.2)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, n: int = 20) -> str:
        with contextlib.suppress(OSError):
            return "".join(self.log_path.read_text(errors="replace").splitlines(True)[-n:])
        return ""

    def stop(self) -> None:
        self._terminate(90)
        self._cleanup()

    def _cleanup(self) -> None:
        shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> LocalServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def serving(serve_args: Sequence[str] | None, url: str | None, api_key: str | None = None,
            restart_command: str | None = None) -> Iterator[Target]:
    """A Target for --url (restarted by `restart_command`), or for a server started with these
    flags (stopped afterwards)."""
    if url:
        target = Target(url, api_key)
        target.restart_command = restart_command
        try:
            yield target
        finally:
            target.close()
        return
    with LocalServer(serve_args or []) as server:
        target = Target(server.url, api_key)
        target.server = server
        try:
            yield target
        finally:
            target.close()
