"""A GPU that was Unhealthy before its agent restarted stays Unhealthy for ``--recovery-seconds``
(``HealthTracker.carry``), then is healthy again unless a new error comes."""

from __future__ import annotations

from agent import health


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_carried_mark_holds_for_the_recovery_time_then_ends() -> None:
    clock = Clock()
    tracker = health.HealthTracker(monotonic=clock)
    tracker.carry({"GPU-a": "XID 79"}, hold=600)
    assert tracker.marks(["GPU-a", "GPU-b"]) == {"GPU-a": "XID 79 (before the agent restarted; held 600 s)"}
    clock.now += 599
    assert "GPU-a" in tracker.marks(["GPU-a"])
    clock.now += 2
    assert tracker.marks(["GPU-a"]) == {}


def test_a_mark_carried_over_two_restarts_does_not_grow_its_reason() -> None:
    tracker = health.HealthTracker(monotonic=Clock())
    tracker.carry({"GPU-a": "XID 79 (before the agent restarted; held 600 s)"}, hold=30)
    assert tracker.marks(["GPU-a"]) == {"GPU-a": "XID 79 (before the agent restarted; held 30 s)"}


def test_a_new_error_on_a_carried_gpu_makes_it_unhealthy_for_good() -> None:
    clock = Clock()
    tracker = health.HealthTracker(monotonic=clock)
    tracker.carry({"GPU-a": "XID 79"}, hold=10)
    assert tracker.apply(health.HealthEvent(uuid="GPU-a", kind=health.KIND_XID, xid=48))
    clock.now += 3600
    assert tracker.marks(["GPU-a"]) == {"GPU-a": "XID 48"}
