"""One line per request to stderr, written by a thread so that a blocked stderr never blocks the loop.

The loop only appends to a bounded queue; when stderr cannot keep up, lines are
dropped and counted (the count is a metric), never waited for.
"""
from __future__ import annotations

import queue
import sys
import threading
import time

QUEUE_LINES = 4096


class RequestLog:
    def __init__(self, stream=None, enabled: bool = True):
        self.enabled = enabled
        self.dropped = 0
        self._stream = stream
        self._q: queue.Queue = queue.Queue(QUEUE_LINES)
        self._thread = threading.Thread(target=self._run, name="fastserve-log", daemon=True)
        self._thread.start()

    def line(self, text: str) -> None:
        try:
            self._q.put_nowait(text)
        except queue.Full:
            self.dropped += 1

    def request(self, peer: str, method: str, target: str, status: int, n_prompt: int, n_gen: int,
                ms: float, note: str = "") -> None:
        if self.enabled:
            self.line(f'{peer} "{method} {target}" {status} prompt={n_prompt} gen={n_gen} {ms:.1f}ms'
                      + (f" ({note})" if note else ""))

    def _run(self) -> None:
        while True:
            text = self._q.get()
            if text is None:
                return
            stream = self._stream or sys.stderr
            try:
                stream.write(time.strftime("%H:%M:%S ") + text + "\n")
                stream.flush()
            except Exception:
                self.dropped += 1

    def close(self, timeout: float = 0.5) -> None:
        """Flush what is queued (within timeout) and stop."""
        try:
            self._q.put(None, timeout=timeout)
        except queue.Full:
            return
        self._thread.join(timeout)
