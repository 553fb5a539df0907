"""fastserve past one machine: N replicas on Ray Serve (`pip install fastserve[ray]`).

    HTTP ──▶ Ray Serve's proxy ──▶ Ingress (ingress.py) ──streaming handle, PrefixCacheAffinityRouter──▶ Replica × N
                                     /health, /metrics ◀── Board (board.py) ◀── each replica's reports
                                                                              Replica: a `fastserve serve` child (replica.py)

`fastserve serve --replicas N` starts it on a local Ray cluster, `--ray-address` joins one (launch.py);
`build()` gives the application for `serve.run` in one's own Ray code.
"""
from __future__ import annotations

from .launch import serve_cluster

HEALTH_CHECK_PERIOD_S = 1.0     # Ray Serve asks each replica's check_health this often
HEALTH_CHECK_TIMEOUT_S = 10.0
SHUTDOWN_S = 2.0                # a replica being replaced gets this long to finish (a wedged one never does)
MAX_ONGOING = 256               # requests Ray sends one replica at a time: its server queues them (--max-queue)
# Ray's PrefixCacheAffinityRouter where it is defined: its public name, ray.serve.llm.request_router, imports
# ray.serve.llm, which refuses to load without vLLM or SGLang installed (ray 2.60); the class itself needs neither
ROUTER = "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router.PrefixCacheAffinityRouter"
POW2 = "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter"     # Ray Serve's default

__all__ = ["build", "serve_cluster"]


def build(flags: list, replicas: int = 2, num_cpus: float = 1, num_gpus: float = 0, api_key: str | None = None,
          metrics: bool = False, launcher: tuple = ("-m", "fastserve"), router: str = ROUTER,
          router_kwargs: dict | None = None):
    """(the Ray Serve application, its Board actor: hold it while the application runs, as Ray ends an actor
    whose handles are all gone). flags: `fastserve serve`'s flags for each replica's
    server (its model, slots, context, ...; not --host / --port); num_cpus / num_gpus: each replica's share
    of its Ray node; api_key, metrics: the server's --api-key and --metrics; launcher: how Python starts the
    server (tests: a server whose decode loop can be wedged); router: Ray's request router class (its import
    path; bench/bench_cluster.py compares Ray's default, POW2); router_kwargs: its initialize_state's
    (PrefixCacheAffinityRouter: imbalanced_threshold, match_rate_threshold, ...)."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from .board import Board
    from .ingress import Ingress
    from .replica import Replica

    board = Board.remote()
    replica = serve.deployment(
        Replica, name="FastserveReplica", num_replicas=replicas,
        ray_actor_options={"num_cpus": num_cpus, "num_gpus": num_gpus},
        max_ongoing_requests=MAX_ONGOING,
        request_router_config=RequestRouterConfig(request_router_class=router,
                                                  request_router_kwargs=router_kwargs or {}),
        health_check_period_s=HEALTH_CHECK_PERIOD_S, health_check_timeout_s=HEALTH_CHECK_TIMEOUT_S,
        graceful_shutdown_timeout_s=SHUTDOWN_S, graceful_shutdown_wait_loop_s=0.5,
    ).bind(list(flags), board, tuple(launcher))
    ingress = serve.deployment(Ingress, name="FastserveIngress", num_replicas=1, ray_actor_options={"num_cpus": 0},
                               max_ongoing_requests=10_000).bind(replica, board, api_key, metrics)
    return ingress, board
