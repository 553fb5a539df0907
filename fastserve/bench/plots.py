"""PNG figures of a bench run (matplotlib, Agg backend: no display needed), each SIZE pixels.

itl_over_time.png   every inter-token gap against time in the window, a panel per target and a
                    colour per level (the first repeat): a host stall is a column of dots far above
                    the band (log scale), gaps over STALL_FACTOR x the median marked in red
concurrency.png     tokens/s and TTFT p50 against the level, a line per target
phases.png          the tracer's ms per step by phase, stacked, a bar per target and level (targets
                    with a tracer only: in-process and fastserve servers)
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ..tracer import PHASES
from .figures import itl_series, median_of
from .load import level_label

SIZE = (1200, 700)      # pixels: (width, height)
STALL_FACTOR = 4.0      # inter-token gaps this many times the panel's median are marked
DPI = 100


def _figure(plt, nrows=1, ncols=1, **kw):
    return plt.subplots(nrows, ncols, figsize=(SIZE[0] / DPI, SIZE[1] / DPI), dpi=DPI, squeeze=False, **kw)


def write_plots(result: dict, runs: list, out_dir: str | Path) -> list[str]:
    """Write the three PNGs into out_dir; runs: the LevelRuns (for the raw gaps). Returns the paths."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullFormatter

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    names = [t["name"] for t in result["targets"]]
    paths = []

    fig, axes = _figure(plt, len(names), 1, sharex=True)
    for ax, name in zip(axes[:, 0], names):
        seen, stalls = set(), []
        for run in runs:
            key = (run.level.kind, run.level.value)
            if run.target.name != name or key in seen:
                continue
            seen.add(key)
            pts = itl_series(run)
            if pts:
                ax.scatter([t for t, _ in pts], [g * 1e3 for _, g in pts], s=3, alpha=0.5, label=str(run.level))
                stalls.extend(pts)
        if stalls:      # gaps far above the body of every stream: where a host stall would show
            cut = STALL_FACTOR * float(np.median([g for _, g in stalls]))
            far = [(t, g) for t, g in stalls if g > cut]
            if far:
                ax.scatter([t for t, _ in far], [g * 1e3 for _, g in far], s=30, marker="x", color="red",
                           label=f"gap > {STALL_FACTOR:g}x the median ({len(far)})")
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_ylabel("inter-token gap, ms")
        ax.set_title(name, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        if seen:
            ax.legend(loc="upper right", fontsize=8, markerscale=3)
    axes[-1, 0].set_xlabel("seconds since the window opened")
    fig.suptitle("Inter-token gaps over time (first repeat of each level)")
    paths.append(_save(fig, plt, out / "itl_over_time.png"))

    fig, axes = _figure(plt, 1, 2)
    kind = result["levels"][0]["kind"] if result["levels"] else "clients"
    for name in names:
        xs, tok, ttft = [], [], []
        for lv in result["levels"]:
            rows = [r["figures"] for r in result["runs"] if r["target"] == name and r["level"] == lv]
            xs.append(lv["value"])
            tok.append(median_of(rows, ("tok_s",)))
            ttft.append(median_of(rows, ("ttft_ms", "p50")))
        axes[0, 0].plot(xs, tok, marker="o", label=name)
        axes[0, 1].plot(xs, [None if v is None else v / 1e3 for v in ttft], marker="o", label=name)
    for ax, ylab in zip(axes[0], ("tokens/s (all streams)", "time to first token p50, s")):
        ax.set_xlabel("concurrent clients" if kind == "clients" else "requests/s offered")
        ax.set_ylabel(ylab)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        if len(xs) > 1 and min(xs) > 0 and max(xs) / min(xs) >= 8:
            ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [f"{x:g}" for x in xs])
        ax.minorticks_off()
    fig.suptitle("Throughput and TTFT against load (median of the repeats)")
    paths.append(_save(fig, plt, out / "concurrency.png"))

    fig, axes = _figure(plt)
    ax = axes[0, 0]
    bars = []
    for name in names:
        for lv in result["levels"]:
            rows = [r["figures"] for r in result["runs"] if r["target"] == name and r["level"] == lv
                    and r["figures"]["phases"]]
            if rows:
                bars.append((f"{name}\n{level_label(lv)}",
                             [median_of(rows, ("phases", "ms_per_step", p)) or 0.0 for p in PHASES]))
    bottom = [0.0] * len(bars)
    for j, phase in enumerate(PHASES):
        vals = [b[1][j] for b in bars]
        ax.bar(range(len(bars)), vals, bottom=bottom, label=phase, hatch="" if phase in ("forward", "sync") else "//")
        bottom = [x + v for x, v in zip(bottom, vals)]
    ax.set_xticks(range(len(bars)), [b[0] for b in bars], fontsize=8)
    ax.set_ylabel("ms per step")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    if not bars:
        ax.text(0.5, 0.5, "no target with a tracer (in-process, or a fastserve server's /trace)",
                ha="center", va="center", transform=ax.transAxes)
    fig.suptitle("Where a step's time goes (hatched: host work outside the forward pass)")
    paths.append(_save(fig, plt, out / "phases.png"))
    return paths


def _save(fig, plt, path: Path) -> str:
    fig.savefig(path, dpi=DPI)      # no bbox_inches="tight": every PNG is exactly SIZE
    plt.close(fig)
    return str(path)
