"""A standing soak of `fastserve serve`: 32 clients for minutes, misbehaving at random (issue 11, item 4).

One server (the default model or -m; -np 32 -c 16384, --timeout 10, 16 MiB of prompt cache) and 32
closed-loop clients in this process. Each request picks at random:
- how it ends: read to the end (streaming or not), cut by an RST or a FIN after a random delay,
  half-closed (FIN) right after it is sent, or never read (a 4 kB receive buffer) and then closed,
  some of those held past --timeout until the server drops them;
- its route (/completion mostly, /v1/completions, /v1/chat/completions) and sampling settings
  (greedy, or temperature with top-k/top-p/min-p/penalties/seed; n_probs and stop strings sometimes);
- its prompt: one of six shared prefixes and a random tail, so that prompt-cache hits happen.
Some clients erase the slot of their completed request (POST /slots/{id}?action=erase). Beside them:
/health at 10 Hz (from a child process), /metrics every 2 s and the server's RSS (from /proc) every second.
Before the clocked part, a warm-up of 32 prompts of ~360 tokens (8 at a time) writes every slot's KV cache
further than the soak's requests reach (prompt + n_predict <= ~320), so that the first touch of the
preallocated KV pages does not read as growth; RSS is reported before and after it.

Reports, over the run and per window (a tenth of it): requests by outcome, errors by kind (5xx
must be 0; any 4xx, hang, protocol error or lost connection is an error too), the server's own
count of 5xx (fastserve_http_requests_total), RSS over time (figures, and a PNG with --plot),
/health p50/p99 and step-time p99 (from the fastserve_step_seconds histogram); after the load:
slots left busy, RSS after 10 s idle, and the exit code and time of SIGTERM.
Exit status 1 when a failure was seen (5xx, hang, error, held slot, bad exit), else 0. RSS growth
is reported, not judged: tests/e2e/test_soak.py judges the 3-minute form (`make test`).

Run: python bench/soak.py [--minutes 30] [--json soak.json] [--plot soak.png] [-m MODEL] [--seed 0]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import socket
import struct
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))

from httpload import (MIB, Prober, RssSampler, ServerProcess, body_chunks, fastserve_command,  # noqa: E402
                      free_port, get, get_once, metric_values, post_once, post_request, read_body, read_head,
                      sse_data)

from fastserve.bench import SENTENCES  # noqa: E402

N_PARALLEL, N_CTX, CLIENTS = 32, 16384, 32
SERVER_TIMEOUT_S = 10          # --timeout: a connection that reads nothing this long is dropped
CACHE_RAM_MIB = 16             # small, so that its pool is full (all its pages touched) early on
ERASE_SHARE = 0.08             # completed /completion requests whose client then erases their slot
WARM_PROMPT_SENTENCES = 18     # ~360 tokens (of 512 a slot): every slot's KV written beyond what the soak uses (<= ~330)
WARM_WAVE = 8                  # warm-up requests at a time (the least recently used slots take each wave): all 32
                               # at once would wait past --token-timeout for their first token on a busy machine
IDLE_READ_S = 60.0             # a stream that sends nothing this long counts as hung
WHOLE_ANSWER_S = 300.0         # an answer sent in one piece (non-streaming, erase) that takes this long: hung
DROP_GRACE_S = 20.0            # past --timeout + 3 s, time a never-read request of 8 tokens may still take
N_WINDOWS = 10
ENDINGS = {"read": 0.45, "read_json": 0.12, "rst": 0.1, "fin": 0.1, "half_close": 0.06, "never_read": 0.1,
           "never_read_dropped": 0.07}
ROUTES = {"/completion": 0.75, "/v1/completions": 0.1, "/v1/chat/completions": 0.15}


def make_prefixes(rng, n: int = 6) -> list[str]:
    return [" ".join(SENTENCES[i] for i in rng.choice(len(SENTENCES), 4, replace=False)) for _ in range(n)]


def sampling(rng) -> dict:
    """Random sampling settings, in llama.cpp's field names (OpenAI's routes take them too)."""
    if rng.random() < 0.3:
        return {"temperature": 0}
    s = {"temperature": round(float(rng.uniform(0.2, 1.5)), 2), "seed": int(rng.integers(0, 2 ** 31 - 1))}
    if rng.random() < 0.5:
        s["top_k"] = int(rng.choice([1, 5, 40, 100]))
    if rng.random() < 0.5:
        s["top_p"] = round(float(rng.uniform(0.5, 1.0)), 2)
    if rng.random() < 0.3:
        s["min_p"] = round(float(rng.uniform(0.0, 0.2)), 3)
    if rng.random() < 0.3:
        s["repeat_penalty"] = round(float(rng.uniform(1.0, 1.3)), 2)
    if rng.random() < 0.2:
        s["presence_penalty"] = round(float(rng.uniform(0.0, 0.5)), 2)
        s["frequency_penalty"] = round(float(rng.uniform(0.0, 0.5)), 2)
    return s


def make_request(rng, prefixes: list[str], stream: bool) -> tuple[str, dict]:
    """(route, body) of one random request."""
    route = str(rng.choice(list(ROUTES), p=list(ROUTES.values())))
    prefix = prefixes[int(rng.integers(len(prefixes)))]
    tail = " ".join(SENTENCES[int(i)] for i in rng.integers(0, len(SENTENCES), int(rng.integers(1, 3))))
    tail += f" ({int(rng.integers(10 ** 6))})"
    n = int(rng.integers(8, 161))
    body = {"stream": stream, **sampling(rng)}
    if rng.random() < 0.2:
        body["stop"] = [str(rng.choice(["\n\n", ".", "!", " the"]))]
    if route == "/completion":
        body.update(prompt=prefix + " " + tail, n_predict=n)
        if rng.random() < 0.2:
            body["n_probs"] = int(rng.choice([1, 3, 5]))
    elif route == "/v1/completions":
        body.update(model="soak", prompt=prefix + " " + tail, max_tokens=n)
        if rng.random() < 0.2:
            body["logprobs"] = int(rng.choice([1, 3]))
    else:
        body.update(model="soak", max_tokens=n, messages=[{"role": "system", "content": prefix},
                                                         {"role": "user", "content": tail}])
    return route, body


class IdleTimeoutReader:
    """A StreamReader whose every read fails with TimeoutError after `timeout` s with no byte."""

    def __init__(self, reader: asyncio.StreamReader, timeout: float):
        self.r, self.timeout = reader, timeout

    async def readuntil(self, sep=b"\n"):
        return await asyncio.wait_for(self.r.readuntil(sep), self.timeout)

    async def readexactly(self, n):
        return await asyncio.wait_for(self.r.readexactly(n), self.timeout)

    async def read(self, n=-1):
        return await asyncio.wait_for(self.r.read(n), self.timeout)


class Soak:
    def __init__(self, port: int, seconds: float, seed: int):
        self.port = port
        self.t0 = time.perf_counter()
        self.stop_at = self.t0 + seconds
        self.window_s = seconds / N_WINDOWS
        self.rng = np.random.default_rng(seed)
        self.prefixes = make_prefixes(self.rng)
        self.outcomes: dict[str, int] = {}       # "completed /completion stream", "cut rst", ...
        self.errors: dict[str, int] = {}         # "5xx /completion 503", "hang /v1/completions", ...
        self.examples: dict[str, str] = {}       # one example message per error kind
        self.per_window = [dict() for _ in range(N_WINDOWS + 1)]   # outcomes per window
        self.cache = {"cache_n": 0, "prompt_n": 0}
        self.health: list = []                   # (t_sent, seconds, status)
        self.scrapes: list = []                  # (t, /metrics text)
        self.loadavg: list = []                  # (t, the machine's 1-minute load average)

    # -- bookkeeping ---------------------------------------------------------------------

    def window(self, t: float) -> int:
        return min(N_WINDOWS, max(0, int((t - self.t0) / self.window_s)))

    def outcome(self, kind: str) -> None:
        self.outcomes[kind] = self.outcomes.get(kind, 0) + 1
        w = self.per_window[self.window(time.perf_counter())]
        w[kind] = w.get(kind, 0) + 1

    def error(self, kind: str, detail: str = "") -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1
        self.examples.setdefault(kind, detail[:300])
        self.outcome("error")

    def check_status(self, route: str, status: int, body: bytes) -> bool:
        if status == 200:
            return True
        self.error(f"{'5xx' if status >= 500 else f'{status // 100}xx'} {route} {status}",
                   body.decode(errors="replace"))
        return False

    # -- one request ---------------------------------------------------------------------

    async def read_response(self, reader, route: str, stream: bool, done: dict) -> str:
        """Read one whole response; the outcome kind, or raise. A stream must end with its last event.
        done: gets the last event's (or the body's) fields."""
        status, headers = await read_head(reader)
        if not stream or status != 200:
            body = await read_body(reader, headers)
            if not self.check_status(route, status, body):
                return "error"
            doc = orjson.loads(body)
            if "content" not in doc and "choices" not in doc:
                self.error(f"bad body {route}", body.decode(errors="replace"))
                return "error"
            self.count_cache(doc)
            done.update(doc)
            return "completed"
        last = None
        async for data in sse_data(body_chunks(reader, headers)):
            if data == b"[DONE]":
                last = data
                continue
            ev = orjson.loads(data)
            if "error" in ev:
                self.error(f"error event {route}", data.decode(errors="replace"))
                return "error"
            last = ev
            if ev.get("stop"):
                self.count_cache(ev)
                done.update(ev)
        finished = last == b"[DONE]" if route.startswith("/v1/") else isinstance(last, dict) and last.get("stop")
        if not finished:
            self.error(f"stream ended early {route}", repr(last)[:300])
            return "error"
        return "completed"

    def count_cache(self, doc: dict) -> None:
        t = doc.get("timings") or {}
        self.cache["cache_n"] += t.get("cache_n", 0)
        self.cache["prompt_n"] += t.get("prompt_n", 0)

    async def one(self, rng) -> None:
        ending = str(rng.choice(list(ENDINGS), p=list(ENDINGS.values())))
        stream = ending != "read_json" and rng.random() < 0.9
        route, body = make_request(rng, self.prefixes, stream)
        if ending == "never_read_dropped":      # short, so that the server's --timeout starts soon
            body["max_tokens" if route.startswith("/v1/") else "n_predict"] = 8
        if ending.startswith("never_read"):
            return await self.never_read(rng, route, body, ending == "never_read_dropped")
        r, writer = await asyncio.open_connection("127.0.0.1", self.port)
        idle_s = IDLE_READ_S if stream else WHOLE_ANSWER_S      # a whole generation may come before a byte does
        reader = IdleTimeoutReader(r, idle_s)
        kind, done = None, {}
        try:
            writer.write(post_request(route, body))
            if ending == "half_close":
                writer.write_eof()
            read = self.read_response(reader, route, stream, done)
            if ending in ("rst", "fin"):
                try:
                    kind = await asyncio.wait_for(read, float(rng.uniform(0.05, 3.0)))
                except asyncio.TimeoutError:
                    if ending == "rst":
                        _rst(writer)
                    self.outcome(f"cut {ending}")
                    return
            elif ending == "half_close":
                try:
                    kind = await read
                except (asyncio.IncompleteReadError, ConnectionError):
                    kind = "cancelled"          # the server took the FIN for a disconnect: allowed
                self.outcome(f"half_close {kind}")
                return
            else:
                try:
                    kind = await read
                except asyncio.TimeoutError:
                    self.error(f"hang {route}{' stream' if stream else ''}", f"no byte for {idle_s:g} s")
                    return
            if kind != "error":
                self.outcome(f"{kind} {route}{' stream' if stream else ''}")
        finally:
            writer.close()
        if kind == "completed" and done.get("id_slot", -1) >= 0 and rng.random() < ERASE_SHARE:
            await self.erase(done["id_slot"])

    async def never_read(self, rng, route: str, body: dict, until_dropped: bool) -> None:
        """Send the request and read nothing; close after a while (RST or FIN), or after --timeout has
        passed check that the server dropped the connection."""
        loop = asyncio.get_running_loop()
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.setblocking(False)
        try:
            await loop.sock_connect(s, ("127.0.0.1", self.port))
            await loop.sock_sendall(s, post_request(route, body))
            if not until_dropped:
                await asyncio.sleep(float(rng.uniform(0.5, 8.0)))
                self.outcome("never_read closed")
                if rng.random() < 0.5:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                return
            await asyncio.sleep(SERVER_TIMEOUT_S + 3.0)
            deadline = time.perf_counter() + DROP_GRACE_S       # the buffered bytes, then EOF or RST
            while time.perf_counter() < deadline:
                try:
                    data = await asyncio.wait_for(loop.sock_recv(s, 1 << 16), deadline - time.perf_counter())
                except (ConnectionError, asyncio.TimeoutError) as exc:
                    if isinstance(exc, ConnectionError):
                        self.outcome("never_read dropped")
                        return
                    break
                if not data:
                    self.outcome("never_read dropped")
                    return
            self.error("never-reader not dropped", f"still open {SERVER_TIMEOUT_S + 3 + DROP_GRACE_S:g} s after "
                       f"its request of 8 tokens")
        finally:
            s.close()

    async def client(self, k: int) -> None:
        rng = np.random.default_rng([int(self.rng.integers(2 ** 31)), k])
        while time.perf_counter() < self.stop_at:
            try:
                await self.one(rng)
            except asyncio.CancelledError:
                return
            except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
                self.error(f"connection {type(exc).__name__}", str(exc))
                await asyncio.sleep(0.1)

    async def erase(self, slot: int) -> None:
        """POST /slots/{slot}?action=erase, as a client done with its conversation does."""
        route = "/slots/{id}?action=erase"
        try:
            status, body = await asyncio.wait_for(post_once(self.port, f"/slots/{slot}?action=erase", {}),
                                                  WHOLE_ANSWER_S)
        except asyncio.TimeoutError:
            self.error(f"hang {route}", f"no answer in {WHOLE_ANSWER_S:g} s")
            return
        if self.check_status(route, status, body):
            self.outcome("erase")

    async def scraper(self) -> None:
        conn = None
        while time.perf_counter() < self.stop_at:
            try:
                conn = conn or await asyncio.open_connection("127.0.0.1", self.port)
                status, body = await get(*conn, "/metrics")
                if status == 200:
                    self.scrapes.append((time.perf_counter(), body.decode()))
                    self.loadavg.append((time.perf_counter(), os.getloadavg()[0]))
                else:
                    self.check_status("/metrics", status, body)
            except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
                self.error(f"connection {type(exc).__name__}", f"/metrics: {exc}")
                conn = None
            await asyncio.sleep(2.0)
        if conn:
            conn[1].close()

    async def run(self) -> None:
        tasks = [asyncio.create_task(self.client(k)) for k in range(CLIENTS)]
        prober = Prober(self.port, "/health")
        try:
            await self.scraper()
        finally:
            self.health = [x for x in prober.stop() if x[0] <= self.stop_at]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks)


def _rst(writer) -> None:
    """Abort with an RST (SO_LINGER {1, 0}) instead of a FIN."""
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


# -- figures ---------------------------------------------------------------------------------

def bucket_quantile(bounds: list[float], counts: list[float], q: float) -> float:
    """The q-quantile of a histogram (cumulative counts per upper bound, the last +Inf), interpolated
    linearly inside its bucket as Prometheus' histogram_quantile does; nan when empty."""
    total = counts[-1] if counts else 0
    if total <= 0:
        return float("nan")
    rank = q * total
    prev_b, prev_c = 0.0, 0.0
    for b, c in zip(bounds, counts):
        if c >= rank:
            if b == float("inf"):
                return prev_b
            return prev_b + (b - prev_b) * (rank - prev_c) / max(c - prev_c, 1e-12)
        prev_b, prev_c = b, c
    return prev_b


def step_histogram(text: str) -> tuple[list[float], list[float]]:
    """(upper bounds, cumulative counts) of fastserve_step_seconds in a /metrics page."""
    vals = metric_values(text, "fastserve_step_seconds_bucket")
    pairs = sorted((float(k.split('"')[1].replace("+Inf", "inf")), v) for k, v in vals.items())
    return [b for b, _ in pairs], [c for _, c in pairs]


def server_codes(text: str) -> dict:
    return {k.split('"')[1]: v for k, v in metric_values(text, "fastserve_http_requests_total").items()}


def windows(soak: Soak, rss: list) -> list[dict]:
    """Per window: its end (min), outcomes, /health p50/p99, step p99 and mean (s), RSS at its end (MiB).
    rss: [(minutes since the start, MiB)]."""
    out = []
    for i in range(N_WINDOWS):
        a, b = soak.t0 + i * soak.window_s, soak.t0 + (i + 1) * soak.window_s
        h = [d for t, d, st in soak.health if a <= t < b and st == 200]
        before = [x for x in soak.scrapes if x[0] <= a] or soak.scrapes[:1]
        inside = [x for x in soak.scrapes if x[0] <= b]
        step_p99 = step_mean = float("nan")
        if before and inside:
            bounds, c0 = step_histogram(before[-1][1])
            _, c1 = step_histogram(inside[-1][1])
            if bounds and len(c0) == len(c1):
                delta = [y - x for x, y in zip(c0, c1)]
                step_p99 = bucket_quantile(bounds, delta, 0.99)
                s0 = metric_values(before[-1][1], "fastserve_step_seconds_sum").get("", 0.0)
                s1 = metric_values(inside[-1][1], "fastserve_step_seconds_sum").get("", 0.0)
                step_mean = (s1 - s0) / delta[-1] if delta[-1] else float("nan")
        r = [m for t, m in rss if t <= (b - soak.t0) / 60]
        la = [x for t, x in soak.loadavg if a <= t < b]
        out.append({"t_end_min": (b - soak.t0) / 60, "outcomes": soak.per_window[i],
                    "requests": sum(v for k, v in soak.per_window[i].items() if k not in ("error", "erase")),
                    "health_p50_ms": _pct(h, 50), "health_p99_ms": _pct(h, 99), "health_n": len(h),
                    "step_p99_ms": step_p99 * 1e3, "step_mean_ms": step_mean * 1e3,
                    "rss_mib": r[-1] if r else float("nan"), "loadavg": float(np.mean(la)) if la else float("nan")})
    return out


def _pct(xs, q) -> float:
    return float(np.percentile(xs, q)) * 1e3 if xs else float("nan")


def rss_summary(rss: list, t_load_end_min: float, windows_: list) -> dict:
    """RSS figures (MiB): at the start, after the first window (the warm baseline), peak, at the end of
    the load, growth from the baseline, and the slope over the second half of the load (MiB/min)."""
    load = [(t, m) for t, m in rss if t <= t_load_end_min]
    base = windows_[0]["rss_mib"]
    end = load[-1][1] if load else float("nan")
    half = [(t, m) for t, m in load if t >= t_load_end_min / 2]
    slope = float(np.polyfit([t for t, _ in half], [m for _, m in half], 1)[0]) if len(half) > 2 else float("nan")
    return {"start_mib": load[0][1] if load else float("nan"), "baseline_mib": base,
            "peak_mib": max((m for _, m in load), default=float("nan")), "end_mib": end,
            "growth_mib": end - base, "slope_mib_per_min": slope}


def plot(path: str, out: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
    t, m = zip(*out["rss"]) if out["rss"] else ((), ())
    ax1.plot(t, m, lw=1)
    ax1.axvline(out["minutes"], color="grey", ls=":", lw=1)
    ax1.set_ylabel("server RSS (MiB)")
    ax1.set_title(f"fastserve soak: {out['clients']} clients, {out['minutes']:g} min, "
                  f"{out['requests']} requests, {out['errors_5xx']} 5xx")
    w = out["windows"]
    te = [x["t_end_min"] for x in w]
    ax2.plot(te, [x["health_p99_ms"] for x in w], "o-", label="/health p99")
    ax2.plot(te, [x["step_p99_ms"] for x in w], "s-", label="step p99")
    ax2.set_ylabel("ms")
    ax2.set_yscale("log")
    ax2.legend()
    width = out["minutes"] / N_WINDOWS
    ax3.bar([t - width for t in te], [x["requests"] for x in w], width=width * 0.8, align="edge")
    ax3.set_xlim(left=0)
    ax3.set_ylabel("requests per window")
    ax3.set_xlabel("minutes")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


# -- the run -----------------------------------------------------------------------------------

def run(model: str, minutes: float, seed: int = 0, threads: int | None = None) -> dict:
    import uvloop
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="soak-", suffix=".log", delete=False).name
    srv = ServerProcess(fastserve_command(model, port, N_PARALLEL, N_CTX, threads, "--timeout", str(SERVER_TIMEOUT_S),
                                          "-cram", str(CACHE_RAM_MIB)), port, log)
    sampler = RssSampler(srv.pid, every=1.0)
    out = {"model": model, "minutes": minutes, "clients": CLIENTS, "seed": seed, "server_log": log, "cpus": os.cpu_count(),
           "ready_s": srv.ready_s, "flags": {"np": N_PARALLEL, "c": N_CTX, "timeout": SERVER_TIMEOUT_S,
                                             "cram": CACHE_RAM_MIB, "t": threads}}
    try:
        out["rss_before_warmup_mib"] = srv.rss() / MIB
        out["warmup_s"] = warm_up(port)
        out["rss_after_warmup_mib"] = srv.rss() / MIB
        soak = Soak(port, minutes * 60, seed)
        uvloop.run(soak.run())
        t_load_end = time.perf_counter()
        out.update(after_load(port, soak))
        time.sleep(10.0)
        out["rss_after_idle_mib"] = srv.rss() / MIB
    finally:
        sampler.close()
        rc, dt = srv.stop()
        out["exit_code"], out["exit_s"] = rc, dt
    rss = [((t - soak.t0) / 60, b / MIB) for t, b in sampler.samples if t >= soak.t0 and b]
    out["rss"] = rss[::max(1, len(rss) // 600)]
    out["windows"] = windows(soak, rss)
    out["rss_summary"] = rss_summary(rss, (t_load_end - soak.t0) / 60, out["windows"])
    out["outcomes"] = dict(sorted(soak.outcomes.items()))
    out["errors"] = dict(sorted(soak.errors.items()))
    out["error_examples"] = soak.examples
    out["requests"] = sum(v for k, v in soak.outcomes.items() if k not in ("error", "erase"))
    out["completed"] = sum(v for k, v in soak.outcomes.items() if k.startswith("completed"))
    out["errors_5xx"] = sum(v for k, v in soak.errors.items() if k.startswith("5xx"))
    out["server_5xx"] = sum(v for c, v in out["server_http_codes"].items() if c.startswith("5"))
    h = [d for _, d, st in soak.health if st == 200]
    out["health"] = {"n": len(soak.health), "non_200": sum(1 for _, _, st in soak.health if st != 200),
                     "p50_ms": _pct(h, 50), "p99_ms": _pct(h, 99), "max_ms": max(h, default=0) * 1e3}
    c = soak.cache
    out["prompt_cache"] = {**c, "hit_share": c["cache_n"] / max(1, c["cache_n"] + c["prompt_n"])}
    out["failures"] = failures(out)
    return out


def warm_up(port: int) -> float:
    """32 greedy requests of ~360 prompt tokens and 1 token each, WARM_WAVE at a time: every slot's KV
    written that far. Seconds it took."""
    async def one(k: int):
        text = " ".join(SENTENCES[(k + i) % len(SENTENCES)] for i in range(WARM_PROMPT_SENTENCES))
        status, body = await post_once(port, "/completion", {"prompt": text, "n_predict": 1, "temperature": 0,
                                                             "cache_prompt": False})
        if status != 200:
            raise RuntimeError(f"the warm-up request answered {status}: {body[:300]!r}")

    async def go():
        for k0 in range(0, N_PARALLEL, WARM_WAVE):
            await asyncio.gather(*(one(k) for k in range(k0, min(N_PARALLEL, k0 + WARM_WAVE))))
    t0 = time.perf_counter()
    asyncio.run(go())
    return time.perf_counter() - t0


def after_load(port: int, soak: Soak) -> dict:
    """Once the clients are gone: how long until every slot is idle, /health, and the server's final
    counts (its answers by status over the whole run included)."""
    async def go():
        t0 = time.perf_counter()
        busy = None
        while time.perf_counter() - t0 < 15.0:
            status, body = await get_once(port, "/slots")
            busy = sum(1 for s in orjson.loads(body) if s.get("is_processing")) if status == 200 else -1
            if busy == 0:
                break
            await asyncio.sleep(0.1)
        idle_s = time.perf_counter() - t0
        health = (await get_once(port, "/health"))[0]
        metrics = (await get_once(port, "/metrics"))[1].decode()
        return {"slots_busy_after": busy, "slots_idle_after_s": idle_s, "health_after": health,
                "server_http_codes": server_codes(metrics),
                "server_metrics_final": {k: metric_values(metrics, k) for k in (
                    "fastserve_client_disconnects_total", "fastserve_clients_dropped_total",
                    "fastserve_requests_finished_total", "fastserve_requests_rejected_total",
                    "fastserve_generated_tokens_total", "fastserve_prompt_tokens_total")}}
    return asyncio.run(go())


def failures(out: dict) -> list[str]:
    f = []
    if out["errors_5xx"] or out["server_5xx"]:
        f.append(f"5xx: {out['errors_5xx']} seen by the clients, {out['server_5xx']} counted by the server")
    other = {k: v for k, v in out["errors"].items() if not k.startswith("5xx")}
    if other:
        f.append(f"errors: {other}")
    if out.get("slots_busy_after"):
        f.append(f"{out['slots_busy_after']} slots still busy 15 s after the clients left")
    if out.get("health_after") != 200:
        f.append(f"/health answered {out.get('health_after')} after the load")
    if out["health"]["non_200"]:
        f.append(f"/health answered non-200 {out['health']['non_200']} times during the load")
    if out["exit_code"] != 0:
        f.append(f"exit code {out['exit_code']} after SIGTERM ({out['exit_s']:.1f} s)")
    if not out["completed"]:
        f.append("no request completed")
    return f


def report(out: dict) -> str:
    r = out["rss_summary"]
    lines = [f"soak: {out['clients']} clients, {out['minutes']:g} min, {Path(out['model']).name}; server ready in "
             f"{out['ready_s']:.1f} s; flags {out['flags']}; {out['cpus']} CPUs (load: the machine's load average)",
             f"warm-up {out['warmup_s']:.1f} s: RSS {out['rss_before_warmup_mib']:.0f} -> "
             f"{out['rss_after_warmup_mib']:.0f} MiB",
             f"requests {out['requests']} (completed {out['completed']}); 5xx: {out['errors_5xx']} (clients), "
             f"{out['server_5xx']} (server); errors {out['errors'] or 'none'}",
             "outcomes: " + ", ".join(f"{k} {v}" for k, v in out["outcomes"].items()),
             f"prompt cache: {out['prompt_cache']['hit_share']:.1%} of completed requests' prompt tokens reused",
             f"RSS: start {r['start_mib']:.0f} MiB, after the first window {r['baseline_mib']:.0f}, peak "
             f"{r['peak_mib']:.0f}, end {r['end_mib']:.0f} (growth {r['growth_mib']:+.1f} MiB, "
             f"{r['slope_mib_per_min']:+.2f} MiB/min over the second half), after 10 s idle "
             f"{out['rss_after_idle_mib']:.0f}",
             f"/health: {out['health']['n']} probes, p50 {out['health']['p50_ms']:.2f} ms, p99 "
             f"{out['health']['p99_ms']:.2f} ms, max {out['health']['max_ms']:.1f} ms, non-200 {out['health']['non_200']}",
             f"after the load: slots busy {out['slots_busy_after']} ({out['slots_idle_after_s']:.1f} s), /health "
             f"{out['health_after']}; SIGTERM: exit {out['exit_code']} in {out['exit_s']:.2f} s", "",
             f"{'until min':>9} {'requests':>8} {'errors':>6} {'health p50':>10} {'p99':>7} {'step p99':>9} "
             f"{'mean':>7} {'RSS MiB':>8} {'load':>5}"]
    for w in out["windows"]:
        lines.append(f"{w['t_end_min']:>9.1f} {w['requests']:>8} {w['outcomes'].get('error', 0):>6} "
                     f"{w['health_p50_ms']:>8.2f}ms {w['health_p99_ms']:>5.1f}ms {w['step_p99_ms']:>7.0f}ms "
                     f"{w['step_mean_ms']:>5.0f}ms {w['rss_mib']:>8.1f} {w['loadavg']:>5.1f}")
    for k, v in out["error_examples"].items():
        lines.append(f"example of {k}: {v}")
    lines.append("failures: " + ("; ".join(out["failures"]) if out["failures"] else "none"))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("-m", "--model", help="GGUF path (default: the default model)")
    ap.add_argument("-t", "--threads", type=int, help="the server's -t (default: its own)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="soak.json", help="where the figures go (JSON)")
    ap.add_argument("--plot", help="RSS, /health p99 and step p99 over time, as a PNG (needs matplotlib)")
    a = ap.parse_args(argv)
    import fastserve
    out = run(a.model or fastserve.default_model_path(), a.minutes, a.seed, a.threads)
    print(report(out))
    Path(a.json).write_bytes(orjson.dumps(out, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS))
    if a.plot:
        plot(a.plot, out)
        print(f"plot: {a.plot}")
    print(f"figures: {a.json}; server log: {out['server_log']}")
    return 1 if out["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
