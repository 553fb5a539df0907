"""Load from outside the server, over raw sockets: shared by bench_http.py, bench_vs_llama.py and soak.py.

- ServerProcess: a server subprocess (fastserve or llama-server) on a loopback port; the time from
  start to the first /health 200; its RSS from /proc (RssSampler samples it on a thread).
- HTTP/1.1 on asyncio streams: a response head, its body de-chunked, its SSE events.
- stream_completion: one streaming /completion, with the arrival time of each token.
- closed_loop: N clients that send the next request as soon as one ends, /health probed beside them
  from a child process (Prober).

The clients are raw asyncio sockets (uvloop where installed) in the calling process, to keep the
load generator light: it shares the machine's cores with the server. Times: time.perf_counter().
"""
from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import orjson

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from fastserve.bench import LoadResult  # noqa: E402

MIB = 1024 * 1024


# -- the server process ----------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_bytes(pid: int) -> int:
    """Resident set size of a process (VmRSS), bytes; 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


def fastserve_command(model: str, port: int, n_parallel: int, n_ctx: int, threads: int | None,
                      *extra: str) -> list[str]:
    """`fastserve serve` argv (with --metrics: the benchmarks read /metrics); threads None: its default -t."""
    t = [] if threads is None else ["-t", str(threads)]
    return [sys.executable, "-m", "fastserve", "serve", "-m", model, "--host", "127.0.0.1", "--port", str(port),
            "-np", str(n_parallel), "-c", str(n_ctx), "--metrics", *t, *extra]


class ServerProcess:
    """A server started with `cmd`, listening on 127.0.0.1:port; stderr and stdout go to log_path.

    ready_s: seconds from the start of the process to the first /health 200."""

    def __init__(self, cmd: list[str], port: int, log_path: str | os.PathLike, start_timeout: float = 180.0):
        self.port, self.log_path = port, Path(log_path)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        self._log = open(self.log_path, "wb")
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=str(REPO))
        self.pid = self.proc.pid
        try:
            self.ready_s = self._wait_healthy(t0, start_timeout)
        except BaseException:
            self.kill()
            raise

    def _wait_healthy(self, t0: float, timeout: float) -> float:
        while time.perf_counter() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.proc.args[0]} exited with {self.proc.returncode} before /health "
                                   f"answered 200; its log:\n{self.log()[-4000:]}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1.0) as s:
                    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                    if s.recv(64).startswith((b"HTTP/1.1 200", b"HTTP/1.0 200")):
                        return time.perf_counter() - t0
            except OSError:
                pass
            time.sleep(0.01)
        raise RuntimeError(f"no /health 200 within {timeout:g} s; the log:\n{self.log()[-4000:]}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def rss(self) -> int:
        return rss_bytes(self.pid)

    def stop(self, sig=signal.SIGTERM, timeout: float = 15.0) -> tuple[int | None, float]:
        """Send sig and wait: (exit code, or None when it had to be killed; seconds it took)."""
        t0 = time.perf_counter()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            rc = None
        dt = time.perf_counter() - t0
        self.kill()
        return rc, dt

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()


class RssSampler:
    """Samples a process's RSS every `every` seconds on a daemon thread: samples = [(t, bytes)]."""

    def __init__(self, pid: int, every: float = 0.2):
        self.pid, self.every = pid, every
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.perf_counter(), rss_bytes(self.pid)))
            self._stop.wait(self.every)

    def peak(self, t_from: float = 0.0, t_to: float = float("inf")) -> int:
        return max((b for t, b in self.samples if t_from <= t <= t_to), default=0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


# -- HTTP/1.1 on asyncio streams -------------------------------------------------------------

def post_request(path: str, body: dict, headers: str = "") -> bytes:
    data = orjson.dumps(body)
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{headers}"
            f"Content-Length: {len(data)}\r\n\r\n").encode() + data


async def read_head(reader: asyncio.StreamReader) -> tuple[int, dict]:
    """(status, {lower-case header name: value}) of the next response."""
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    status = int(head[0].split()[1])
    headers = {}
    for line in head[1:]:
        if ":" in line:
            k, v = line.split(":", 1)
            headers[k.strip().lower()] = v.strip()
    return status, headers


async def body_chunks(reader: asyncio.StreamReader, headers: dict):
    """The body's bytes as they arrive: de-chunked, or Content-Length of them, or up to EOF."""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0].strip(), 16)
            if size == 0:
                while await reader.readuntil(b"\r\n") != b"\r\n":     # trailers, then the blank line
                    pass
                return
            yield (await reader.readexactly(size + 2))[:-2]
    elif "content-length" in headers:
        left = int(headers["content-length"])
        while left > 0:
            data = await reader.read(min(left, 1 << 16))
            if not data:
                raise asyncio.IncompleteReadError(b"", left)
            left -= len(data)
            yield data
    else:
        while data := await reader.read(1 << 16):
            yield data


async def read_body(reader: asyncio.StreamReader, headers: dict) -> bytes:
    return b"".join([c async for c in body_chunks(reader, headers)])


async def sse_data(chunks):
    """The `data:` payload (bytes) of each server-sent event, whatever the chunk boundaries."""
    buf = b""
    async for data in chunks:
        buf += data
        while (i := buf.find(b"\n\n")) >= 0:
            event, buf = buf[:i], buf[i + 2:]
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    yield line[5:].strip()


async def get(reader, writer, path: str) -> tuple[int, bytes]:
    """GET on a kept-alive connection: (status, body)."""
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    status, headers = await read_head(reader)
    return status, await read_body(reader, headers)


async def get_once(port: int, path: str) -> tuple[int, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        return await get(reader, writer, path)
    finally:
        writer.close()


async def post_once(port: int, path: str, body: dict) -> tuple[int, bytes]:
    """POST a JSON body on a new connection: (status, response body)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(post_request(path, body))
        status, headers = await read_head(reader)
        return status, await read_body(reader, headers)
    finally:
        writer.close()


# -- one streaming completion ----------------------------------------------------------------

@dataclass
class Stream:
    """One streaming request as the client saw it. arrivals: [(time, tokens that arrived then)]."""
    t_sent: float
    status: int = 0
    arrivals: list = field(default_factory=list)
    final: dict | None = None          # the last event (stop: true), when it came

    @property
    def n_tokens(self) -> int:
        return sum(k for _, k in self.arrivals)


async def stream_completion(port: int, body: dict, out: Stream | None = None, path: str = "/completion") -> Stream:
    """POST a streaming llama.cpp /completion; token counts from each event's tokens_predicted.
    Fills `out` as events come, so that a cancelled caller keeps what arrived."""
    out = out or Stream(0.0)
    out.t_sent = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(post_request(path, {**body, "stream": True}))
        out.status, headers = await read_head(reader)
        if out.status != 200:
            await read_body(reader, headers)
            return out
        n = 0
        async for data in sse_data(body_chunks(reader, headers)):
            if data == b"[DONE]":
                continue
            ev = orjson.loads(data)
            if ev.get("stop"):
                out.final = ev
                continue
            k = ev.get("tokens_predicted", n + 1) - n
            if k > 0:
                out.arrivals.append((time.perf_counter(), k))
                n += k
        return out
    finally:
        writer.close()


# -- closed-loop load ------------------------------------------------------------------------

class Prober:
    """GET `path` every `every` s from a child process (bench/health_probe.py), so that this process's busy
    event loop adds nothing to the latencies; stop() -> [(t_sent perf_counter, seconds, status 0 = failed)]."""

    def __init__(self, port: int, path: str, every: float = 0.1):
        self._out = tempfile.NamedTemporaryFile(prefix="probe-", suffix=".json", delete=False).name
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("health_probe.py")), str(port),
                                      path, str(every), self._out])

    def stop(self, timeout: float = 40.0) -> list:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise RuntimeError(f"the probe did not stop within {timeout:g} s of SIGTERM: a GET hung")
        try:
            return [tuple(x) for x in orjson.loads(Path(self._out).read_bytes())]
        finally:
            os.unlink(self._out)


@dataclass
class LoadWindow:
    """What closed_loop measured: the LoadResult row, {probed path: latencies (s) of its 200s in the window},
    the window's bounds, at_window's results, and the failed requests by kind ('http 503', 'ConnectionResetError')."""
    result: LoadResult
    probes: dict
    t_measure: float
    t_end: float
    marks: list
    errors: dict


async def closed_loop(port: int, prompts: list, clients: int, seconds: float, warmup_s: float,
                      n_predict: int = 128, at_window=None, extra: dict | None = None,
                      probes: tuple = ("/health",)) -> LoadWindow:
    """`clients` closed-loop clients of greedy streaming /completion requests (prompts as token ids),
    measured over `seconds` after `warmup_s`; each of `probes` polled at 10 Hz beside them (Prober). Tokens/s, TTFT and
    inter-token gaps are the client's own: tokens that arrived in the window, TTFT of the requests whose
    first token came in it, gaps that ended in it. At the window's end the clients are cancelled
    (their connections closed). at_window: an async callable awaited at the window's start and end,
    its results returned in marks."""
    t_measure = time.perf_counter() + warmup_s
    stop_at = t_measure + seconds
    res = LoadResult(clients, seconds, 0, 0)
    body = {"n_predict": n_predict, "temperature": 0, "cache_prompt": False, **(extra or {})}

    def account(s: Stream) -> None:
        last = s.t_sent
        for i, (t, k) in enumerate(s.arrivals):
            if t_measure <= t <= stop_at:
                res.tokens += k
                if i == 0:
                    res.requests += 1
                    res.ttft.append(t - s.t_sent)
                else:
                    res.gaps.extend([(t - last) / k] * k)
            last = t

    errors: dict = {}

    async def client(k: int) -> None:
        i = k
        while time.perf_counter() < stop_at:
            s = Stream(time.perf_counter())
            try:
                await stream_completion(port, {**body, "prompt": prompts[i % len(prompts)]}, s)
                if s.status != 200:
                    errors[f"http {s.status}"] = errors.get(f"http {s.status}", 0) + 1
            except asyncio.CancelledError:
                return
            except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
                errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
                await asyncio.sleep(0.1)
            finally:
                account(s)
            i += clients

    tasks = [asyncio.create_task(client(k)) for k in range(clients)]
    probers = {path: Prober(port, path) for path in probes}
    marks = []
    await asyncio.sleep(max(0.0, t_measure - time.perf_counter()))
    if at_window is not None:
        marks.append(await at_window())
    await asyncio.sleep(max(0.0, stop_at - time.perf_counter()))
    if at_window is not None:
        marks.append(await at_window())
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks)
    res.seconds = seconds
    probed = {path: p.stop() for path, p in probers.items()}
    in_window = {path: [d for t0, d, st in out if t_measure <= t0 <= stop_at and st == 200]
                 for path, out in probed.items()}
    return LoadWindow(res, in_window, t_measure, stop_at, marks, errors)


def pct_ms(xs, q) -> float:
    return float(np.percentile(xs, q)) * 1e3 if len(xs) else float("nan")


class HttpTokenizer:
    """A server's /tokenize as a tokenizer (`encode(text, add_special)`), for fastserve.bench.make_prompts."""

    def __init__(self, port: int):
        self.port = port

    def encode(self, text: str, add_special: bool = False) -> list[int]:
        status, body = asyncio.run(post_once(self.port, "/tokenize", {"content": text, "add_special": add_special}))
        if status != 200:
            raise RuntimeError(f"/tokenize answered {status}: {body[:200]!r}")
        return orjson.loads(body)["tokens"]


def metric_values(text: str, name: str) -> dict:
    """{label string: value} of every sample of `name` in a Prometheus text page ('' for no labels)."""
    pat = re.compile(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", re.M)
    return {m.group(1) or "": float(m.group(2)) for m in pat.finditer(text)}
