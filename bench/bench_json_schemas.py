"""Issue 15's property run: N random JSON schemas (tests/json_schemas.py) on the default model, greedy and
sampled at temperature 1.0, in one engine; every output must parse and validate with `jsonschema`.
CI runs 16 of them (tests/e2e/test_structured.py); this runs the issue's 200 and prints the tally.

Run: python bench/bench_json_schemas.py [--n 200] [--seed 1] [--parallel 16]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jsonschema

import fastserve

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.json_schemas import schemas  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--parallel", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=160)
    args = ap.parse_args()
    model = fastserve.load_model(fastserve.default_model_path())
    tok = model.tokenizer
    t0 = time.perf_counter()
    failures, n_tokens, finish = [], 0, {}
    with fastserve.Engine(model, n_parallel=args.parallel, n_ctx=args.parallel * 512, max_queue=2 * args.n) as engine:
        readers = []
        for i, schema in enumerate(schemas(args.n, seed=args.seed)):
            prompt = tok.apply_chat_template([{"role": "user", "content": "Reply with JSON for this schema: "
                                               + json.dumps(schema)}])
            for kw in (dict(temperature=0.0), dict(temperature=1.0, seed=i)):
                readers.append((schema, kw, engine.submit(prompt, json_schema=schema, max_tokens=args.max_tokens,
                                                          **kw)))
        for schema, kw, r in readers:
            out = r.result()
            n_tokens += len(out.token_ids)
            finish[out.finish_reason] = finish.get(out.finish_reason, 0) + 1
            try:
                jsonschema.validate(json.loads(out.text), schema)
            except (ValueError, jsonschema.ValidationError) as exc:
                failures.append((schema, kw, out.finish_reason, out.text, str(exc).splitlines()[0]))
    dt = time.perf_counter() - t0
    print(f"{len(readers)} outputs for {args.n} schemas (greedy and temperature 1.0): "
          f"{len(readers) - len(failures)} parse and validate, {len(failures)} fail; finish reasons {finish}; "
          f"{n_tokens} tokens in {dt:.1f} s")
    for schema, kw, reason, text, why in failures[:10]:
        print(f"  FAIL {kw} {reason}: {why}\n    schema {json.dumps(schema)[:200]}\n    output {text[:200]!r}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
