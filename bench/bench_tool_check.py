"""`fastserve bench`'s tokens/s against an independent client on the same load (issue 17's acceptance).

Two comparisons on one running server, --repeats times each, between the tool's own load
(fastserve.bench.load.run_level, httpx streams) and bench/httpload.py's closed loop (raw asyncio
sockets, another SSE parser and token count), the same prompts, n_predict and window:
- one after the other, --clients each: what the acceptance asks, but on a shared machine the noise
  between two runs of one load (20-30 % on 2 busy cores) is larger than the bar;
- together, --clients / 2 each, on one event loop over one window: the server decodes every stream
  in the same steps, so the two clients' tokens/s must match whatever the machine does
  (tests/e2e/test_bench_tool.py runs this one).
It prints both figures, their ratio, and the tool's CPU time per token (the client's own overhead).

Run: python bench/bench_tool_check.py --url http://127.0.0.1:8080 [--clients 8] [--repeats 3]
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from httpload import HttpTokenizer, closed_loop  # noqa: E402

from fastserve.bench import make_prompts  # noqa: E402
from fastserve.bench.client import Params, Target  # noqa: E402
from fastserve.bench.figures import level_figures  # noqa: E402
from fastserve.bench.load import Level, run_level  # noqa: E402
from fastserve.bench.prompts import Prompt  # noqa: E402


async def tool(url, prompts, clients, n_predict, warmup, seconds) -> tuple[float, float]:
    import httpx
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)     # as fastserve bench: no reuse
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        run = await run_level(Target("t", url), Level("clients", clients), prompts, Params(n_predict), warmup, seconds,
                              client=client)
    return level_figures(run)["tok_s"], run.client_cpu_s


async def independent(port, ids, clients, n_predict, warmup, seconds) -> float:
    w = await closed_loop(port, ids, clients, seconds, warmup, n_predict, probes=())
    return w.result.row()["tok_s"]


async def together(url, ids, texts, clients, n_predict, warmup, seconds) -> tuple[float, float]:
    """(the tool's tok/s, the independent client's): `clients` streams each, at once, over one window."""
    port = int(url.rsplit(":", 1)[1].rstrip("/"))
    (t_tok, _), i_tok = await asyncio.gather(tool(url, [Prompt(t, "english") for t in texts], clients, n_predict,
                                                  warmup, seconds),
                                             independent(port, ids, clients, n_predict, warmup, seconds))
    return t_tok, i_tok


def same_prompts(url: str, n: int, lo: int, hi: int) -> tuple[list, list]:
    """n prompts of lo..hi token ids (the independent client's) and their text (the tool's), by the server."""
    import httpx
    port = int(url.rsplit(":", 1)[1].rstrip("/"))
    ids = make_prompts(HttpTokenizer(port), n, lo, hi)
    with httpx.Client(timeout=30) as c:
        texts = [c.post(url + "/detokenize", json={"tokens": p}).json()["content"] for p in ids]
    return ids, texts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("-n", "--n-predict", type=int, default=64)
    ap.add_argument("--warmup", type=float, default=2.0)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--prompt-tokens", default="16-32")
    a = ap.parse_args(argv)
    lo, hi = (int(x) for x in a.prompt_tokens.split("-"))
    port = int(a.url.rsplit(":", 1)[1].rstrip("/"))
    ids, texts = same_prompts(a.url, 64, lo, hi)
    prompts = [Prompt(t, "english") for t in texts]
    print(f"{'mode':>13} {'repeat':>6} {'tool tok/s':>10} {'independent':>11} {'ratio':>6} {'tool CPU us/tok':>15}")
    for mode in ("one by one", "together"):
        ratios = []
        for rep in range(a.repeats):
            if mode == "together":
                t_tok, i_tok = asyncio.run(together(a.url, ids, texts, a.clients // 2 or 1, a.n_predict, a.warmup,
                                                    a.seconds))
                cpu = ""
            else:
                t_tok, t_cpu = asyncio.run(tool(a.url, prompts, a.clients, a.n_predict, a.warmup, a.seconds))
                i_tok = asyncio.run(independent(port, ids, a.clients, a.n_predict, a.warmup, a.seconds))
                cpu = f"{t_cpu / max(t_tok * a.seconds, 1) * 1e6:.0f}"
            ratios.append(t_tok / i_tok)
            print(f"{mode:>13} {rep + 1:>6} {t_tok:>10.1f} {i_tok:>11.1f} {t_tok / i_tok:>6.2f} {cpu:>15}", flush=True)
        print(f"{mode}: ratio tool / independent, median {sorted(ratios)[len(ratios) // 2]:.3f}, "
              f"range {min(ratios):.3f}..{max(ratios):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
