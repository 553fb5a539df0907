"""One measured level against one target: the load, the probes beside it, RSS, and the tracer's window.

Loads: closed loop (`clients` streams, each sending the next request as soon as one ends) or open
loop (Poisson arrivals at `rate` requests/s, however many are in flight). A level runs warm-up_s,
then the window of duration_s; only the window is measured, and at its end every request still
running is cancelled (its connection closed). All streams run as tasks on the caller's event loop.
Times: time.perf_counter() seconds.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .client import Params, Record, Target, stream_engine, stream_http


@dataclass(frozen=True)
class Level:
    kind: str            # 'clients' (closed loop) or 'rate' (open loop, requests/s)
    value: float

    def __str__(self) -> str:
        return level_label({"kind": self.kind, "value": self.value})


def level_label(lv: dict) -> str:
    """'1 client', '8 clients', '2.5 req/s' of a level as the JSON holds it."""
    if lv["kind"] == "clients":
        return f"{int(lv['value'])} client{'' if lv['value'] == 1 else 's'}"
    return f"{lv['value']:g} req/s"


@dataclass
class LevelRun:
    """What one level measured on one target; t0..t1 is the window."""
    target: Target
    level: Level
    t0: float
    t1: float
    records: list
    probes: dict = field(default_factory=dict)      # path -> [(t_sent, seconds, status)]
    trace: dict | None = None                       # tracer.delta of the window, when the target has one
    rss: list = field(default_factory=list)         # [(t, bytes)]
    client_cpu_s: float | None = None               # this process's CPU time in the window (HTTP targets)


# -- the target's process ----------------------------------------------------------------------

def rss_of(pid: int) -> int:
    """Resident set size of a process (VmRSS), bytes; 0 once it is gone (or without /proc)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def pid_listening_on(port: int) -> int | None:
    """The process listening on this machine's TCP `port` (Linux /proc; None when not found or not ours to see):
    how a local server's RSS is sampled without --pid."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    cols = line.split()
                    if cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:     # 0A: LISTEN
                        inodes.add(f"socket:[{cols[9]}]")
        except (OSError, StopIteration, IndexError, ValueError):
            continue
    if not inodes:
        return None
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") in inodes for fd in os.listdir(f"/proc/{pid}/fd")):
                return int(pid)
        except OSError:
            continue
    return None


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
            self.samples.append((time.perf_counter(), rss_of(self.pid)))
            self._stop.wait(self.every)

    def peak(self, t_from: float = 0.0, t_to: float = float("inf")) -> int:
        return max((b for t, b in self.samples if t_from <= t <= t_to), default=0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


class Prober:
    """GET `path` every `every` s from a child process (probe.py); stop() -> [(t_sent, seconds, status)]."""

    def __init__(self, url: str, path: str, every: float = 0.1):
        fd, self._out = tempfile.mkstemp(prefix="fastserve-probe-", suffix=".json")
        os.close(fd)
        # run by path, not -m: importing the fastserve package (numpy, the extensions) would delay the first probe
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("probe.py")), url, path, str(every),
                                      self._out])

    def stop(self, timeout: float = 40.0) -> list:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise RuntimeError(f"the probe did not stop within {timeout:g} s of SIGTERM: a GET hung")
        try:
            return [tuple(x) for x in json.loads(Path(self._out).read_text() or "[]")]
        finally:
            os.unlink(self._out)


# -- the level ---------------------------------------------------------------------------------

async def read_trace(target: Target, client, engine) -> dict | None:
    """The target's tracer totals now (GET /trace, or the in-process engine's); None when it has none."""
    if target.url is None:
        return engine.trace_totals() if engine is not None else None
    try:
        r = await client.get(target.url.rstrip("/") + "/trace")
        return r.json() if r.status_code == 200 else None
    except Exception:        # noqa: BLE001 - a server without /trace (llama-server): no phase table
        return None


def poisson_offsets(rate: float, span_s: float, seed: int) -> list:
    """The open loop's arrival times, seconds after the level's start: exponential gaps of mean 1/rate
    up to span_s, fixed by the seed (the same schedule for every target)."""
    rng = np.random.default_rng(seed)
    offsets, t = [], float(rng.exponential(1.0 / rate))
    while t < span_s:
        offsets.append(t)
        t += float(rng.exponential(1.0 / rate))
    return offsets


async def run_level(target: Target, level: Level, prompts: list, params: Params, warmup_s: float,
                    duration_s: float, *, client=None, engine=None, probe_paths=(), probe_every: float = 0.1,
                    progress=None, seed: int = 0) -> LevelRun:
    """Run one level; client: an httpx.AsyncClient for URL targets, engine: the Engine for in-process."""
    from ..tracer import delta

    async def one(prompt, rec: Record) -> None:
        if target.url is None:
            await stream_engine(engine, prompt, params, rec)
        else:
            await stream_http(client, target, prompt, params, rec)

    records: list[Record] = []
    t_start = time.perf_counter()
    t0 = t_start + warmup_s
    t1 = t0 + duration_s

    async def closed_client(k: int, n: int) -> None:
        i = k
        while time.perf_counter() < t1:
            rec = Record(time.perf_counter())
            records.append(rec)
            await one(prompts[i % len(prompts)], rec)
            if rec.error is not None:
                await asyncio.sleep(0.05)        # a server refusing at once must not spin the loop
            i += n

    async def open_arrivals() -> None:
        inflight: set = set()
        for i, offset in enumerate(poisson_offsets(level.value, t1 - t_start, seed)):
            await asyncio.sleep(max(0.0, t_start + offset - time.perf_counter()))
            rec = Record(time.perf_counter())
            records.append(rec)
            task = asyncio.create_task(one(prompts[i % len(prompts)], rec))
            inflight.add(task)
            task.add_done_callback(inflight.discard)
        await asyncio.sleep(max(0.0, t1 - time.perf_counter()))
        for task in list(inflight):
            task.cancel()
        await asyncio.gather(*inflight, return_exceptions=True)

    if level.kind == "clients":
        n = int(level.value)
        tasks = [asyncio.create_task(closed_client(k, n)) for k in range(n)]
    else:
        tasks = [asyncio.create_task(open_arrivals())]
    probers = [(p, Prober(target.url, p, probe_every)) for p in probe_paths] if target.url else []
    pid = target.pid if target.url else os.getpid()
    rss = RssSampler(pid) if pid else None
    ticker = asyncio.create_task(_tick(progress, records, t_start, t1)) if progress is not None else None
    try:
        await asyncio.sleep(max(0.0, t0 - time.perf_counter()))
        trace0, cpu0 = await read_trace(target, client, engine), time.process_time()
        await asyncio.sleep(max(0.0, t1 - time.perf_counter()))
        trace1, cpu1 = await read_trace(target, client, engine), time.process_time()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if ticker is not None:
            ticker.cancel()
        probes = {p: pr.stop() for p, pr in probers}
        if rss is not None:
            rss.close()
    return LevelRun(target, level, t0, t1, records, probes,
                    delta(trace1, trace0) if trace0 and trace1 else None,
                    rss.samples if rss is not None else [],
                    cpu1 - cpu0 if target.url else None)


async def _tick(bar, records, t_start: float, t1: float) -> None:
    """Advance a tqdm bar (seconds of the level) with the tokens so far as its postfix."""
    while True:
        now = time.perf_counter()
        bar.n = round(min(now, t1) - t_start, 1)
        bar.set_postfix_str(f"{len(records)} requests, {sum(r.n_tokens for r in records)} tokens", refresh=False)
        bar.refresh()
        await asyncio.sleep(0.25)
