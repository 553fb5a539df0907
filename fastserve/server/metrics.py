"""/metrics through prometheus_client: llama-server's `llamacpp:*` metrics beside fastserve's own.

Two kinds of metric, one registry per App (never the global one: tests run several Apps):
- observed on the event loop as things happen (latency histograms, counts by label): the library's
  Counter and Histogram, whose `inc(amount, *labels)` / `observe(v, count, *labels)` take the labels
  positionally (the call sites stay one short line);
- read at scrape time (ServerCollector): engine state from the snapshot the decode thread publishes
  (DESIGN.md contract 5: a scrape never asks the decode thread anything), the tracer's step histogram,
  and llama-server's counters and rates, which LlamaTotals accumulates as requests end.

llama-server's gauges prompt_tokens_seconds and predicted_tokens_seconds are averages over the
window since the previous scrape (reset by each scrape, as llama-server does); the generation rate
counts a request's tokens after its first (the first comes from the prompt's pass, not a decode step).
Not shown, because fastserve has no such thing: the speculative-decoding counters and
n_busy_slots_per_decode (the engine does not count busy slots per step).
"""
from __future__ import annotations

import time

import prometheus_client as prom
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from ..tracer import STEP_SECONDS_BUCKETS

# Bucket upper bounds, seconds.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0)
STEP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
CONTENT_TYPE = prom.CONTENT_TYPE_LATEST


class Counter(prom.Counter):
    def inc(self, amount: float = 1, *labels) -> None:
        if labels:
            self.labels(*labels).inc(amount)
        else:
            super().inc(amount)


class Histogram(prom.Histogram):
    def observe(self, amount: float, count: int = 1, *labels) -> None:
        """count observations of amount (seconds): a batch of tokens read at once counts each token."""
        target = self.labels(*labels) if labels else None
        for _ in range(count):
            if target is not None:
                target.observe(amount)
            else:
                super().observe(amount)


class LlamaTotals:
    """llama-server's request totals, added to when a request ends (Generation.close calls add()).
    Cumulative since start, plus the window since the last scrape for the two rates."""

    def __init__(self):
        self.prompt_n = self.prompt_cached = self.predicted_n = 0
        self.prompt_s = self.predicted_s = 0.0
        self.n_tokens_max = 0
        self.window = [0, 0.0, 0, 0.0]        # prompt tokens, prompt s, decode steps, decode s

    def add(self, gen) -> None:
        """gen: a Generation that ended (however it ended)."""
        adm = gen.admission
        n_gen = len(gen.ids)
        self.n_tokens_max = max(self.n_tokens_max, gen.n_prompt + n_gen)
        if gen.t_first is None:               # it never computed its prompt to the end
            return
        t0 = gen.t_admit if gen.t_admit is not None else gen.t_submit
        t_end = gen.t_end if gen.t_end is not None else time.monotonic()
        n_eval = gen.n_prompt - adm.n_cached
        prompt_s, gen_s = max(0.0, gen.t_first - t0), max(0.0, t_end - gen.t_first)
        self.prompt_n += n_eval
        self.prompt_cached += adm.n_cached
        self.prompt_s += prompt_s
        self.predicted_n += n_gen
        self.predicted_s += gen_s
        w = self.window
        w[0] += n_eval
        w[1] += prompt_s
        w[2] += max(0, n_gen - 1)
        w[3] += gen_s

    def take_rates(self) -> tuple[float, float]:
        """(prompt tokens/s, generated tokens/s) over the window since the last call; starts a new window."""
        p_n, p_s, g_n, g_s = self.window
        self.window = [0, 0.0, 0, 0.0]
        return (p_n / p_s if p_s > 0 else 0.0), (g_n / g_s if g_s > 0 else 0.0)


class ServerCollector:
    """Everything read at scrape time: a prometheus_client custom collector."""

    def __init__(self, app):
        self.app = app

    def describe(self):
        return []                             # no registration-time collect() (the engine may still start)

    def collect(self):
        app = self.app
        eng = app.engine
        snap = eng.snapshot
        tr = eng.tracer
        llama = app.metrics.llama
        busy = sum(1 for s in snap.slot_state if s)
        kv = sum(snap.slot_tokens)
        steps = tr.steps if tr is not None else snap.step
        prompt_rate, gen_rate = llama.take_rates()
        waiting = snap.n_waiting + len(eng.inbox)

        def counter(name, help, value):
            return CounterMetricFamily(name, help, value=float(value))

        def gauge(name, help, value):
            return GaugeMetricFamily(name, help, value=float(value))

        # llama-server's names and help texts (tools/server: server_task_result_metrics)
        yield counter("llamacpp:prompt_tokens", "Number of prompt tokens processed, excluding cached tokens",
                      llama.prompt_n)
        yield counter("llamacpp:prompt_tokens_cached", "Number of prompt tokens reused from the cache",
                      llama.prompt_cached)
        yield counter("llamacpp:prompt_seconds", "Total time spent processing prompts", llama.prompt_s)
        yield counter("llamacpp:tokens_predicted", "Number of generation tokens processed", llama.predicted_n)
        yield counter("llamacpp:tokens_predicted_seconds", "Total time spent generating tokens", llama.predicted_s)
        yield counter("llamacpp:n_decode", "Total number of decode steps (llama_decode() calls in llama-server)",
                      steps)
        # a counter in llama-server, but a maximum is a gauge (a counter would have to end in _total)
        yield gauge("llamacpp:n_tokens_max", "Largest observed sequence length (prompt + generation)",
                    max(llama.n_tokens_max, max(snap.slot_tokens, default=0)))
        yield gauge("llamacpp:prompt_tokens_seconds", "Average prompt throughput in tokens/s", prompt_rate)
        yield gauge("llamacpp:predicted_tokens_seconds", "Average generation throughput in tokens/s", gen_rate)
        yield gauge("llamacpp:requests_processing", "Number of requests processing", busy)
        yield gauge("llamacpp:requests_deferred", "Number of requests deferred", waiting)

        # fastserve's own
        yield gauge("fastserve_requests_running", "Requests holding a slot.", snap.n_running)
        yield gauge("fastserve_requests_waiting", "Requests waiting for a slot (queued or not yet seen by the "
                    "decode thread).", waiting)
        yield counter("fastserve_prompt_tokens", "Prompt tokens computed.", snap.tokens_prompt)
        yield counter("fastserve_generated_tokens", "Tokens generated.", snap.tokens_generated)
        yield counter("fastserve_decode_steps", "Decode steps (the heartbeat).", snap.step)
        yield gauge("fastserve_slots_total", "Slots (-np).", eng.n_slots)
        yield gauge("fastserve_slots_busy", "Slots running a request.", busy)
        yield gauge("fastserve_kv_tokens", "Tokens held in the KV cache, all slots.", kv)
        yield gauge("fastserve_kv_usage_ratio", "Share of the KV cache in use.", kv / (eng.n_slots * eng.n_ctx_slot))
        yield gauge("fastserve_seconds_since_last_step", "Seconds since the decode thread last published a step.",
                    max(0.0, time.monotonic() - snap.t_step))
        yield gauge("fastserve_decode_stalled", "1 while work is pending and no step came for longer than "
                    "--stall-limit.", 1 if app.stall_reason() else 0)
        yield gauge("fastserve_connections", "Open HTTP connections.", len(app.connections))
        yield counter("fastserve_log_lines_dropped", "Request log lines dropped (stderr too slow).", app.log.dropped)
        if tr is not None:
            counts, total = tr.step_histogram()
            acc, buckets = 0, []
            for le, c in zip(STEP_SECONDS_BUCKETS + (float("inf"),), counts):
                acc += c
                buckets.append((prom.utils.floatToGoString(le), acc))
            yield HistogramMetricFamily("fastserve_step_seconds", "Wall time of each decode step, admit to publish "
                                        "(idle waits excluded).", buckets=buckets, sum_value=total)


class ServerMetrics:
    """Every metric /metrics shows, in one prometheus_client registry of this App's own."""

    def __init__(self, app):
        self.app = app
        self.llama = LlamaTotals()
        r = self.registry = prom.CollectorRegistry(auto_describe=False)
        r.register(ServerCollector(app))
        self.stalls = Counter("fastserve_decode_stalls", "Times the decode loop was seen stalled.", registry=r)
        self.ttft = Histogram("fastserve_time_to_first_token_seconds", "Time from submit to the first token.",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("fastserve_inter_token_latency_seconds", "Time between two tokens of a request, "
                             "as the HTTP side receives them.", buckets=TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram("fastserve_request_duration_seconds", "Time from submit to the last token.",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("fastserve_queue_time_seconds", "Time from submit to getting a slot "
                                    "(resolution: one watchdog tick).", buckets=LATENCY_BUCKETS, registry=r)
        self.phase = Histogram("fastserve_step_phase_seconds", "Host time per decode step in each phase "
                               "(tracer; mean per step over each one-second window).", ("phase",),
                               buckets=STEP_BUCKETS, registry=r)
        self.http = Counter("fastserve_http_requests", "HTTP requests answered, by status.", ("code",), registry=r)
        self.requests_done = Counter("fastserve_requests_finished", "Generations finished, by stop type.",
                                     ("stop_type",), registry=r)
        self.deadlines = Counter("fastserve_deadlines_expired", "Requests ended by a deadline.", ("kind",),
                                 registry=r)
        self.rejected = Counter("fastserve_requests_rejected", "Requests refused before they ran.", ("reason",),
                                registry=r)
        self.dropped = Counter("fastserve_clients_dropped", "Connections dropped by the server.", ("reason",),
                               registry=r)
        self.disconnects = Counter("fastserve_client_disconnects", "Requests cancelled because the client went "
                                   "away.", registry=r)
        self._trace_last = None

    def sample_tracer(self) -> None:
        """Called about once a second: per-phase mean ms/step since the last call, into the histogram."""
        tr = self.app.engine.tracer
        if tr is None:
            return
        now = (tr.steps, dict(tr.ns))
        last, self._trace_last = self._trace_last, now
        if last is None or now[0] <= last[0]:
            return
        steps = now[0] - last[0]
        for phase, ns in now[1].items():
            self.phase.observe((ns - last[1].get(phase, 0)) / steps / 1e9, 1, phase)

    def render(self) -> bytes:
        return prom.generate_latest(self.registry)

    def headers(self) -> list:
        """llama-server's Process-Start-Time-Unix header (whole seconds since the epoch)."""
        return [("process-start-time-unix", str(int(self.app.started_wall)))]
