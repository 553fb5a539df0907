"""One replica of the cluster: a `fastserve serve` process (its Engine, decode thread and watchdog: the same
process model as one server) that this Ray Serve replica starts, forwards requests to, and reports on.

    ingress ──Ray streaming handle──▶ Replica.handle(Forward) ──loopback HTTP──▶ fastserve serve (child)
                                      Replica.check_health ──GET /health──┘ (Ray Serve replaces it on failure)
                                      the report loop ──/health, /metrics──▶ Board (what the ingress aggregates)

The child listens on loopback only and dies with the replica (PR_SET_PDEATHSIG): a replica that Ray kills
takes its engine with it. Its answers pass through untouched (status, headers, body bytes, SSE events), so
the cluster speaks exactly the server's API and error shapes.
"""
from __future__ import annotations

import ctypes
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import httpx

START_TIMEOUT_S = 120.0     # the child loads the model (a few seconds for the default model)
REPORT_S = 1.0              # how often a replica tells the board its health and metrics
HEALTH_TIMEOUT_S = 5.0
PR_SET_PDEATHSIG = 1
# the report loop's own requests in the child's request log (clients' /health and /metrics are the ingress's)
REPORT_LINE = re.compile(r'"GET /(health|metrics)" 200 ')
HOP_BY_HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length", "host", "upgrade"})


@dataclass(frozen=True)
class Forward:
    """One HTTP request on its way to a replica. prompt: the text PrefixCacheAffinityRouter matches prefixes on
    (the only attribute of the two it looks for that this has: it reads `messages` first when there is one)."""
    method: str
    target: str                 # path and query
    headers: tuple              # (name, value) pairs, hop-by-hop ones left out
    body: bytes
    prompt: str


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the replica's process dies, however it dies."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


class ServerProcess:
    """`python <launcher> serve <flags> --host 127.0.0.1 --port 0 --metrics`, started and waited for; its
    stderr is copied to ours (Ray's replica log)."""

    def __init__(self, flags: list, launcher: tuple = ("-m", "fastserve")):
        cmd = [sys.executable, *launcher, "serve", *flags, "--host", "127.0.0.1", "--port", "0", "--metrics"]
        self.proc: subprocess.Popen | None = None
        self.url = None
        self._lines: list = []
        self._found = threading.Event()
        # the thread that starts the child lives as long as the child: PR_SET_PDEATHSIG fires when the thread
        # that forked it ends, not only the process
        threading.Thread(target=self._run, args=(cmd,), daemon=True, name="fastserve-child").start()
        if not self._found.wait(START_TIMEOUT_S) or self.url is None:
            self.stop()
            raise RuntimeError("the replica's fastserve serve did not start:\n" + "".join(self._lines[-30:]))

    def _run(self, cmd: list) -> None:
        """Start the child, then copy its stderr to ours until it ends, noting the address it listens on."""
        try:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                         stderr=subprocess.PIPE, preexec_fn=_die_with_parent)
        except OSError as exc:
            self._lines.append(f"{cmd[0]}: {exc}")
            self._found.set()
            return
        for raw in self.proc.stderr:
            line = raw.decode(errors="replace")
            if not REPORT_LINE.search(line):        # two a second: noise in Ray's replica log
                sys.stderr.write(line)
            if self.url is None:
                self._lines.append(line)
                m = re.search(r"listening on (http://127\.0\.0\.1:\d+)", line)
                if m:
                    self.url = m.group(1)
                    self._found.set()
        self.proc.wait()
        self._found.set()           # it ended before it listened

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()


class Replica:
    """The Ray Serve deployment's class (cluster.build wraps it): the child server, requests forwarded to it
    as a stream of (status, headers) then body chunks, its /health as Ray Serve's health check."""

    def __init__(self, flags: list, board, launcher: tuple = ("-m", "fastserve")):
        from ray import serve
        self.id = serve.get_replica_context().replica_id.unique_id
        self.server = ServerProcess(flags, launcher)
        self.client = httpx.AsyncClient(base_url=self.server.url, timeout=None,
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        self.board = board
        self.health = (True, "ok")
        self._stop = threading.Event()
        threading.Thread(target=self._report_loop, daemon=True, name="fastserve-replica-report").start()

    async def handle(self, fwd: Forward):
        """Yields (status, headers) once, then the body's bytes as the server sends them."""
        req = self.client.build_request(fwd.method, fwd.target, headers=list(fwd.headers), content=fwd.body)
        resp = await self.client.send(req, stream=True)
        try:
            yield resp.status_code, [(k, v) for k, v in resp.headers.items() if k.lower() not in HOP_BY_HOP]
            async for chunk in resp.aiter_raw():
                yield chunk
        finally:
            await resp.aclose()         # a client that went away cancels its request in the server

    def check_health(self) -> None:
        """Ray Serve's health check: the server's own /health as of the last report (its watchdog says 503 when
        the decode loop is wedged), or its exit."""
        healthy, reason = self.health
        if not healthy:
            raise RuntimeError(f"replica {self.id}: {reason}")

    def _probe(self, c: httpx.Client) -> tuple[bool, str, str]:
        """(healthy, why not, the metrics text) of the child server."""
        if not self.server.alive():
            return False, f"its fastserve serve exited ({self.server.proc.returncode})", ""
        try:
            r = c.get("/health")
            if r.status_code != 200:
                return False, _message(r), ""
            return True, "ok", c.get("/metrics").text
        except httpx.HTTPError as exc:
            return False, f"its /health did not answer: {type(exc).__name__}", ""

    def _report_loop(self) -> None:
        """Every REPORT_S, on a thread of its own: the child's health (for check_health) and metrics, to the
        board (the ingress's /health and /metrics)."""
        with httpx.Client(base_url=self.server.url, timeout=HEALTH_TIMEOUT_S) as c:
            while not self._stop.is_set():
                healthy, reason, text = self._probe(c)
                self.health = (healthy, reason)
                self.board.report.remote(self.id, {"healthy": healthy, "reason": reason, "metrics": text,
                                                   "pid": os.getpid(), "server_pid": self.server.proc.pid,
                                                   "t": time.time()})
                self._stop.wait(REPORT_S)

    def __del__(self):
        self._stop.set()
        self.server.stop()


def _message(r: httpx.Response) -> str:
    """The error message of a fastserve error answer (its JSON's error.message), or its text."""
    try:
        return r.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return r.text
