"""`fastserve serve --replicas N [--ray-address ADDR]`: the cluster's start, its wait, its stop.

Bad input stops the start with the reason before anything runs: a replica count under 1, --port 0, a Ray
address that does not answer, Ray not installed."""
from __future__ import annotations

import os
import signal
import socket
import sys
import threading
from urllib.parse import urlsplit

from ..errors import FastserveError

APP_NAME = "fastserve"
PREFIX_TREE = "LlmPrefixTreeActor"      # ray.llm's PrefixCacheAffinityRouter.initialize_state names it so
CONNECT_TIMEOUT_S = 3.0
# the flags that are the cluster's own, or each replica's server's business (it listens on loopback)
OWN_FLAGS = frozenset({"--replicas", "--ray-address", "--host", "--port"})


def replica_flags(argv: list) -> list:
    """`fastserve serve`'s words less the command itself and the cluster's own flags (with their values)."""
    out, skip = [], False
    words = list(argv)
    if words and words[0] == "serve":
        words = words[1:]
    for w in words:
        if skip:
            skip = False
            continue
        if w.split("=", 1)[0] in OWN_FLAGS:
            skip = "=" not in w           # its value is the next word
            continue
        out.append(w)
    return out


def replica_resources(threads: int, device: str, replicas: int, cpus: int) -> tuple[int, float, float]:
    """(-t of each replica's server, its num_cpus, its num_gpus on its Ray node). -t 0 (every core) would have
    each replica's threads fight the others' for the same cores (oversubscribed threads made a step 20x
    slower here, DESIGN.md): this machine's cores are shared out instead. A GPU replica takes one GPU and a
    CPU for its host side."""
    if device == "cuda":
        return max(1, threads), 1, 1
    threads = threads or max(1, cpus // replicas)
    return threads, threads, 0


def check_address(address: str) -> None:
    """A Ray address (host:port, ray://host:port) must answer a TCP connect within CONNECT_TIMEOUT_S (ray.init on
    an address nobody answers waits over 2 minutes); "auto" (the local node's cluster) is Ray's to find."""
    if address == "auto":
        return
    parts = urlsplit(address if "://" in address else f"ray://{address}")
    if not parts.hostname or not parts.port:
        raise FastserveError(f"--ray-address {address!r}: expected host:port (or ray://host:port, or auto)")
    try:
        socket.create_connection((parts.hostname, parts.port), CONNECT_TIMEOUT_S).close()
    except OSError as exc:
        raise FastserveError(f"--ray-address {address}: no Ray cluster answers there ({exc})") from None


def serve_cluster(args, argv: list) -> int:
    """Start Ray (local, or join --ray-address), Ray Serve's proxy on --host / --port, the application; serve
    until SIGTERM / SIGINT; then delete the application (and stop the local Ray). Returns the exit code."""
    if args.replicas < 1:
        raise FastserveError(f"--replicas {args.replicas}: a cluster needs at least 1 replica")
    if args.port == 0:
        raise FastserveError("--replicas needs a --port: Ray Serve's proxies (one per node) bind the one given")
    if args.ray_address:
        check_address(args.ray_address)
    try:
        import ray
        from ray import serve
    except ImportError as exc:
        raise FastserveError(f"--replicas needs Ray Serve: pip install 'fastserve[ray]' ({exc})") from None
    from . import build

    # "local": a Ray of our own, never one that happens to run on this machine already
    ray.init(address=args.ray_address or "local", include_dashboard=False, logging_level="WARNING")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):     # ours from here on, over the handler ray.init installed (an abort)
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        threads, num_cpus, num_gpus = replica_resources(args.threads, args.device, args.replicas, os.cpu_count() or 1)
        app, board = build([*replica_flags(argv), "-t", str(threads)], replicas=args.replicas, num_cpus=num_cpus,
                           num_gpus=num_gpus, api_key=args.api_key, metrics=args.metrics)
        serve.run(app, name=APP_NAME, route_prefix="/")
        if _ready(f"http://{_local(args.host)}:{args.port}/health", stop):
            print(f"fastserve: cluster listening on http://{args.host}:{args.port} ({args.replicas} replicas on Ray "
                  f"Serve, PrefixCacheAffinityRouter)", file=sys.stderr, flush=True)
        stop.wait()         # board is held until here: Ray ends an actor whose handles are all gone
        print("fastserve: shutting down the cluster", file=sys.stderr, flush=True)
        if args.ray_address:
            serve.delete(APP_NAME)      # ours only: the cluster is someone else's
            _forget_prefixes()
    finally:
        # a local Ray goes whole, the replicas and their servers with it (Serve's own stop would wait on its
        # controller, which Ctrl-C's SIGINT to the terminal's process group has stopped already)
        ray.shutdown()
    return 0


def _forget_prefixes() -> None:
    """PrefixCacheAffinityRouter keeps its prefix tree in a detached actor, named per application and
    deployment, that only serve.shutdown() removes: on a cluster that lives on, the next start would reuse it,
    with the replicas of this one in it."""
    import ray
    try:
        ray.kill(ray.get_actor(PREFIX_TREE, namespace=f"serve::{APP_NAME}::FastserveReplica"))
    except ValueError:      # none was made (no request came)
        pass


def _local(host: str) -> str:
    """Where this machine reaches a server bound to host."""
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)


def _ready(health_url: str, stop: threading.Event) -> bool:
    """Wait until the cluster's /health says 200 through Ray Serve's proxy (a replica's server reported healthy,
    the proxy has the route): the start line is printed when a client can be served. False if stopped first."""
    import httpx
    while not stop.is_set():
        try:
            if httpx.get(health_url, timeout=5).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        stop.wait(0.2)
    return False
