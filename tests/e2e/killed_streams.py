"""Clients that go away mid-request, and what they leave behind in the server (issue 11).

A load generator (no pytest in here, so that bench/ can import it too):
    kill_streams(host, port, n, how=...)   n streaming /completion requests, `concurrency` in flight,
                                           each ended `after_s` after it was sent:
        "rst"  close with a reset (SO_LINGER 0), no byte read
        "fin"  half-close (shutdown SHUT_WR), then read what the server still sends until it closes
        "read" read the whole response (for requests that end by themselves, e.g. by a stop string)
and what it measures:
    rss_mb(pid)                      resident set of a process, MB (/proc/PID/status VmRSS)
    census(names)                    {class name: live objects} of this process (gc.get_objects())
    InProcessServer(model, ...)      the real Engine + App + Server on a uvloop thread of THIS process,
                                     so that census() and tracemalloc see the server's objects.
"""
from __future__ import annotations

import asyncio
import gc
import heapq
import itertools
import json
import os
import selectors
import socket
import struct
import threading
import time
from collections import Counter

# The classes one HTTP request creates on its way through the server: after every request has
# ended, none of them may still be alive (beyond what the server holds for itself at rest).
REQUEST_PATH_CLASSES = (
    "HttpProtocol", "Exchange", "ServerConnection", "HttpRequest", "ProtocolFailure", "Connection",  # h11
    "Generation", "TextStream", "Delta", "StreamResponse", "Response",
    "TextReader", "Reader", "ResultBuffer", "Request", "Submit", "Cancel", "Erase",
    "Task", "Future", "TCPTransport", "_SelectorSocketTransport", "TimerHandle", "Handle",
    "async_generator", "coroutine", "frame", "traceback", "HttpError", "CancelledError",
)


def request_bytes(path: str, body: dict, extra_headers: str = "") -> bytes:
    data = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{extra_headers}"
            f"Content-Length: {len(data)}\r\n\r\n").encode() + data


def rst_close(s: socket.socket) -> None:
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()


def kill_streams(host: str, port: int, n: int, *, body: dict, how: str = "rst", concurrency: int = 8,
                 after_s: float = 0.4, path: str = "/completion", read_timeout: float = 60.0) -> dict:
    """Send n requests, `concurrency` at a time; end each as `how` says. Returns counts:
    {"sent", "bytes_read", "responses_seen"}. Bounded: every socket ends within read_timeout."""
    assert how in ("rst", "fin", "read"), how
    payload = request_bytes(path, body)
    sel = selectors.DefaultSelector()
    deadlines: list = []            # heap of (t_kill, seq, socket)
    open_socks: dict = {}           # socket -> "sent" | "draining"
    sent = read = seen = 0
    order = itertools.count()       # heap tie-breaker: sockets do not compare

    def start() -> None:
        nonlocal sent
        s = socket.create_connection((host, port), timeout=10)
        s.sendall(payload)
        s.setblocking(False)
        sent += 1
        open_socks[s] = "sent"
        if how == "read":
            sel.register(s, selectors.EVENT_READ)
            heapq.heappush(deadlines, (time.monotonic() + read_timeout, next(order), s))
        else:
            heapq.heappush(deadlines, (time.monotonic() + after_s, next(order), s))

    def end(s: socket.socket, rst: bool) -> None:
        if open_socks.pop(s, None) is None:
            return
        try:
            sel.unregister(s)
        except (KeyError, ValueError):
            pass
        rst_close(s) if rst else s.close()

    while sent < n or open_socks:
        while sent < n and len(open_socks) < concurrency:
            start()
        now = time.monotonic()
        while deadlines and deadlines[0][0] <= now:
            _, _, s = heapq.heappop(deadlines)
            state = open_socks.get(s)
            if state is None:
                continue
            if how == "rst" or state == "draining" or how == "read":
                end(s, rst=True)
            else:                   # fin: half-close, then read until the server closes
                s.shutdown(socket.SHUT_WR)
                open_socks[s] = "draining"
                sel.register(s, selectors.EVENT_READ)
                heapq.heappush(deadlines, (now + read_timeout, next(order), s))
        wait = max(0.0, deadlines[0][0] - time.monotonic()) if deadlines else 0.05
        for key, _ in sel.select(min(wait, 0.05)):
            s = key.fileobj
            try:
                data = s.recv(65536)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                data = b""
            if data:
                read += len(data)
                if b"HTTP/1.1 " in data[:16]:
                    seen += 1
                if how == "read" and data.endswith(b"0\r\n\r\n"):   # the chunked stream's end
                    end(s, rst=False)
            else:
                end(s, rst=False)
    sel.close()
    return {"sent": sent, "bytes_read": read, "responses_seen": seen}


def rss_mb(pid: int | str = "self", field: str = "VmRSS") -> float:
    """A resident-set figure of a process, MB: VmRSS (all), RssAnon (its own memory), RssFile (mapped files:
    the model's pages, which the kernel may drop and bring back as the machine needs its memory)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} for process {pid}")


def census(names=REQUEST_PATH_CLASSES) -> Counter:
    """Live objects of this process whose class name is in names, after a full collection."""
    gc.collect()
    wanted = set(names)
    return Counter(n for n in (type(o).__name__ for o in gc.get_objects()) if n in wanted)


def malloc_trim() -> None:
    """Give freed malloc memory back to the OS (glibc), to tell fragmentation from live memory."""
    import ctypes
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class InProcessServer:
    """The server (Engine + App + Server, as `fastserve serve` wires them) on a uvloop thread of this process.

    with InProcessServer(model, n_parallel=8, n_ctx=8192) as srv: srv.port ..."""

    def __init__(self, model, *, n_parallel: int = 8, n_ctx: int = 8192, threads: int = 1,
                 log_requests: bool = False, **server_config):
        from fastserve.engine import Engine
        from fastserve.server.app import App, Server
        from fastserve.server.config import ServerConfig

        self.engine = Engine(model, n_parallel=n_parallel, n_ctx=n_ctx, trace=True, threads=threads)
        cfg = ServerConfig(host="127.0.0.1", port=0, log_requests=log_requests, **server_config)
        self.app = App(self.engine, cfg, log_stream=open(os.devnull, "w"))
        self.server = Server(self.app)
        self.host, self.port = "127.0.0.1", None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="test-server-loop", daemon=True)

    def _run(self) -> None:
        import uvloop

        async def main():
            self.loop = asyncio.get_running_loop()
            self.port = await self.server.start()
            self._ready.set()
            await self.server.wait()

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(main())

    def __enter__(self):
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("the in-process server did not start")
        return self

    def census(self, names=REQUEST_PATH_CLASSES) -> Counter:
        """census() taken on the server's loop between two callbacks (its timers are then as at rest)."""
        async def take():
            return census(names)
        return asyncio.run_coroutine_threadsafe(take(), self.loop).result(30)

    def idle(self, timeout: float = 10.0) -> bool:
        """Wait until no request runs, waits or is in flight, and no connection is open."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            snap = self.engine.snapshot
            if not (snap.busy or self.app.inflight or self.app.connections or self.engine.stats().n_inbox):
                return True
            time.sleep(0.02)
        return False

    def __exit__(self, *exc):
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.server.stop)
        self._thread.join(10)
        self.engine.close(timeout=2)
        self.app.log.close()
