"""A local HTTP server that speaks the part of the Hugging Face Hub's API a pull uses, for
`HF_ENDPOINT`: the recursive tree listing (sizes, LFS sha256), model info (the commit), and
`resolve` downloads with Range. It can cut a transfer after some bytes, stall one, or serve
bytes other than the ones it lists (a corrupted transfer). Nothing leaves the machine."""
from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@dataclass
class FakeHub:
    repos: dict[str, dict[str, bytes]] = field(default_factory=dict)
    cut_after: dict[str, int] = field(default_factory=dict)      # path -> bytes sent before the connection drops (once)
    stall_after: dict[str, int] = field(default_factory=dict)    # path -> bytes sent before it stalls (until stopped)
    corrupt: set[str] = field(default_factory=set)               # paths served with a flipped byte
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)  # (method, path, Range)
    stalled: threading.Event = field(default_factory=threading.Event)          # a stall has begun
    url: str = ""

    def add(self, repo: str, files: dict[str, bytes]) -> None:
        self.repos.setdefault(repo, {}).update(files)

    def downloads(self, path: str) -> list[str | None]:
        """The Range header of each GET of `path`'s resolve URL (None: the whole file)."""
        return [rng for m, p, rng in self.requests if m == "GET" and "/resolve/" in p and p.endswith("/" + path)]


def _tree(files: dict[str, bytes]) -> list[dict]:
    out = []
    for path, data in sorted(files.items()):
        sha = hashlib.sha256(data).hexdigest()
        out.append({"type": "file", "path": path, "size": len(data), "oid": hashlib.sha1(data).hexdigest(),
                    "lfs": {"oid": sha, "size": len(data), "pointerSize": 134}})
    return out


def make_handler(hub: FakeHub, stop: threading.Event):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass

        def _json(self, obj, status=200) -> None:
            body = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _error(self, status: int, code: str) -> None:
            body = json.dumps({"error": code}).encode()
            self.send_response(status)
            self.send_header("X-Error-Code", code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_HEAD(self) -> None:
            self._serve(head=True)

        def do_GET(self) -> None:
            self._serve(head=False)

        def _serve(self, head: bool) -> None:
            path = unquote(urlsplit(self.path).path)
            hub.requests.append((self.command, path, self.headers.get("Range")))
            if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)(/.*)?", path):
                repo = hub.repos.get(m[1])
                return self._json(_tree(repo)) if repo is not None else self._error(404, "RepoNotFound")
            if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)(/revision/[^/]+)?", path):
                repo = hub.repos.get(m[1])
                if repo is None:
                    return self._error(404, "RepoNotFound")
                return self._json({"id": m[1], "sha": COMMIT, "siblings": [{"rfilename": p} for p in repo]})
            if m := re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path):
                repo = hub.repos.get(m[1])
                if repo is None:
                    return self._error(404, "RepoNotFound")
                if m[3] not in repo:
                    return self._error(404, "EntryNotFound")
                return self._file(m[3], repo[m[3]], head)
            self._error(404, "RepoNotFound")

        def _file(self, name: str, data: bytes, head: bool) -> None:
            sha = hashlib.sha256(data).hexdigest()
            if name in hub.corrupt:
                data = data[:-1] + bytes([data[-1] ^ 0xFF])     # the header reads fine
            start, end = 0, len(data) - 1
            rng = self.headers.get("Range")
            if rng and (m := re.fullmatch(r"bytes=(\d+)-(\d*)", rng)):
                start, end = int(m[1]), min(int(m[2]) if m[2] else len(data) - 1, len(data) - 1)
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
            else:
                self.send_response(200)
            body = data[start:end + 1]
            self.send_header("Content-Length", str(len(body)))
            self.send_header("ETag", f'"{sha}"')
            self.send_header("X-Linked-Etag", f'"{sha}"')
            self.send_header("X-Linked-Size", str(len(data)))
            self.send_header("X-Repo-Commit", COMMIT)
            self.send_header("Accept-Ranges", "bytes")
            self.end_headers()
            if head:
                return
            cut = hub.cut_after.get(name)
            stall = hub.stall_after.get(name)
            if cut is not None and cut - start < len(body):
                del hub.cut_after[name]                         # once
                self.wfile.write(body[:max(cut - start, 0)])
                self.wfile.flush()
                self.close_connection = True
                return
            if stall is not None and stall - start < len(body):
                self.wfile.write(body[:max(stall - start, 0)])
                self.wfile.flush()
                hub.stalled.set()
                while not stop.is_set():
                    time.sleep(0.05)
                self.close_connection = True
                return
            self.wfile.write(body)

    return Handler


class HubServer:
    def __init__(self, hub: FakeHub) -> None:
        self.hub, self.stop = hub, threading.Event()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(hub, self.stop))
        self.httpd.daemon_threads = True
        hub.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.stop.set()
        self.httpd.shutdown()
        self.httpd.server_close()
