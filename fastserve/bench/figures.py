"""A level's figures from what its clients saw: throughput, TTFT, TPOT, ITL, e2e, errors, probes, RSS.

Window accounting: tokens that arrived in the window; TTFT of the requests whose first token came in
it; inter-token gaps that ended in it; e2e and TPOT of the requests that finished in it; errors of the
requests that failed in it. Missing figures are None (JSON null), never NaN.

An inter-token gap is the time between two arrivals of one stream, whole, however many tokens the
later one carried (as vLLM's and SGLang's benchmarks count ITL): a stall followed by a burst is one
long gap, not spread thin over the burst. TPOT is the per-token average, (last - first) / (n - 1).
"""
from __future__ import annotations

from collections import Counter

import numpy as np

from ..tracer import summarize
from .load import LevelRun

QS = (50, 90, 99)


def stats(xs, scale: float = 1.0) -> dict:
    """{p50, p90, p99, max, mean, n} of xs times scale; None for each when xs is empty."""
    if not len(xs):
        return {**{f"p{q}": None for q in QS}, "max": None, "mean": None, "n": 0}
    a = np.asarray(xs, dtype=np.float64) * scale
    return {**{f"p{q}": float(np.percentile(a, q)) for q in QS}, "max": float(a.max()), "mean": float(a.mean()),
            "n": int(a.size)}


def itl_series(run: LevelRun) -> list[tuple[float, float]]:
    """[(seconds since the window opened, gap seconds)] of every inter-token gap that ended in the window."""
    out = []
    for r in run.records:
        for (ta, _), (tb, _) in zip(r.arrivals, r.arrivals[1:]):
            if run.t0 <= tb <= run.t1:
                out.append((tb - run.t0, tb - ta))
    return out


def level_figures(run: LevelRun) -> dict:
    t0, t1 = run.t0, run.t1
    seconds = t1 - t0
    tokens, ttft, e2e, tpot = 0, [], [], []
    errors: Counter = Counter()
    finished = 0
    for r in run.records:
        tokens += sum(k for t, k in r.arrivals if t0 <= t <= t1)
        if r.arrivals and t0 <= r.arrivals[0][0] <= t1:
            ttft.append(r.arrivals[0][0] - r.t_sent)
        if r.done and t0 <= r.t_end <= t1:
            if r.error is not None:
                errors[r.error] += 1
                continue
            finished += 1
            e2e.append(r.t_end - r.t_sent)
            n = r.n_tokens
            if n > 1:
                tpot.append((r.arrivals[-1][0] - r.arrivals[0][0]) / (n - 1))
    gaps = [g for _, g in itl_series(run)]
    out = {
        "level": {"kind": run.level.kind, "value": run.level.value},
        "seconds": seconds,
        "tokens": tokens,
        "tok_s": tokens / seconds,
        "requests_finished": finished,
        "req_s": finished / seconds,
        "requests_sent": sum(1 for r in run.records if t0 <= r.t_sent <= t1),
        "ttft_ms": stats(ttft, 1e3),
        "tpot_ms": stats(tpot, 1e3),
        "itl_ms": stats(gaps, 1e3),
        "e2e_ms": stats(e2e, 1e3),
        "errors": dict(sorted(errors.items())),
        "probes": {path: probe_figures(out_, t0, t1) for path, out_ in run.probes.items()},
        "phases": phase_figures(run.trace),
        "rss_mib": rss_figures(run.rss, t0, t1),
        "client_cpu": None,
    }
    if run.client_cpu_s is not None:
        out["client_cpu"] = {"seconds": run.client_cpu_s, "core_share": run.client_cpu_s / seconds,
                             "us_per_token": run.client_cpu_s / tokens * 1e6 if tokens else None}
    return out


def probe_figures(samples: list, t0: float, t1: float) -> dict:
    """Latency of the probe's answers sent in the window, and its non-200 answers by status (0: no answer)."""
    inside = [(d, st) for t, d, st in samples if t0 <= t <= t1]
    bad = Counter(str(st) for _, st in inside if st != 200)
    return {**stats([d for d, st in inside if st == 200], 1e3), "non_200": dict(sorted(bad.items()))}


def phase_figures(trace: dict | None) -> dict | None:
    """The tracer's table of the window (tracer.summarize), plus ms/step outside the forward pass."""
    if not trace:
        return None
    s = summarize(trace)
    s["outside_forward_ms_per_step"] = s["host_ms_per_step"]
    return s


def rss_figures(samples: list, t0: float, t1: float) -> dict | None:
    if not samples:
        return None
    inside = [b for t, b in samples if t0 <= t <= t1] or [samples[-1][1]]
    return {"start": samples[0][1] / 2**20, "peak": max(inside) / 2**20, "end": samples[-1][1] / 2**20}


def median_of(rows: list[dict], path: tuple) -> float | None:
    """Median over the repeats of one figure (path into each row's dict), None when none has it."""
    vals = [v for v in (_get(r, path) for r in rows) if v is not None]
    return float(np.median(vals)) if vals else None


def ratio_spread(a_rows: list[dict], b_rows: list[dict], path: tuple) -> dict:
    """A / B of one figure: the ratio of the medians, and the min..max of the repeat-by-repeat ratios."""
    per = [x / y for x, y in ((_get(a, path), _get(b, path)) for a, b in zip(a_rows, b_rows))
           if x is not None and y]
    ma, mb = median_of(a_rows, path), median_of(b_rows, path)
    return {"a": ma, "b": mb, "ratio": ma / mb if ma is not None and mb else None,
            "min": min(per) if per else None, "max": max(per) if per else None, "repeats": len(per)}


def _get(d, path):
    for k in path:
        if not isinstance(d, dict) or d.get(k) is None:
            return None
        d = d[k]
    return d
