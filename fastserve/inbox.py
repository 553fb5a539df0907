"""The one way into the decode thread: typed messages it drains at each step boundary.

Producers (any thread) append; the decode thread pops. deque.append/popleft are
atomic, so neither side takes a lock the other could hold; the Event only wakes
an idle decode thread. A message that needs an answer carries its reply: a
callable the decode thread calls once, which must return at once (e.g. a
call_soon_threadsafe onto the caller's loop), never block.
"""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Optional


@dataclass(frozen=True)
class Submit:
    job: Any                    # request.Request


@dataclass(frozen=True)
class Cancel:
    job_id: int


@dataclass(frozen=True)
class Erase:
    """Drop a slot's cached prefix, never cutting its request: at once when the slot is idle, else when
    its request ends. reply(n_erased) is called once, when it is done (n_erased: the tokens dropped)."""
    slot: int
    reply: Optional[Callable[[int], None]] = None


@dataclass(frozen=True)
class Embed:
    """A side pass's job (embedding.EmbedJob, scoring.ScoreJob): answered through its own future, once all its
    inputs are done."""
    job: Any


Message = Submit | Cancel | Erase | Embed


class Inbox:
    def __init__(self):
        self._q: deque[Message] = deque()
        self._event = threading.Event()

    def put(self, msg: Message) -> None:
        self._q.append(msg)
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
