"""Record llama-server's embeddings of a few short texts on the default model into tests/golden/data.

    python tests/golden/record_embeddings.py --llama-server ~/llama-peer/build/bin/llama-server

For each pooling (mean, last) it starts `llama-server -m MODEL --embedding --pooling P -t 2 -c 2048 -np 1`,
asks /tokenize (add_special true) and /v1/embeddings (default embd_normalize: Euclidean) for every text, and
writes smollm2_q41_llamacpp_embeddings.json: the texts, their token ids, and each pooling's vectors (float32
values rounded to 7 significant digits). tests/golden/test_embeddings.py compares fastserve's against it;
only this recording needs the peer.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
from httpload import ServerProcess, free_port  # noqa: E402  (bench/: how every recorder starts a server)

DATA = Path(__file__).resolve().parent / "data" / "smollm2_q41_llamacpp_embeddings.json"
TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France.",
    "def add(a, b):\n    return a + b",
    "x",
    "Embeddings turn text into vectors; similar meanings land close together.",
]
POOLINGS = ("mean", "last")


def _post(port: int, path: str, body: dict) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-server", default=os.path.expanduser("~/llama-peer/build/bin/llama-server"))
    ap.add_argument("--model", default=os.path.expanduser("~/.cache/fastserve/SmolLM2-135M-Instruct.Q4_1.gguf"))
    args = ap.parse_args()
    out = {"metadata": {"model": os.path.basename(args.model), "recorded_with":
                        "llama-server --embedding --pooling P -t 2 -c 2048 -np 1, POST /v1/embeddings "
                        "(embd_normalize default 2: Euclidean)"},
           "texts": TEXTS, "token_ids": [], "vectors": {}}
    for pooling in POOLINGS:
        port = free_port()
        cmd = [args.llama_server, "-m", args.model, "--embedding", "--pooling", pooling, "-t", "2", "-c", "2048",
               "-np", "1", "--port", str(port), "--host", "127.0.0.1"]
        server = ServerProcess(cmd, port, Path(tempfile.gettempdir()) / f"record_embeddings_{pooling}.log", 120.0)
        try:
            if not out["token_ids"]:
                out["token_ids"] = [_post(port, "/tokenize", {"content": t, "add_special": True})["tokens"]
                                    for t in TEXTS]
            data = _post(port, "/v1/embeddings", {"input": TEXTS})["data"]
            out["vectors"][pooling] = [[float(f"{x:.7g}") for x in d["embedding"]]
                                       for d in sorted(data, key=lambda d: d["index"])]
        finally:
            server.stop()
    DATA.write_text(json.dumps(out) + "\n", encoding="utf-8")
    print(f"wrote {DATA} ({DATA.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
