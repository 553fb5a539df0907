"""A bench run's result as text (the terminal tables) and as JSON (every figure, exactly as measured)."""
from __future__ import annotations

import json
from pathlib import Path

from ..tracer import format_summary
from .figures import median_of, ratio_spread
from .load import level_label

# (label, path into a level's figures, format, scale) of the main table and of the A/B table
COLUMNS = (
    ("tok/s", ("tok_s",), "{:.1f}"),
    ("req/s", ("req_s",), "{:.2f}"),
    ("ttft p50", ("ttft_ms", "p50"), "{:.0f}ms"),
    ("ttft p99", ("ttft_ms", "p99"), "{:.0f}ms"),
    ("tpot p50", ("tpot_ms", "p50"), "{:.1f}ms"),
    ("itl p50", ("itl_ms", "p50"), "{:.1f}ms"),
    ("itl p90", ("itl_ms", "p90"), "{:.1f}ms"),
    ("itl p99", ("itl_ms", "p99"), "{:.1f}ms"),
    ("itl max", ("itl_ms", "max"), "{:.0f}ms"),
    ("e2e p50", ("e2e_ms", "p50"), "{:.0f}ms"),
    ("draft acc", ("phases", "acceptance"), "{:.0%}"),     # speculative decoding: accepted / drafted tokens
)
AB_FIGURES = COLUMNS + (("health p99", ("probes", "/health", "p99"), "{:.2f}ms"),
                        ("step ms", ("phases", "step_ms"), "{:.2f}"),
                        ("outside fwd", ("phases", "outside_forward_ms_per_step"), "{:.2f}"))


def _fmt(fmt: str, v) -> str:
    return "-" if v is None else fmt.format(v)


def rows_of(result: dict, name: str, lv: dict) -> list[dict]:
    return [r["figures"] for r in result["runs"] if r["target"] == name and r["level"] == lv]


def tables(result: dict) -> str:
    names = [t["name"] for t in result["targets"]]
    width = max(len(n) for n in names)
    s = result["settings"]
    lines = [f"fastserve bench: {s['api_note']}; n_predict {s['n_predict']}, "
             f"{'greedy' if s['temperature'] == 0 else 'temperature %g' % s['temperature']}"
             f"{', ignore_eos' if s['ignore_eos'] else ''}; {s['prompts']['n']} prompts ({s['prompts']['source']}, "
             f"{s['prompts']['tokens']}); {s['warmup_s']:g} s warm-up + {s['duration_s']:g} s measured per level, "
             f"{s['repeats']} repeat(s); figures are medians of the repeats", ""]
    head = f"{'level':>11} {'target':<{width}} " + " ".join(f"{c[0]:>9}" for c in COLUMNS) + \
        f" {'/health p99':>11} {'RSS peak':>9} {'client CPU':>10}  errors"
    lines.append(head)
    for lv in result["levels"]:
        for name in names:
            rows = rows_of(result, name, lv)
            cells = [_fmt(fmt, median_of(rows, path)) for _, path, fmt in COLUMNS]
            health = median_of(rows, ("probes", "/health", "p99"))
            rss = median_of(rows, ("rss_mib", "peak"))
            cpu = median_of(rows, ("client_cpu", "core_share"))
            errors: dict = {}
            for r in rows:
                for k, v in r["errors"].items():
                    errors[k] = errors.get(k, 0) + v
            lines.append(f"{level_label(lv):>11} {name:<{width}} " + " ".join(f"{c:>9}" for c in cells) +
                         f" {_fmt('{:.2f}ms', health):>11} {_fmt('{:.0f}MiB', rss):>9} {_fmt('{:.0%}', cpu):>10}"
                         f"  {errors or ''}")
    probes = _probe_lines(result, names)
    if probes:
        lines += ["", "probes timed beside the load (p50 / p99 / max ms of the 200s; non-200 answers by status):"]
        lines += probes
    for name in names:
        for lv in result["levels"]:
            rows = [r for r in rows_of(result, name, lv) if r["phases"]]
            if rows:
                lines += ["", f"phase table, {name}, {level_label(lv)} (first repeat):", format_summary(rows[0]["phases"])]
    if len(names) == 2:
        lines += ["", f"A/B: {names[0]} / {names[1]} (ratio of the medians, [min..max] of the repeats' ratios)",
                  f"{'level':>11} {'figure':<12} {names[0]:>10} {names[1]:>10} {'ratio':>7}  spread"]
        for entry in result["ab"]:
            for label, path, fmt in AB_FIGURES:
                q = entry["figures"][label]
                if q["a"] is None and q["b"] is None:
                    continue
                spread = f"[{q['min']:.2f}..{q['max']:.2f}]" if q["min"] is not None and q["repeats"] > 1 else ""
                lines.append(f"{level_label(entry['level']):>11} {label:<12} {_fmt(fmt, q['a']):>10} "
                             f"{_fmt(fmt, q['b']):>10} {_fmt('{:.2f}', q['ratio']):>7}  {spread}")
    oh = result.get("client_overhead")
    if oh:
        lines += ["", oh]
    return "\n".join(lines)


def _probe_lines(result: dict, names: list) -> list[str]:
    out = []
    for lv in result["levels"]:
        for name in names:
            rows = rows_of(result, name, lv)
            if not rows or not rows[0]["probes"]:
                continue
            parts = []
            for path in rows[0]["probes"]:
                p = [median_of(rows, ("probes", path, k)) for k in ("p50", "p99", "max")]
                bad = rows[0]["probes"][path]["non_200"]
                parts.append(f"{path} " + "/".join(_fmt("{:.2f}", v) for v in p) + (f" {bad}" if bad else ""))
            out.append(f"{level_label(lv):>11} {name}: " + "; ".join(parts))
    return out


def ab_table(result: dict) -> list[dict]:
    """Per level: each AB figure of target A and B, their ratio and its spread over the repeats."""
    a, b = (t["name"] for t in result["targets"])
    return [{"level": lv, "figures": {label: ratio_spread(rows_of(result, a, lv), rows_of(result, b, lv), path)
                                      for label, path, _ in AB_FIGURES}} for lv in result["levels"]]


def write_json(result: dict, path: str | Path) -> None:
    """Strict JSON (no NaN: missing figures are null), so that json.loads gives back the same dict."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=1, allow_nan=False))
