"""Host-stall tracer: where each decode step's time goes.

Phases of a step, in order: admit (inbox, slot assignment), build (batch
assembly), forward (the backend's submit; on the CPU backend the whole pass),
sync (waiting for the device), sample, publish (commit, delivery, wake-up,
snapshot). Each phase ends with its lap, where it ends; a step starts where
the last one (or the idle wait before it) ended. Idle is time the decode
thread slept with nothing to do.

Off (the default), the engine pays one `if` per phase boundary.
"""
from __future__ import annotations

import time
from bisect import bisect_left

PHASES = ("admit", "build", "forward", "sync", "sample", "publish")
DEVICE_PHASES = ("forward", "sync")
# Upper bounds (seconds) of the histogram of whole-step wall times (admit to publish), shown on
# /metrics as fastserve_step_seconds: a step's tail, which per-phase means hide.
STEP_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.2, 0.25, 0.35,
                        0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
_STEP_BOUNDS_NS = tuple(int(b * 1e9) for b in STEP_SECONDS_BUCKETS)


class Tracer:
    def __init__(self):
        self.ns = {p: 0 for p in PHASES}
        self.steps = 0
        self.idle_ns = 0
        self.sent_tokens = 0
        self.send_ns = 0
        self.step_counts = [0] * (len(STEP_SECONDS_BUCKETS) + 1)   # steps per bucket, the last one +Inf
        self.step_ns = 0                                            # sum of whole-step wall times
        self.drafted = self.accepted = 0                            # speculative decoding's tokens
        self._t = self._t_step = time.perf_counter_ns()             # where the phase and the step began

    def lap(self, phase: str) -> None:
        t = time.perf_counter_ns()
        self.ns[phase] += t - self._t
        self._t = t

    def end_step(self) -> None:
        """The last phase (publish) ends: count the step, and its wall time in the histogram; the next begins."""
        self.lap("publish")
        self.steps += 1
        ns = self._t - self._t_step
        self.step_ns += ns
        self.step_counts[bisect_left(_STEP_BOUNDS_NS, ns)] += 1
        self._t_step = self._t

    def step_histogram(self) -> tuple[tuple, float]:
        """(steps per bucket of STEP_SECONDS_BUCKETS plus +Inf, total seconds): a copy, safe to read from
        another thread while steps go on."""
        return tuple(self.step_counts), self.step_ns / 1e9

    def sends(self, n_tokens: int, ns: int) -> None:
        self.sent_tokens += n_tokens
        self.send_ns += ns

    def drafts(self, drafted: int, accepted: int) -> None:
        """A step verified drafted tokens (speculative decoding), of which accepted were kept."""
        self.drafted += drafted
        self.accepted += accepted

    def idle(self, ns: int) -> None:
        """The decode thread slept ns with nothing to do; the next step begins now."""
        self.idle_ns += ns
        self._t = self._t_step = time.perf_counter_ns()

    def totals(self) -> dict:
        """The raw running totals (ns, counts): what GET /trace serves; two of them give a window (delta)."""
        return {"steps": self.steps, "ns": dict(self.ns), "idle_ns": self.idle_ns, "sent_tokens": self.sent_tokens,
                "send_ns": self.send_ns, "step_ns": self.step_ns, "step_counts": list(self.step_counts),
                "drafted": self.drafted, "accepted": self.accepted}


def delta(later: dict, earlier: dict) -> dict:
    """Totals of the steps between two totals() readings."""
    out = {k: later[k] - earlier[k] for k in ("steps", "idle_ns", "sent_tokens", "send_ns", "step_ns")}
    out["ns"] = {p: later["ns"][p] - earlier["ns"].get(p, 0) for p in later["ns"]}
    out["step_counts"] = [a - b for a, b in zip(later["step_counts"], earlier["step_counts"])]
    for k in ("drafted", "accepted"):          # (a server from before speculative decoding has none)
        out[k] = later.get(k, 0) - earlier.get(k, 0)
    return out


def summarize(t: dict) -> dict:
    """ms per step for each phase, µs per delivered token, host and device shares of the step, idle time."""
    steps = max(t["steps"], 1)
    total = sum(t["ns"].values())
    host = total - sum(t["ns"].get(p, 0) for p in DEVICE_PHASES)
    return {
        "steps": t["steps"],
        "ms_per_step": {p: t["ns"].get(p, 0) / steps / 1e6 for p in PHASES},
        "step_ms": total / steps / 1e6,
        "host_ms_per_step": host / steps / 1e6,
        "host_share": host / total if total else 0.0,
        "device_share": (total - host) / total if total else 0.0,
        "send_us_per_token": t["send_ns"] / t["sent_tokens"] / 1e3 if t["sent_tokens"] else 0.0,
        "tokens_sent": t["sent_tokens"],
        "idle_s": t["idle_ns"] / 1e9,
        "busy_s": total / 1e9,
        "drafted": t.get("drafted", 0),
        "acceptance": t["accepted"] / t["drafted"] if t.get("drafted") else None,
    }


def format_summary(s: dict) -> str:
    """The tracer's table, as a profiler would print it."""
    lines = [f"{'phase':<10}{'ms/step':>10}{'share':>8}"]
    for p, ms in s["ms_per_step"].items():
        share = ms / s["step_ms"] if s["step_ms"] else 0.0
        lines.append(f"{p:<10}{ms:>10.3f}{share:>8.1%}")
    lines.append(f"{'step':<10}{s['step_ms']:>10.3f}")
    lines.append(f"host work {s['host_ms_per_step']:.3f} ms/step ({s['host_share']:.1%} of the step); "
                 f"send {s['send_us_per_token']:.3f} µs/token over {s['tokens_sent']} tokens; "
                 f"{s['steps']} steps; idle {s['idle_s']:.2f} s")
    if "device_share" in s:
        lines.append(f"device (forward + sync) busy {s['device_share']:.1%} of the step; the decode thread idle "
                     f"{s['idle_s']:.2f} s of {s['idle_s'] + s['busy_s']:.2f} s (neither side working)")
    return "\n".join(lines)
