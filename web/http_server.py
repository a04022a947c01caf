"""waitress, held to account for slow and silent clients.

waitress reads requests on its one async loop and gives a worker thread only a request that has
arrived whole, so a client that stalls while sending costs a socket, not a thread. Left as they
are, three things still let slow clients lock everyone else out:

- **The connection limit.** Past `connection_limit` open sockets waitress stops accepting, and a
  new client waits in the listen backlog until an idle one times out (`channel_timeout`, 120 s).
  Two hundred half-open connections (a request line, then silence) were enough. Here, a pending
  connection at the limit closes the connections that have been quiet longest among those with
  no request running (idle keep-alives, or ones still sending their request), the way nginx
  reuses keep-alive connections when it runs out.
- **A request that never finishes arriving.** waitress closes a connection only after
  `channel_timeout` without any byte, so a client that trickles a byte now and then holds its
  socket forever. Here a request must arrive whole (headers and body) within `request_timeout`
  of its first byte; past it the client gets a 408 and the connection is closed.
- **A reader that stops reading.** A streamed reply to a client that reads nothing piles up in
  the kernel's socket buffers (a megabyte or more on Linux), then in waitress's, and the writing
  thread blocks once 16 MiB are queued there: the request holds its thread and its engine slot
  for as long as the client stays connected. Here a connection whose client has acknowledged
  none of the waiting reply for `send_timeout` (the kernel's unacknowledged queue counts, read
  with SIOCOUTQ) is closed; the handler sees the client gone and aborts the request, which
  frees its slot within one step.

The checks run on the async loop every `CHECK_INTERVAL_S` (waitress's `maintenance` hook), so
no timer thread touches a channel.
"""
from __future__ import annotations

import json
import logging
import select
import struct
import sys
import time
from typing import Any, Callable

from waitress.adjustments import Adjustments
from waitress.channel import HTTPChannel
from waitress.server import TcpWSGIServer
from waitress.task import ThreadedTaskDispatcher

log = logging.getLogger("appliance.server")

if sys.platform.startswith("linux"):
    import fcntl
    import termios
    _SIOCOUTQ: int | None = termios.TIOCOUTQ  # the same request number for sockets
else:  # pragma: no cover
    _SIOCOUTQ = None

CHECK_INTERVAL_S = 1.0  # how often the loop looks for stalled requests and stalled readers

_TIMEOUT_BODY = json.dumps({"error": {
    "message": "the request did not arrive whole in time; the connection is closed",
    "type": "invalid_request_error", "param": None, "code": "request_timeout"}}).encode()
REQUEST_TIMEOUT_RESPONSE = (b"HTTP/1.1 408 Request Timeout\r\nConnection: close\r\n"
                            b"Content-Type: application/json\r\n"
                            b"Content-Length: " + str(len(_TIMEOUT_BODY)).encode() + b"\r\n\r\n" + _TIMEOUT_BODY)


class Channel(HTTPChannel):
    """One client connection, which knows when its current request began to arrive and since
    when its client has accepted none of the reply waiting for it."""

    request_started: float | None = None   # first byte of the request being read (no request running)
    bytes_sent = 0                         # handed to the kernel
    acked = 0                              # of which the client acknowledged
    stalled_since: float | None = None     # reply waiting, and nothing more acknowledged since

    def received(self, data: bytes) -> bool:
        if self.request is None and data:
            self.request_started = time.monotonic()
        done = super().received(data)
        if self.request is None:        # every request in `data` arrived whole
            self.request_started = None
        return done

    def send(self, data: bytes, do_close: bool = True) -> int:
        sent = super().send(data, do_close=do_close)
        self.bytes_sent += sent or 0
        return sent

    def check_stall(self, now: float) -> float:
        """Seconds since the client last accepted any of the reply while some of it was waiting
        (in waitress's buffer, or sent but not acknowledged: the kernel's queue), 0 when nothing
        waits. The kernel's queue counts: a client that reads nothing fills a megabyte or more
        of socket buffers before waitress's own buffer holds a byte."""
        queued = _unacknowledged(self.socket)
        if not (queued or self.total_outbufs_len):
            self.stalled_since = None
            return 0.0
        acked = self.bytes_sent - queued
        if self.stalled_since is None or acked != self.acked:
            self.acked, self.stalled_since = acked, now
        return now - self.stalled_since

    def busy(self) -> bool:
        """A request is queued for or running in a worker thread."""
        return bool(self.requests)

    def time_out_request(self) -> None:
        """Answer 408 to a request that is taking too long to arrive, and close after it."""
        with self.outbuf_lock:
            self.request = None
            self.outbufs[-1].append(REQUEST_TIMEOUT_RESPONSE)
            self.total_outbufs_len += len(REQUEST_TIMEOUT_RESPONSE)
            self.current_outbuf_count += len(REQUEST_TIMEOUT_RESPONSE)
            self.close_when_flushed = True
        self.request_started = None


class Server(TcpWSGIServer):
    """A listening socket whose loop enforces the request and send timeouts, and which makes
    room at the connection limit by closing the quietest idle connections."""

    channel_class = Channel

    def __init__(self, *args: Any, request_timeout: float, send_timeout: float, **kw: Any) -> None:
        self.request_timeout, self.send_timeout = request_timeout, send_timeout
        super().__init__(*args, **kw)

    def maintenance(self, now: float) -> None:
        super().maintenance(now)  # waitress's: idle keep-alive connections past channel_timeout
        mono = time.monotonic()
        for channel in list(self.active_channels.values()):
            if not isinstance(channel, Channel) or channel.will_close:
                continue
            stalled = channel.check_stall(mono)
            if stalled > self.send_timeout:
                log.warning("closing the connection from %s: it read nothing for %.0f s (its request, if "
                            "any, is cancelled)", _peer(channel), stalled)
                channel.will_close = True
                self.pull_trigger()
            elif (channel.request_started is not None and not channel.busy()
                  and mono - channel.request_started > self.request_timeout):
                log.info("408 to %s: its request did not arrive whole within %.0f s",
                         _peer(channel), self.request_timeout)
                channel.time_out_request()

    def make_room(self) -> None:
        """At the connection limit with a client waiting to connect, close the connections quiet
        longest among those with no request running: an eighth of the limit, so a crowd of new
        clients gets in without a wait per client. Called by the serve loop between polls: a
        socket closed while a poll is being set up could have its descriptor reused by the next
        accept and the new connection take the old one's events."""
        if not (self.accepting and len(self._map) >= self.adj.connection_limit and self._connection_waiting()):
            return
        idle = sorted((c for c in self._map.values() if isinstance(c, Channel) and not c.busy() and not c.will_close),
                      key=lambda c: c.last_activity)
        victims = idle[: max(1, self.adj.connection_limit // 8)]
        if not victims:
            return  # every connection is serving a request: waitress stops accepting until one ends
        log.info("at the connection limit (%d): closing %d idle connections (%s first) to admit new ones",
                 self.adj.connection_limit, len(victims), _peer(victims[0]))
        for channel in victims:
            channel.handle_close()

    def _connection_waiting(self) -> bool:
        try:
            ready, _, _ = select.select([self.socket], [], [], 0)
        except (OSError, ValueError):
            return False
        return bool(ready)


def _unacknowledged(sock) -> int:
    """Bytes in the socket's send queue not yet acknowledged by the peer (Linux's SIOCOUTQ);
    0 where the platform cannot tell, and then only waitress's own buffer shows a stall."""
    if _SIOCOUTQ is None or sock is None:
        return 0
    try:
        return struct.unpack("i", fcntl.ioctl(sock.fileno(), _SIOCOUTQ, b"\0\0\0\0"))[0]
    except (OSError, ValueError):
        return 0


def _peer(channel: HTTPChannel) -> str:
    addr = channel.addr
    return f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) and len(addr) >= 2 else str(addr)


def create(app: Callable, listen: str, *, threads: int, connection_limit: int, request_timeout: float,
           send_timeout: float) -> tuple[dict, list[Server], ThreadedTaskDispatcher]:
    """One `Server` per listen address, sharing one socket map and one thread pool (what
    waitress's `create_server` builds, with these classes). Raises OSError or ValueError for an
    address this host lacks or a port in use."""
    adj = Adjustments(listen=listen, threads=threads, channel_request_lookahead=4,
                      connection_limit=connection_limit, cleanup_interval=CHECK_INTERVAL_S,
                      ident="appliance")
    socket_map: dict = {}
    dispatcher = ThreadedTaskDispatcher()
    dispatcher.set_thread_count(adj.threads)
    servers: list[Server] = []
    try:
        for sockinfo in adj.listen:
            servers.append(Server(app, socket_map, dispatcher=dispatcher, adj=adj, sockinfo=sockinfo,
                                  request_timeout=request_timeout, send_timeout=send_timeout))
    except Exception:
        for s in servers:
            s.close()
        dispatcher.shutdown()
        raise
    return socket_map, servers, dispatcher


def raise_fd_limit(wanted: int) -> int:
    """Raise this process's open-file limit towards `wanted` (up to the hard limit); the limit
    now in force."""
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft if soft != resource.RLIM_INFINITY else wanted
