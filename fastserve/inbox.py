"""The one way into the decode thread: a queue of messages it drains at each step boundary.

Producers (any thread) append; the decode thread pops. deque.append/popleft are
atomic, so neither side takes a lock the other could hold; the Event only wakes
an idle decode thread.
"""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Any


@dataclass
class Message:
    kind: str          # "submit", "cancel", "erase", "call"
    payload: Any = None


class Inbox:
    def __init__(self):
        self._q: deque[Message] = deque()
        self._event = threading.Event()

    def put(self, kind: str, payload: Any = None) -> None:
        self._q.append(Message(kind, payload))
        self._event.set()

    def __len__(self) -> int:
        return len(self._q)

    def drain(self):
        """Every message queued now, oldest first (decode thread only)."""
        q = self._q
        while q:
            yield q.popleft()

    def wait(self, timeout: float) -> None:
        """Sleep until a message arrives or timeout passes (decode thread only, when idle)."""
        if not self._q:
            self._event.wait(timeout)
        self._event.clear()

    def wake(self) -> None:
        self._event.set()
