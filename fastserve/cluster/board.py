"""The board: a small Ray actor where each replica posts, every second, its server's health and /metrics,
and the ingress reads them (Ray Serve gives no way to call every replica of a deployment)."""
from __future__ import annotations

import time

import ray

STALE_S = 5.0       # a report older than this is a replica gone (replaced, or its process killed)


@ray.remote(num_cpus=0)
class Board:
    def __init__(self):
        self._reports: dict = {}

    def report(self, replica: str, report: dict) -> None:
        """report: healthy, reason, metrics (text), pid (the replica's), server_pid, t (time.time())."""
        self._reports[replica] = report

    def read(self) -> dict:
        """{replica: report} of the replicas that reported within STALE_S; the others are forgotten."""
        now = time.time()
        self._reports = {r: rep for r, rep in self._reports.items() if now - rep["t"] <= STALE_S}
        return dict(self._reports)
