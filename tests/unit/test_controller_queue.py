"""The work queue: dedup, one worker per key, band order, turns between tenants, delayed retries."""

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


async def test_keys_come_out_lowest_band_first() -> None:
    priority = {"low": 5, "high": -10, "mid": 0}
    q = work_queue.WorkQueue(order=lambda key: work_queue.Rank(band=priority[key]))
    for key in ("low", "mid", "high"):
        q.add(key)
    assert [await q.get() for _ in range(3)] == ["high", "mid", "low"]


async def test_within_a_band_tenants_take_turns_each_handing_out_its_oldest() -> None:
    def rank(key: str) -> work_queue.Rank:
        tenant, _, age = key.partition("/")
        return work_queue.Rank(band=0, tenant=tenant, age=int(age))

    q = work_queue.WorkQueue(order=rank)
    for i in range(1000):  # the flood came first
        q.add(f"flood/{i}")
    q.add("quiet/2")
    q.add("quiet/1")
    q.add("other/0")
    got = [await q.get() for _ in range(6)]
    assert got == ["flood/0", "quiet/1", "other/0", "flood/1", "quiet/2", "flood/2"]


async def test_a_tenant_that_arrives_waits_for_one_key_of_each_tenant_in_its_band_only() -> None:
    q = work_queue.WorkQueue(order=lambda key: work_queue.Rank(band=0, tenant=key.partition("/")[0]))
    for i in range(500):
        q.add(f"flood/{i:03d}")
    assert await q.get() == "flood/000"
    q.add("victim/x")
    assert await q.get() == "flood/001", "the flood's turn had come before the victim arrived"
    assert await q.get() == "victim/x"


async def test_a_lower_band_goes_first_whatever_the_turns() -> None:
    def rank(key: str) -> work_queue.Rank:
        tenant, _, band = key.partition("/")
        return work_queue.Rank(band=int(band), tenant=tenant)

    q = work_queue.WorkQueue(order=rank)
    for key in ("a/1", "b/1", "c/0", "a/0"):
        q.add(key)
    got = [await q.get() for _ in range(4)]
    assert got[:2] in (["c/0", "a/0"], ["a/0", "c/0"]) and got[2:] in (["a/1", "b/1"], ["b/1", "a/1"])
    assert len(q) == 0
    q.done("a/1")
    q.add("a/1")  # a band emptied and used again
    assert await asyncio.wait_for(q.get(), 1.0) == "a/1"


async def test_the_rank_is_taken_when_a_key_becomes_ready() -> None:
    bands = {"k": 5, "j": 1}
    q = work_queue.WorkQueue(order=lambda key: work_queue.Rank(band=bands[key]))
    q.add("k")
    assert await q.get() == "k"
    bands["k"] = 0
    q.add("k")  # while processing: dirty
    q.add("j")
    q.done("k")  # queued again now, with its new band
    assert [await asyncio.wait_for(q.get(), 1.0) for _ in range(2)] == ["k", "j"]


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
