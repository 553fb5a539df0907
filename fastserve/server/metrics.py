"""Prometheus text exposition (format 0.0.4) without a client library: counters, gauges, histograms;
llama-server's `llamacpp:*` metrics (its names and help texts) beside fastserve's own.

Everything here runs on the event loop thread (observations and scrapes), so no
lock is needed. Gauges that describe the engine are computed at scrape time from
its published Snapshot (DESIGN.md contract 5), never by asking the decode thread.

Why not prometheus_client (issue 14 asked for it unless a scrape costs the loop more than 1 ms):
bench/bench_metrics_scrape.py renders the same ~230 samples both ways, same run. With
prometheus_client (its Counter/Histogram plus a custom collector for the snapshot, created series
off) a scrape took 1.30 ms of the loop's CPU (median, 2 loaded cores), this file 0.38 ms (3.4x):
its generate_latest costs ~6 µs a sample. Its parser still checks this output in the tests.

llama-server's gauges prompt_tokens_seconds and predicted_tokens_seconds are averages over the
window since the previous scrape (reset by each scrape, as llama-server does); the generation rate
counts a request's tokens after its first (the first comes from the prompt's pass, not a decode step), and
a request that generated one token or none counts in neither rate (llama-server's are 0 after such requests).
Speculative decoding's counters are shown under both of llama-server's names (n_drafted /
n_drafted_accepted, and its later spec_decode_num_*), 0 when it is off. Not shown, because fastserve has no
such thing: n_busy_slots_per_decode (the engine does not count busy slots per step).
"""
from __future__ import annotations

import time
from bisect import bisect_left

from ..speculation import ACCEPT_BUCKETS
from ..tracer import STEP_SECONDS_BUCKETS

# Bucket upper bounds, seconds.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0)
STEP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


def _fmt(v: float) -> str:
    if v == float("inf"):
        return "+Inf"
    if float(v).is_integer() and abs(v) < 1e15:
        return str(int(v))
    return repr(float(v))


def _labels(labels: dict) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{str(v).replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"'
                     for k, v in labels.items())
    return "{" + inner + "}"


class Counter:
    def __init__(self, name: str, help: str, labelnames: tuple = ()):
        self.name, self.help, self.labelnames = name, help, labelnames
        self.values: dict[tuple, float] = {} if labelnames else {(): 0.0}

    def inc(self, amount: float = 1.0, *labels) -> None:
        self.values[labels] = self.values.get(labels, 0.0) + amount

    def render(self, out: list) -> None:
        out.append(f"# HELP {self.name}_total {self.help}\n# TYPE {self.name}_total counter\n")
        for labels, v in self.values.items():
            out.append(f"{self.name}_total{_labels(dict(zip(self.labelnames, labels)))} {_fmt(v)}\n")


class Gauge:
    """A gauge whose value is read at scrape time from `fn()` (or set()); labels: fixed, the one series'."""

    def __init__(self, name: str, help: str, fn=None, labels: dict | None = None):
        self.name, self.help, self.fn, self.value = name, help, fn, 0.0
        self.labels = _labels(labels or {})

    def set(self, v: float) -> None:
        self.value = v

    def render(self, out: list) -> None:
        v = self.fn() if self.fn is not None else self.value
        out.append(f"# HELP {self.name} {self.help}\n# TYPE {self.name} gauge\n{self.name}{self.labels} {_fmt(v)}\n")


class Histogram:
    def __init__(self, name: str, help: str, buckets: tuple, labelnames: tuple = ()):
        self.name, self.help, self.buckets, self.labelnames = name, help, tuple(buckets), labelnames
        self._series: dict[tuple, list] = {}     # labels -> [counts per bucket + inf, sum]
        if not labelnames:
            self._new(())

    def _new(self, labels: tuple) -> list:
        s = self._series[labels] = [[0] * (len(self.buckets) + 1), 0.0]
        return s

    def observe(self, v: float, count: int = 1, *labels) -> None:
        """Record `count` observations of value v (seconds)."""
        s = self._series.get(labels) or self._new(labels)
        s[0][bisect_left(self.buckets, v)] += count
        s[1] += v * count

    def count(self, *labels) -> int:
        s = self._series.get(labels)
        return sum(s[0]) if s else 0

    def render(self, out: list) -> None:
        out.append(f"# HELP {self.name} {self.help}\n# TYPE {self.name} histogram\n")
        for labels, (counts, total) in self._series.items():
            base = dict(zip(self.labelnames, labels))
            acc = 0
            for le, c in zip(self.buckets + (float("inf"),), counts):
                acc += c
                out.append(f"{self.name}_bucket{_labels({**base, 'le': _fmt(le)})} {acc}\n")
            out.append(f"{self.name}_sum{_labels(base)} {_fmt(total)}\n")
            out.append(f"{self.name}_count{_labels(base)} {acc}\n")


class Registry:
    def __init__(self):
        self._metrics: list = []

    def add(self, metric):
        self._metrics.append(metric)
        return metric

    def counter(self, name, help, labelnames=()):
        return self.add(Counter(name, help, labelnames))

    def gauge(self, name, help, fn=None, labels=None):
        return self.add(Gauge(name, help, fn, labels))

    def histogram(self, name, help, buckets, labelnames=()):
        return self.add(Histogram(name, help, buckets, labelnames))

    def render(self) -> bytes:
        out: list[str] = []
        for m in self._metrics:
            m.render(out)
        return "".join(out).encode()


class HistogramFn(Histogram):
    """A histogram kept elsewhere, read at scrape time: fn() -> (counts per bucket plus +Inf, sum)."""

    def __init__(self, name: str, help: str, buckets: tuple, fn):
        super().__init__(name, help, buckets)
        self.fn = fn

    def render(self, out: list) -> None:
        counts, total = self.fn()
        self._series[()] = [list(counts), float(total)]
        super().render(out)


class CounterFn(Counter):
    """A counter whose total is read at scrape time (e.g. from the engine's snapshot)."""

    def __init__(self, name: str, help: str, fn):
        super().__init__(name, help)
        self.fn = fn

    def render(self, out: list) -> None:
        self.values[()] = float(self.fn())
        super().render(out)


class LlamaTotals:
    """llama-server's request totals, added to when a request ends (Generation.close calls add()).
    Cumulative since start, plus the window since the last scrape for the two rates."""

    def __init__(self):
        self.prompt_n = self.prompt_cached = self.predicted_n = 0
        self.prompt_s = self.predicted_s = 0.0
        self.n_tokens_max = 0
        self.window = [0, 0.0, 0, 0.0]        # prompt tokens, prompt s, decode steps, decode s
        self.rates = (0.0, 0.0)               # (prompt, generation) tokens/s of the last closed window

    def add(self, gen) -> None:
        """gen: a Generation that ended (however it ended)."""
        n_cached = gen.reader.n_cached
        n_gen = len(gen.ids)
        self.n_tokens_max = max(self.n_tokens_max, gen.n_prompt + n_gen)
        text = gen.text
        if text.t_first is None:              # it never computed its prompt to the end
            return
        t0 = gen.t_admit if gen.t_admit is not None else text.t_submit
        t_end = text.t_end if text.t_end is not None else time.monotonic()
        n_eval = gen.n_prompt - n_cached
        prompt_s, gen_s = max(0.0, text.t_first - t0), max(0.0, t_end - text.t_first)
        self.prompt_n += n_eval
        self.prompt_cached += n_cached
        self.prompt_s += prompt_s
        self.predicted_n += n_gen
        self.predicted_s += gen_s
        if n_gen <= 1:                        # as llama-server: no throughput of a request without a decode step
            return
        w = self.window
        w[0] += n_eval
        w[1] += prompt_s
        w[2] += n_gen - 1
        w[3] += gen_s

    def close_window(self) -> None:
        """At each scrape: the rates over the window since the last one; a new window starts."""
        p_n, p_s, g_n, g_s = self.window
        self.window = [0, 0.0, 0, 0.0]
        self.rates = (p_n / p_s if p_s > 0 else 0.0), (g_n / g_s if g_s > 0 else 0.0)


# Speculative decoding's totals (Snapshot fields), under llama-server's names: its older ones and its later ones.
SPEC_COUNTERS = (
    ("llamacpp:n_drafted", "Number of speculative decoding tokens drafted", "n_drafted"),
    ("llamacpp:n_drafted_accepted", "Number of speculative decoding tokens accepted", "n_drafted_accepted"),
    ("llamacpp:spec_decode_num_draft_tokens", "Speculative: Total draft tokens generated", "n_drafted"),
    ("llamacpp:spec_decode_num_accepted_tokens", "Speculative: Total draft tokens accepted by the target model",
     "n_drafted_accepted"),
    ("llamacpp:spec_decode_num_drafts", "Speculative: Total speculative decoding verification steps",
     "n_draft_verified"),
)


def kv_in_use(snap, info) -> float:
    """vLLM's kv_cache_usage_perc (0..1): the KV written for requests that run, over the whole cache. An idle
    slot's cached prefix counts as free, as vLLM counts a finished request's cached blocks (they can be evicted);
    fastserve_kv_usage_ratio counts it."""
    held = sum(past for past, state in zip(snap.slot_past, snap.slot_state) if state)
    return held / (info.n_slots * info.n_ctx_slot)


def _decode_steps(engine) -> int:
    """Steps that did work (the tracer's count), or, with tracing off, the heartbeat's."""
    st = engine.stats()
    return st.trace_steps if st.step_histogram is not None else engine.snapshot.step


class ServerMetrics:
    """Every metric /metrics shows, of app's requests and connections and of engine, whose state is
    read from its snapshot and stats() at scrape time; info: engine.describe()."""

    def __init__(self, app, engine, info):
        self.app, self._engine = app, engine
        r = self.registry = Registry()
        snap = lambda: engine.snapshot     # noqa: E731
        ll = self.llama = LlamaTotals()
        # llama-server's names and help texts (tools/server: server_task_result_metrics::to_metrics)
        r.add(CounterFn("llamacpp:prompt_tokens", "Number of prompt tokens processed, excluding cached tokens",
                        lambda: ll.prompt_n))
        r.add(CounterFn("llamacpp:prompt_tokens_cached", "Number of prompt tokens reused from the cache",
                        lambda: ll.prompt_cached))
        r.add(CounterFn("llamacpp:prompt_seconds", "Total time spent processing prompts", lambda: ll.prompt_s))
        r.add(CounterFn("llamacpp:tokens_predicted", "Number of generation tokens processed", lambda: ll.predicted_n))
        r.add(CounterFn("llamacpp:tokens_predicted_seconds", "Total time spent generating tokens",
                        lambda: ll.predicted_s))
        r.add(CounterFn("llamacpp:n_decode", "Total number of decode steps (llama_decode() calls in llama-server)",
                        lambda: _decode_steps(engine)))
        for name, help, field in SPEC_COUNTERS:
            r.add(CounterFn(name, help, lambda field=field: getattr(snap(), field)))
        r.add(HistogramFn("fastserve_draft_accepted_tokens", "Speculative decoding: drafted tokens accepted per "
                          "verification (a slot's draft checked in one step).", ACCEPT_BUCKETS,
                          lambda: (snap().draft_histogram or (0,) * (len(ACCEPT_BUCKETS) + 1),
                                   snap().n_drafted_accepted)))
        # a counter in llama-server, whose exposition then breaks the rule that counters end in _total
        r.gauge("llamacpp:n_tokens_max", "Largest observed sequence length (prompt + generation)",
                lambda: max(ll.n_tokens_max, max(snap().slot_tokens, default=0)))
        r.gauge("llamacpp:prompt_tokens_seconds", "Average prompt throughput in tokens/s", lambda: ll.rates[0])
        r.gauge("llamacpp:predicted_tokens_seconds", "Average generation throughput in tokens/s",
                lambda: ll.rates[1])
        r.gauge("llamacpp:requests_processing", "Number of requests processing",
                lambda: sum(1 for s in snap().slot_state if s))
        r.gauge("llamacpp:requests_deferred", "Number of requests deferred", lambda: snap().n_waiting + engine.stats().n_inbox)
        # vLLM's scheduler gauges (vllm/v1/metrics/loggers.py: names, help texts, labels), which routers outside
        # fastserve read to spread load over a pool of servers (llm-d, vLLM's router, SGLang's gateway)
        vllm = {"model_name": app.config.alias or info.model_name, "engine": "0"}
        r.gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                lambda: snap().n_running, vllm)
        r.gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                lambda: snap().n_waiting + engine.stats().n_inbox, vllm)
        r.gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                lambda: kv_in_use(snap(), info), vllm)
        r.gauge("fastserve_requests_running", "Requests holding a slot.", lambda: snap().n_running)
        r.gauge("fastserve_requests_waiting", "Requests waiting for a slot (queued or not yet seen by the decode "
                "thread).", lambda: snap().n_waiting + engine.stats().n_inbox)
        r.add(CounterFn("fastserve_prompt_tokens", "Prompt tokens computed.", lambda: snap().tokens_prompt))
        r.add(CounterFn("fastserve_generated_tokens", "Tokens generated.", lambda: snap().tokens_generated))
        r.add(CounterFn("fastserve_decode_steps", "Decode steps (the heartbeat).", lambda: snap().step))
        r.gauge("fastserve_slots_total", "Slots (-np).", lambda: info.n_slots)
        r.gauge("fastserve_slots_busy", "Slots running a request.", lambda: sum(1 for s in snap().slot_state if s))
        r.gauge("fastserve_kv_tokens", "Tokens held in the KV cache, all slots.", lambda: sum(snap().slot_tokens))
        r.gauge("fastserve_kv_usage_ratio", "Share of the KV cache in use.",
                lambda: sum(snap().slot_tokens) / (info.n_slots * info.n_ctx_slot))
        r.gauge("fastserve_seconds_since_last_step", "Seconds since the decode thread last published a step.",
                lambda: max(0.0, time.monotonic() - snap().t_step))
        r.gauge("fastserve_decode_stalled", "1 while work is pending and no step came for longer than "
                "--stall-limit.", lambda: 1 if app.stall_reason() else 0)
        r.add(CounterFn("fastserve_decode_stalls", "Times the decode loop was seen stalled.",
                        lambda: app.watchdog.stalls_seen(app.stall_reason())))
        self.ttft = r.histogram("fastserve_time_to_first_token_seconds", "Time from submit to the first token.",
                                LATENCY_BUCKETS)
        self.itl = r.histogram("fastserve_inter_token_latency_seconds", "Time between two tokens of a request, "
                               "as the HTTP side receives them.", TOKEN_BUCKETS)
        self.e2e = r.histogram("fastserve_request_duration_seconds", "Time from submit to the last token.",
                               LATENCY_BUCKETS)
        self.queue_time = r.histogram("fastserve_queue_time_seconds", "Time from submit to getting a slot "
                                      "(resolution: one watchdog tick).", LATENCY_BUCKETS)
        self.phase = r.histogram("fastserve_step_phase_seconds", "Host time per decode step in each phase "
                                 "(tracer; mean per step over each one-second window).", STEP_BUCKETS, ("phase",))
        if engine.stats().step_histogram is not None:
            r.add(HistogramFn("fastserve_step_seconds", "Wall time of each decode step, admit to publish "
                              "(idle waits excluded).", STEP_SECONDS_BUCKETS, lambda: engine.stats().step_histogram))
        self.http = r.counter("fastserve_http_requests", "HTTP requests answered, by status.", ("code",))
        self.requests_done = r.counter("fastserve_requests_finished", "Generations finished, by stop type.",
                                       ("stop_type",))
        self.deadlines = r.counter("fastserve_deadlines_expired", "Requests ended by a deadline.", ("kind",))
        self.rejected = r.counter("fastserve_requests_rejected", "Requests refused before they ran.", ("reason",))
        self.dropped = r.counter("fastserve_clients_dropped", "Connections dropped by the server.", ("reason",))
        self.disconnects = r.counter("fastserve_client_disconnects", "Requests cancelled because the client went "
                                     "away.")
        r.gauge("fastserve_connections", "Open HTTP connections.", lambda: len(app.connections))
        r.add(CounterFn("fastserve_log_lines_dropped", "Request log lines dropped (stderr too slow).",
                        lambda: app.log.dropped))
        self._trace_last = None

    def sample_tracer(self) -> None:
        """Called about once a second: per-phase mean ms/step since the last call, into the histogram."""
        st = self._engine.stats()
        if st.trace_ns is None:
            return
        now = (st.trace_steps, st.trace_ns)
        last, self._trace_last = self._trace_last, now
        if last is None or now[0] <= last[0]:
            return
        steps = now[0] - last[0]
        for phase, ns in now[1].items():
            self.phase.observe((ns - last[1].get(phase, 0)) / steps / 1e9, 1, phase)

    def render(self) -> bytes:
        self.llama.close_window()
        return self.registry.render()

    def headers(self) -> list:
        """llama-server's Process-Start-Time-Unix header (whole seconds since the epoch)."""
        return [("Process-Start-Time-Unix", str(int(self.app.started_wall)))]     # its case: clients match it exactly
