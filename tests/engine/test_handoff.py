"""LoopHandoff: items posted from worker threads reach the loop in post order, with far fewer
wake-ups than items, and a closed loop raises as call_soon_threadsafe does (the scheduler then
aborts the request) without wedging later posts."""
from __future__ import annotations

import asyncio
import threading

import pytest

from jax_engine.handoff import LoopHandoff


def test_items_arrive_in_order_with_batched_wakeups():
    async def main() -> tuple[list[int], int]:
        loop = asyncio.get_running_loop()
        h = LoopHandoff(loop)
        got: list[int] = []
        done = asyncio.Event()
        wakes = 0
        real = loop.call_soon_threadsafe

        def counting(cb, *a):
            nonlocal wakes
            wakes += 1
            return real(cb, *a)
        loop.call_soon_threadsafe = counting       # type: ignore[method-assign]

        def on_item(i: int) -> None:
            got.append(i)
            if i == 999:
                done.set()

        def worker() -> None:
            for i in range(1000):
                h.post(on_item, i)
        t = threading.Thread(target=worker)
        t.start()
        await asyncio.wait_for(done.wait(), 10)
        t.join()
        return got, wakes
    got, wakes = asyncio.run(main())
    assert got == list(range(1000))
    assert 1 <= wakes < 1000


def test_a_closed_loop_raises_and_a_new_post_retries():
    loop = asyncio.new_event_loop()
    h = LoopHandoff(loop)
    loop.close()
    with pytest.raises(RuntimeError):
        h.post(print, 1)
    with pytest.raises(RuntimeError):       # not silently queued behind a drain that never runs
        h.post(print, 2)
