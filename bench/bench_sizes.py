"""fastserve and llama-server at the sizes people run (issue 25 item 5): decode and prefill ms/token per model
shape x quant, with the memory-bandwidth floor.

For each shape (1b: Llama-3.2-1B's, hidden 2048, 16 layers, 32 / 8 heads, FFN 8192, vocab 128256, tied;
3b: Llama-3.2-3B's; 7b: Qwen2.5-7B's; 30b-a3b: Qwen3-30B-A3B's, qwen3moe, 48 layers, hidden 2048, 32 / 4 heads of
128, 128 experts of FFN 768, 8 a token, vocab 151936: MOE says how its ~18 GB Q4_K_M is made without its 61 GB
F16) it writes an F16 GGUF with random weights (once, into --dir, never the
repository; the rows of the output matrix of the byte tokens that are not valid UTF-8 alone are zero, so
greedy text stays printable), quantizes it with llama.cpp's own llama-quantize to each quant, starts both
servers with `-t 2 -np 1 -c 4096` and sends each, taking turns, a 400-token prompt of fresh random ids
(no prefix to reuse) with 48 greedy tokens and ignore_eos, reading each server's own /completion timings.
The figures are medians over --reps requests per server (after one warm-up each); ratios are
llama-server's ms/token / fastserve's (above 1: fastserve faster). Floor: the bytes of weight a decode
step reads (bench_forward_bound.weight_bytes_per_token: of a mixture, the experts a token runs) / the read
bandwidth of 2 threads, measured in the same run between the requests. The file is read once before the
servers start, and the share of it in the page cache is recorded before and after the requests (fincore).
--slots N: both servers with -np N, each turn N requests at once (32-token prompts). --sequential: one
server at a time, each after a read of the file (a model near the size of the memory: llama.cpp copies the
Q4_K weights it repacks, and beside it the file's pages leave the cache). Beside them: each server's start -> first /health 200 (mmap: the
page cache is not forced in) and its resident memory after the requests (issue 25 item 4).

--isa avx2 runs fastserve's AVX2 kernels (FASTSERVE_ISA) on a machine with AVX-512; --llama-lib DIR
runs llama-server with the libggml-cpu.so in DIR (e.g. one built with -DGGML_AVX512=OFF), so that both
run AVX2 code. --before DIR adds a third server, fastserve from another checkout DIR (built in place),
taking its turn with the others: a change's before and after in one run. Without llama-server or
llama-quantize it says why and exits 0.

Run: python bench/bench_sizes.py --llama-bin DIR [--shapes 1b] [--quants Q4_K_M,Q8_0] [--reps 3] [--slots 1]
     [--isa auto|avx2|avx512vnni] [--llama-lib DIR] [--before DIR] [--dir /tmp/fastserve-sizes] [--json out.json]
     (DIR holding llama-server and llama-quantize; or LLAMA_BIN=DIR)
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_forward_bound import weight_bytes_per_token  # noqa: E402
from bench_matmul import read_bandwidth  # noqa: E402
from httpload import ServerProcess, fastserve_command, free_port  # noqa: E402

# (architecture, layers, hidden, heads, KV heads, FFN, vocab, tied output)
SHAPES = {
    "1b": ("llama", 16, 2048, 32, 8, 8192, 128256, True),       # Llama-3.2-1B
    "3b": ("llama", 28, 3072, 24, 8, 8192, 128256, True),       # Llama-3.2-3B
    "7b": ("qwen2", 28, 3584, 28, 4, 18944, 152064, False),     # Qwen2.5-7B
    "30b-a3b": ("qwen3moe", 48, 2048, 32, 4, 768, 151936, False),  # Qwen3-30B-A3B (FFN: an expert's)
}
# a mixture of experts' shape: (head_dim, experts, experts a token runs, experts written distinct). Its F16
# would not fit the disk (~61 GB), so DISTINCT experts are written and quantized by llama-quantize, and the
# quantized file's expert tensors are then repeated along the expert axis up to the full count (each expert
# its own bytes in the file, as read per token) with a fresh random router of the full count. 4, not 8: the
# Q4_K_M mix puts attn_k / attn_v of a file of exactly 8 experts in Q8_0; of 4 they get what 128 get.
MOE = {"30b-a3b": (128, 128, 8, 4)}
QUANTS = ("Q4_K_M", "Q8_0")
N_PROMPT, N_PREDICT, N_CTX, THREADS = 400, 48, 4096, 2
# the prompt with --slots above 1: short, so that the slots' decode steps are not mixed with another's prefill
N_PROMPT_SLOTS = 32


# -- the models ---------------------------------------------------------------------------------

def header(path: Path, shape: str, n_expert: int):
    """A gguf.GGUFWriter at path with the shape's hyperparameters (n_expert: a mixture of experts' count) and
    tokenizer."""
    import gguf

    from fastserve.models.synthetic import CHAT_TEMPLATE, add_llama_header, add_tiny_tokenizer

    arch, n_layer, d, n_head, n_kv, n_ff, n_vocab, _ = SHAPES[shape]
    w = gguf.GGUFWriter(os.fspath(path), arch)
    hd = d // n_head
    if shape in MOE:
        hd, _, n_used, _ = MOE[shape]
        w.add_key_length(hd)
        w.add_value_length(hd)
        w.add_expert_count(n_expert)
        w.add_expert_used_count(min(n_used, n_expert))     # llama.cpp refuses more used than there are
        w.add_expert_feed_forward_length(n_ff)
    add_llama_header(w, n_layer=n_layer, n_ctx=N_CTX, n_embd=d, n_ff=n_ff, n_head=n_head, n_head_kv=n_kv, head_dim=hd,
                     n_vocab=n_vocab, rope_base=500000.0 if arch == "llama" else 1000000.0)
    add_tiny_tokenizer(w, n_vocab, CHAT_TEMPLATE)
    return w


def write_f16(path: Path, shape: str, seed: int = 0) -> None:
    """A GGUF of the shape in F16 (norms and a router F32) with random weights, streamed tensor by tensor; a
    mixture of experts with its distinct experts only (MOE)."""
    import gguf

    arch, n_layer, d, n_head, n_kv, n_ff, n_vocab, tied = SHAPES[shape]
    hd, n_expert = (MOE[shape][0], MOE[shape][3]) if shape in MOE else (d // n_head, 0)
    rng = np.random.default_rng(seed)
    tensors = [("token_embd.weight", (n_vocab, d), 1.0)]
    for i in range(n_layer):
        b = f"blk.{i}."
        tensors += [(b + "attn_norm.weight", (d,), None), (b + "attn_q.weight", (n_head * hd, d), d ** -0.5),
                    (b + "attn_k.weight", (n_kv * hd, d), d ** -0.5), (b + "attn_v.weight", (n_kv * hd, d), d ** -0.5),
                    (b + "attn_output.weight", (d, n_head * hd), (n_head * hd) ** -0.5), (b + "ffn_norm.weight", (d,), None)]
        if n_expert:
            tensors += [(b + "attn_q_norm.weight", (hd,), None), (b + "attn_k_norm.weight", (hd,), None),
                        (b + "ffn_gate_inp.weight", (n_expert, d), None),
                        (b + "ffn_gate_exps.weight", (n_expert, n_ff, d), d ** -0.5),
                        (b + "ffn_up_exps.weight", (n_expert, n_ff, d), d ** -0.5),
                        (b + "ffn_down_exps.weight", (n_expert, d, n_ff), n_ff ** -0.5)]
        else:
            tensors += [(b + "ffn_gate.weight", (n_ff, d), d ** -0.5), (b + "ffn_up.weight", (n_ff, d), d ** -0.5),
                        (b + "ffn_down.weight", (d, n_ff), n_ff ** -0.5)]
        if arch == "qwen2":
            tensors += [(b + "attn_q.bias", (n_head * hd,), None), (b + "attn_k.bias", (n_kv * hd,), None),
                        (b + "attn_v.bias", (n_kv * hd,), None)]
    tensors.append(("output_norm.weight", (d,), None))
    if not tied:
        tensors.append(("output.weight", (n_vocab, d), d ** -0.5))
    # byte tokens 0x80..0xFF (ids 3 + b) are not valid UTF-8 alone: their output rows stay zero
    bad_rows = np.arange(3 + 0x80, 3 + 0x100)

    w = header(path, shape, n_expert)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for name, shp, scale in tensors:
        dt = np.float32 if scale is None else np.float16
        w.add_tensor_info(name, shp, np.dtype(dt), int(np.prod(shp)) * np.dtype(dt).itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, shp, scale in tensors:
        if name.endswith("ffn_gate_inp.weight"):
            w.write_tensor_data(router(rng, shp))
            continue
        if len(shp) == 1:
            a = (0.1 * rng.standard_normal(shp, dtype=np.float32)) if name.endswith(".bias") else \
                (1.0 + 0.1 * rng.standard_normal(shp, dtype=np.float32))
            w.write_tensor_data(a.astype(np.float32))
            continue
        a = np.empty(shp, np.float16)
        for r0 in range(0, shp[0], 4096):       # in slices: a 7b output matrix is 2 GB of float32
            a[r0:r0 + 4096] = rng.standard_normal((min(4096, shp[0] - r0), *shp[1:]), dtype=np.float32) * scale
        if name == ("token_embd.weight" if tied else "output.weight"):
            a[bad_rows] = 0
        w.write_tensor_data(a)
    w.close()


def router(rng, shape) -> np.ndarray:
    """A random router [experts, hidden] (F32, as converted files keep it): tokens pick varied experts."""
    return (rng.standard_normal(shape, dtype=np.float32) * shape[1] ** -0.5).astype(np.float32)


def write_experts(src: Path, dst: Path, shape: str, seed: int = 1) -> None:
    """dst = src (a quantized file of the shape's distinct experts, MOE) with its expert tensors repeated along
    the expert axis up to the full count, on llama-quantize's own blocks, and a random router of that count."""
    import gguf

    r = gguf.GGUFReader(os.fspath(src))
    _, n_expert, _, distinct = MOE[shape]
    rng = np.random.default_rng(seed)
    routers = {t.name: router(rng, (n_expert, t.data.shape[1])) for t in r.tensors if t.name.endswith("ffn_gate_inp.weight")}

    def full(t):                            # the tensor of the full file: the distinct experts' blocks repeated
        return np.concatenate([t.data] * (n_expert // distinct)) if "_exps." in t.name else routers.get(t.name, t.data)

    w = header(dst, shape, n_expert)
    w.add_file_type(int(r.fields["general.file_type"].contents()))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    floats = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)
    for t in r.tensors:
        a, n = routers.get(t.name, t.data), n_expert // distinct if "_exps." in t.name else 1
        w.add_tensor_info(t.name, (a.shape[0] * n, *a.shape[1:]), a.dtype, a.nbytes * n,
                          raw_dtype=None if t.tensor_type in floats else t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t in r.tensors:
        w.write_tensor_data(np.ascontiguousarray(full(t)))
    w.close()


def model_file(dirpath: Path, shape: str, quant: str, bin_dir: Path) -> Path:
    """The shape in quant, written and quantized unless it is there already (a mixture of experts: its distinct
    experts' file quantized, then repeated to the full count, MOE; both intermediate files deleted)."""
    dirpath.mkdir(parents=True, exist_ok=True)
    part = "-distinct" if shape in MOE else ""
    f16 = dirpath / f"rand-{shape}{part}-F16.gguf"
    out = dirpath / f"rand-{shape}-{quant}.gguf"
    if out.exists():
        return out
    if not f16.exists():
        t0 = time.perf_counter()
        tmp = f16.with_suffix(".tmp")
        write_f16(tmp, shape)
        tmp.rename(f16)
        print(f"  wrote {f16} ({f16.stat().st_size / 1e9:.2f} GB, {time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    t0 = time.perf_counter()
    quantized = dirpath / f"rand-{shape}{part}-{quant}.gguf"
    tmp = quantized.with_suffix(".tmp")
    p = subprocess.run([str(bin_dir / "llama-quantize"), str(f16), str(tmp), quant, str(os.cpu_count() or 1)],
                       capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"llama-quantize {quant} failed:\n{p.stderr[-2000:]}")
    tmp.rename(quantized)
    print(f"  quantized {quantized} ({quantized.stat().st_size / 1e6:.0f} MB, {time.perf_counter() - t0:.0f} s)",
          file=sys.stderr)
    if part:
        t0 = time.perf_counter()
        tmp = out.with_suffix(".tmp")
        write_experts(quantized, tmp, shape)
        tmp.rename(out)
        quantized.unlink()
        f16.unlink()
        print(f"  wrote {out} ({out.stat().st_size / 1e9:.2f} GB, {time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    return out


# -- the servers --------------------------------------------------------------------------------

def commands(model: Path, bin_dir: Path, before: str | None = None, slots: int = 1):
    """name -> (port -> argv)"""
    out = {"fastserve": lambda port: fastserve_command(str(model), port, slots, N_CTX, THREADS, "--log-disable"),
           "llama-server": lambda port: [str(bin_dir / "llama-server"), "-m", str(model), "--host", "127.0.0.1",
                                         "--port", str(port), "-np", str(slots), "-c", str(N_CTX), "-t", str(THREADS)]}
    if before:
        def old(port):      # `python -m fastserve` with the other checkout first on the path
            argv = fastserve_command(str(model), port, slots, N_CTX, THREADS, "--log-disable")
            run = (f"import sys, runpy; sys.path.insert(0, {os.path.abspath(before)!r}); "
                   f"sys.argv[0] = 'fastserve'; runpy.run_module('fastserve', run_name='__main__')")
            return [argv[0], "-c", run, *argv[3:]]
        out["fastserve-before"] = old
    return out


def completion(port: int, prompt: list[int]) -> dict:
    body = orjson.dumps({"prompt": prompt, "n_predict": N_PREDICT, "temperature": 0.0, "ignore_eos": True,
                         "cache_prompt": False, "stream": False})
    req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        out = orjson.loads(r.read())
    t = out["timings"]
    if t["prompt_n"] < len(prompt) - 1 or t["predicted_n"] != N_PREDICT:
        raise RuntimeError(f"port {port}: {t['prompt_n']} prompt tokens evaluated, {t['predicted_n']} predicted")
    return {"prefill_ms": t["prompt_per_token_ms"], "decode_ms": t["predicted_per_token_ms"], "text": out["content"]}


def requests(port: int, prompts: list[list[int]]) -> list[dict]:
    """The prompts' completions at once (one per slot)."""
    with ThreadPoolExecutor(len(prompts)) as ex:
        return list(ex.map(lambda p: completion(port, p), prompts))


def measure(model: Path, bin_dir: Path, reps: int, env: dict, rng, logdir: Path, before: str | None,
            slots: int = 1, sequential: bool = False) -> dict:
    """{name: {"prefill_ms": [..], "decode_ms": [..], "ready_s", "rss_mb", "page_cache"}, "bandwidth": [..] B/s}:
    the servers take turns; ready_s: start -> first /health 200, rss_mb: resident memory after the requests,
    page_cache: the file's share in it before (after a read of it) and after the requests. slots > 1: each turn
    is `slots` requests at once (N_PROMPT_SLOTS tokens each), each one's figures kept. sequential: one server
    at a time, the next started after the last one stopped (a file near the size of the memory: beside a
    server that copies the weights, e.g. llama.cpp's repacked Q4_K, the other's pages would leave the cache)."""
    cmds = commands(model, bin_dir, before, slots)
    out = {n: {"prefill_ms": [], "decode_ms": []} for n in cmds}
    out["bandwidth"] = []
    for names in ([[n] for n in cmds] if sequential else [list(cmds)]):
        warm(model)
        cached = page_cache(model)
        _turns({n: cmds[n] for n in names}, model, reps, env, rng, logdir, slots, out)
        for n in names:
            out[n]["page_cache"] = (cached, out[n]["page_cache"])
    return out


def _turns(cmds: dict, model: Path, reps: int, env: dict, rng, logdir: Path, slots: int, out: dict) -> None:
    """The servers of cmds started, a warm-up request each, then reps turns of requests; figures into out."""
    n_vocab = SHAPES_BY_FILE[model][6]
    n_prompt = N_PROMPT if slots == 1 else N_PROMPT_SLOTS
    servers = {}
    saved = dict(os.environ)
    try:
        for name, cmd in cmds.items():
            os.environ.update(env.get(name.split("-before")[0], {}))
            port = free_port()
            servers[name] = ServerProcess(cmd(port), port, logdir / f"{name}-{model.stem}.log", start_timeout=600)
            out[name]["ready_s"] = servers[name].ready_s
            os.environ.clear()
            os.environ.update(saved)
        prompts = lambda: [rng.integers(300, n_vocab, n_prompt).tolist() for _ in range(slots)]   # noqa: E731 (fresh)
        for name, srv in servers.items():
            requests(srv.port, prompts())           # warm-up: the pages of the file, the first-call costs
        for _ in range(reps):
            out["bandwidth"].append(read_bandwidth(THREADS))
            for name, srv in servers.items():
                for r in requests(srv.port, prompts()):
                    out[name]["prefill_ms"].append(r["prefill_ms"])
                    out[name]["decode_ms"].append(r["decode_ms"])
                    out[name]["text"] = r["text"]
        for name, srv in servers.items():
            out[name]["rss_mb"] = srv.rss() / 2**20
            out[name]["page_cache"] = page_cache(model)
    finally:
        os.environ.clear()
        os.environ.update(saved)
        for srv in servers.values():
            srv.stop()


SHAPES_BY_FILE: dict = {}


def warm(path: Path) -> None:
    """The file read once, so that each server starts on a warm page cache (the first one would pay the disk)."""
    buf = bytearray(1 << 24)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass


def page_cache(path: Path) -> float | None:
    """The share of the file in the page cache (util-linux's fincore), or None without it: a model near the size
    of the memory may not stay there, and a decode step then waits on the disk."""
    if not shutil.which("fincore"):
        return None
    p = subprocess.run(["fincore", "--bytes", "--raw", "--noheadings", "-o", "RES", str(path)], capture_output=True,
                       text=True)
    return int(p.stdout.split()[0]) / path.stat().st_size if p.returncode == 0 and p.stdout.strip() else None


def run(a) -> dict:
    bin_dir, dirpath = Path(a.llama_bin), Path(a.dir)
    env = {"fastserve": {"FASTSERVE_ISA": a.isa} if a.isa != "auto" else {},
           "llama-server": {"LD_LIBRARY_PATH": a.llama_lib} if a.llama_lib else {}}
    logdir = Path(tempfile.mkdtemp(prefix="bench_sizes-"))
    rng = np.random.default_rng(1)
    out = {"isa": a.isa, "llama_lib": a.llama_lib, "llama_bin": str(bin_dir), "cpus": os.cpu_count(), "slots": a.slots,
           "sequential": a.sequential,
           "loadavg_start": os.getloadavg(), "logs": str(logdir), "rows": []}
    from fastserve.backends.cpu import _matmul
    os.environ.update(env["fastserve"])
    out["fastserve_isa"] = _matmul.best_isa()
    os.environ.pop("FASTSERVE_ISA", None)
    for shape in a.shapes.split(","):
        for quant in a.quants.split(","):
            model = model_file(dirpath, shape, quant, bin_dir)
            SHAPES_BY_FILE[model] = SHAPES[shape]
            wbytes, _ = weight_bytes_per_token(str(model))
            m = measure(model, bin_dir, a.reps, env, rng, logdir, a.before, a.slots, a.sequential)
            bw = statistics.median(m["bandwidth"])
            row = {"shape": shape, "quant": quant, "file_mb": model.stat().st_size / 1e6, "weight_bytes": wbytes,
                   "bandwidth_gbs": bw / 1e9, "floor_ms": wbytes / bw * 1e3, "loadavg_1m": os.getloadavg()[0],
                   "slots": a.slots, "sequential": a.sequential}
            for name in [k for k in m if k != "bandwidth"]:
                row[name] = {k: statistics.median(m[name][k]) for k in ("prefill_ms", "decode_ms")}
                row[name]["best"] = {k: min(m[name][k]) for k in ("prefill_ms", "decode_ms")}
                row[name]["all"] = {k: m[name][k] for k in ("prefill_ms", "decode_ms")}
                row[name]["text"] = m[name]["text"][:80]
                row[name]["ready_s"], row[name]["rss_mb"] = m[name]["ready_s"], m[name]["rss_mb"]
                row[name]["page_cache"] = m[name]["page_cache"]
            out["rows"].append(row)
            print(line(row), file=sys.stderr, flush=True)
    return out


def line(r: dict) -> str:
    ll = r["llama-server"]
    out = []
    for name in ("fastserve", "fastserve-before"):
        if name not in r:
            continue
        f = r[name]
        out.append(f"{r['shape']:3s} {r['quant']:7s} {r['file_mb']:6.0f} MB {name:16s} decode {f['decode_ms']:6.1f} "
                   f"llama {ll['decode_ms']:6.1f} ms/tok ratio {ll['decode_ms'] / f['decode_ms']:.2f}x  floor "
                   f"{r['floor_ms']:5.1f} ms ({r['bandwidth_gbs']:.1f} GB/s; {f['decode_ms'] / r['floor_ms']:.2f}x "
                   f"floor)  prefill {f['prefill_ms']:5.2f} llama {ll['prefill_ms']:5.2f} ms/tok ratio "
                   f"{ll['prefill_ms'] / f['prefill_ms']:.2f}x  (best of each: decode {f['best']['decode_ms']:.1f} / "
                   f"{ll['best']['decode_ms']:.1f}, prefill {f['best']['prefill_ms']:.2f} / {ll['best']['prefill_ms']:.2f}); "
                   f"start -> /health {f['ready_s']:.2f} / {ll['ready_s']:.2f} s, RSS {f['rss_mb']:.0f} / {ll['rss_mb']:.0f} MiB "
                   f"({f['rss_mb'] / ll['rss_mb']:.2f}x); the file in the page cache {cache(f)} / {cache(ll)}")
    return "\n".join(out)


def cache(server: dict) -> str:
    """The share of the file in the page cache before -> after a server's requests."""
    return " -> ".join("?" if c is None else f"{c:.0%}" for c in server["page_cache"])


def report(out: dict) -> str:
    lines = [f"fastserve kernels: {out['fastserve_isa']}; llama-server: {out['llama_bin']}"
             f"{' with ggml-cpu from ' + out['llama_lib'] if out['llama_lib'] else ''}; both -t {THREADS} -np {out['slots']} "
             f"-c {N_CTX}; {out['slots']} request(s) at once, prompt {N_PROMPT if out['slots'] == 1 else N_PROMPT_SLOTS} "
             f"tokens, {N_PREDICT} greedy tokens, ignore_eos; {'one server at a time; ' if out['sequential'] else ''}medians of each "
             f"server's own /completion timings; ratio = llama-server ms / fastserve ms (> 1: fastserve faster); llama-server's "
             f"threads wait by spinning: on a loaded machine its figures fall apart (compare the best ones then)"]
    lines += [line(r) for r in out["rows"]]
    la = ", ".join(f"{x:.1f}" for x in out["loadavg_start"])
    lines.append(f"machine: {out['cpus']} CPUs, load average {la} at the start; logs: {out['logs']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-bin", default=os.environ.get("LLAMA_BIN"),
                    help="directory of llama-server and llama-quantize (default: $LLAMA_BIN)")
    ap.add_argument("--llama-lib", help="a directory whose libggml-cpu.so llama-server loads instead (LD_LIBRARY_PATH)")
    ap.add_argument("--shapes", default="1b", help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--quants", default=",".join(QUANTS))
    ap.add_argument("--reps", type=int, default=3, help="requests per server and model after the warm-up")
    ap.add_argument("--sequential", action="store_true",
                    help="one server at a time (a model near the size of the memory), each after a read of the file")
    ap.add_argument("--slots", type=int, default=1,
                    help=f"both servers' -np; above 1, as many requests at once ({N_PROMPT_SLOTS}-token prompts)")
    ap.add_argument("--isa", default="auto", help="fastserve's kernels (FASTSERVE_ISA): auto or a name of _matmul.isas()")
    ap.add_argument("--before", help="another fastserve checkout (built in place) to run beside, as fastserve-before")
    ap.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "fastserve-sizes"),
                    help="where the models are written (outside the repository)")
    ap.add_argument("--json", default=None, help="where the figures go (JSON)")
    a = ap.parse_args(argv)
    if not a.llama_bin:
        print("bench_sizes: skipped: no llama.cpp build given (--llama-bin DIR or LLAMA_BIN=DIR, the directory of "
              "llama-server and llama-quantize; ../shared/tools/build-llama-server.sh builds both)")
        return 0
    for tool in ("llama-server", "llama-quantize"):
        if not os.access(Path(a.llama_bin) / tool, os.X_OK):
            print(f"bench_sizes: skipped: {Path(a.llama_bin) / tool} is not an executable file")
            return 0
    if Path(a.dir).resolve().is_relative_to(Path(__file__).resolve().parents[1]):
        print(f"bench_sizes: --dir {a.dir} is inside the repository; models go elsewhere")
        return 2
    out = run(a)
    print(report(out))
    if a.json:
        Path(a.json).write_bytes(orjson.dumps(out, option=orjson.OPT_INDENT_2))
        print(f"figures: {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
