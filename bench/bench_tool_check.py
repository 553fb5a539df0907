"""`fastserve bench`'s tokens/s against an independent client on the same load (issue 17's acceptance).

Alternates, on one running server: the tool's own load (fastserve.bench.load.run_level, httpx streams)
and bench/httpload.py's closed loop (raw asyncio sockets, another SSE parser and token count), the
same clients, n_predict, prompt lengths and window, --repeats times; prints both figures, their ratio,
and the CPU time this process spent per token in each (the clients' own overhead).

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
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=None)) as client:
        run = await run_level(Target("t", url), Level("clients", clients), prompts, Params(n_predict), warmup, seconds,
                              client=client)
    f = level_figures(run)
    return f["tok_s"], run.client_cpu_s


async def independent(port, ids, clients, n_predict, warmup, seconds) -> tuple[float, float]:
    t0 = time.process_time()
    w = await closed_loop(port, ids, clients, seconds, warmup, n_predict, probes=())
    return w.result.row()["tok_s"], time.process_time() - t0      # CPU over warm-up + window


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
    tok = HttpTokenizer(port)
    ids = make_prompts(tok, 64, lo, hi)
    # the same prompts for both: the tool's as text, detokenized by the server
    import httpx
    texts = [httpx.post(a.url + "/detokenize", json={"tokens": p}).json()["content"] for p in ids]
    prompts = [Prompt(t, "english") for t in texts]
    print(f"{'repeat':>6} {'tool tok/s':>10} {'independent':>11} {'ratio':>6} {'tool CPU us/tok':>15}")
    ratios = []
    for rep in range(a.repeats):
        t_tok, t_cpu = asyncio.run(tool(a.url, prompts, a.clients, a.n_predict, a.warmup, a.seconds))
        i_tok, _ = asyncio.run(independent(port, ids, a.clients, a.n_predict, a.warmup, a.seconds))
        ratios.append(t_tok / i_tok)
        print(f"{rep + 1:>6} {t_tok:>10.1f} {i_tok:>11.1f} {t_tok / i_tok:>6.2f} "
              f"{t_cpu / max(t_tok * a.seconds, 1) * 1e6:>15.0f}", flush=True)
    print(f"ratio tool / independent: median {sorted(ratios)[len(ratios) // 2]:.3f}, "
          f"range {min(ratios):.3f}..{max(ratios):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
