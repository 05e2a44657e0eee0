"""The work queue: dedup, one worker per key, priority order, delayed retries."""

from __future__ import annotations

import asyncio

import pytest

from controller import queue as work_queue


async def test_a_key_added_twice_is_handed_out_once() -> None:
    q = work_queue.WorkQueue()
    q.add("a")
    q.add("a")
    assert len(q) == 1
    assert await q.get() == "a"
    assert len(q) == 0


async def test_a_key_added_while_processing_comes_back_only_after_done() -> None:
    q = work_queue.WorkQueue()
    q.add("a")
    assert await q.get() == "a"
    q.add("a")  # while a worker holds it
    assert len(q) == 0, "must not be handed to a second worker meanwhile"
    q.done("a")
    assert len(q) == 1
    assert await q.get() == "a"


async def test_keys_come_out_smallest_order_first() -> None:
    priority = {"low": 5, "high": -10, "mid": 0}
    q = work_queue.WorkQueue(order=lambda key: priority[key])
    for key in ("low", "mid", "high"):
        q.add(key)
    assert [await q.get() for _ in range(3)] == ["high", "mid", "low"]


async def test_add_after_delivers_later_and_the_sooner_request_wins() -> None:
    q = work_queue.WorkQueue()
    q.add_after("a", 5.0)
    q.add_after("a", 0.05)  # sooner: replaces
    q.add_after("a", 10.0)  # later: ignored
    assert len(q) == 0
    assert await asyncio.wait_for(q.get(), 1.0) == "a"
    q.done("a")
    assert q.delayed_until("a") is None


async def test_an_immediate_add_does_not_wait_for_a_pending_delayed_one() -> None:
    q = work_queue.WorkQueue()
    q.add_after("a", 30.0)
    q.add("a")
    assert await asyncio.wait_for(q.get(), 0.5) == "a"
    q.forget("a")


async def test_forget_cancels_a_delayed_add() -> None:
    q = work_queue.WorkQueue()
    q.add_after("a", 0.02)
    q.forget("a")
    await asyncio.sleep(0.06)
    assert len(q) == 0


async def test_waiting_workers_each_get_a_different_key() -> None:
    q = work_queue.WorkQueue()
    getters = [asyncio.create_task(q.get()) for _ in range(3)]
    await asyncio.sleep(0)
    for key in ("a", "b", "c"):
        q.add(key)
    got = await asyncio.wait_for(asyncio.gather(*getters), 1.0)
    assert sorted(got) == ["a", "b", "c"]


async def test_a_cancelled_waiter_passes_its_wakeup_on() -> None:
    q = work_queue.WorkQueue()
    first = asyncio.create_task(q.get())
    second = asyncio.create_task(q.get())
    await asyncio.sleep(0)
    q.add("a")  # wakes `first`
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    assert await asyncio.wait_for(second, 1.0) == "a"


async def test_shutdown_wakes_waiters_with_queue_shut_down() -> None:
    q = work_queue.WorkQueue()
    waiter = asyncio.create_task(q.get())
    await asyncio.sleep(0)
    q.add_after("later", 30)
    q.shutdown()
    with pytest.raises(work_queue.QueueShutDown):
        await asyncio.wait_for(waiter, 1.0)
    q.add("x")
    assert len(q) == 0
