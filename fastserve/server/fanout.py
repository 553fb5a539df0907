"""Several generations behind one HTTP request: /completion's list of prompts, OpenAI's n > 1.

They are submitted together (the engine batches them) and either awaited together or streamed
interleaved, as their tokens come. Whatever ends the request early (an error in one of them, a
deadline, a client gone) closes every one of them: no slot is left running for nobody.
"""
from __future__ import annotations

import asyncio

from .generation import Generation


class Generations(list):
    """The generations of one exchange, standing for them as exchange.generation: whoever ends the
    exchange (a disconnect, a deadline, shutdown, the protocol's last word) closes them all, even when
    its response never started to iterate them; the request log counts them together."""

    def close(self) -> None:
        for g in self:
            g.close()

    @property
    def n_prompt(self) -> int:
        return sum(g.n_prompt for g in self)

    @property
    def ids(self) -> list:
        return [t for g in self for t in g.ids]


def start_all(start, ex, params, constraint=None) -> list[Generation]:
    """One Generation per choice of params (params.Params.choices), each through start(ex, ids, sampling,
    params, constraint) (App.start_generation); constraint (App.compile's): each generation gets a matcher of its
    own, copied before any runs. If one cannot start (queue full, bad request), those already started
    are closed."""
    choices = params.choices()
    own = [constraint if i == 0 or constraint is None else constraint.copy() for i in range(len(choices))]
    gens = Generations()
    try:
        for (ids, sampling), c in zip(choices, own):
            gens.append(start(ex, ids, sampling, params, c))
    except BaseException:
        gens.close()
        raise
    if len(gens) > 1:
        ex.generation = gens
    return gens


async def run_all(gens: list[Generation]) -> None:
    """Consume every generation to its end (non-streaming answers)."""
    if len(gens) == 1:
        await gens[0].run()
        return
    tasks = [asyncio.ensure_future(g.run()) for g in gens]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        failed = [t.exception() for t in tasks if t in done and not t.cancelled() and t.exception()]
        if failed:
            raise failed[0]
    finally:
        for t in tasks:
            t.cancel()
        for g in gens:
            g.close()


async def interleave(streams: list, gens: list[Generation]):
    """(i, item) from each async iterator as items come, and (i, None) when stream i ends.
    One stream is iterated directly (no task, no queue: the common case costs nothing more)."""
    if len(streams) == 1:
        try:
            async for item in streams[0]:
                yield 0, item
            yield 0, None
        finally:
            gens[0].close()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, stream):
        try:
            async for item in stream:
                queue.put_nowait((i, item, None))
            queue.put_nowait((i, None, None))
        except Exception as exc:          # noqa: BLE001 - handed to the consumer, raised there
            queue.put_nowait((i, None, exc))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            i, item, exc = await queue.get()
            if exc is not None:
                raise exc
            if item is None:
                left -= 1
            yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for g in gens:
            g.close()
