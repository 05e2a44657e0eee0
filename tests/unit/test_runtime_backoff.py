"""Retry pacing: the exponential schedule and its two jitter rules (up from the base, down from the cap)."""

from __future__ import annotations

import random

import pytest

from gpualloc.runtime import backoff


def test_exponential_doubles_from_the_base_and_stops_at_the_cap() -> None:
    delays = [backoff.exponential(n, base=5, cap=300) for n in range(1, 9)]
    assert delays == [5, 10, 20, 40, 80, 160, 300, 300]
    assert [backoff.exponential(n, base=0.2, cap=10.0) for n in (1, 2, 3)] == [0.2, 0.4, 0.8]


def test_exponential_waits_nothing_before_the_first_retry_and_any_retry_count_stays_a_float() -> None:
    assert backoff.exponential(0, base=5, cap=300) == 0.0
    assert backoff.exponential(-3, base=5, cap=300) == 0.0
    assert backoff.exponential(5000, base=0.2, cap=10.0) == 10.0  # no OverflowError
    assert isinstance(backoff.exponential(10_000, base=5, cap=300), float)


def test_jittered_up_stretches_by_at_most_a_quarter_and_never_past_the_cap() -> None:
    assert backoff.jittered_up(1, base=4, cap=300, jitter=0.0) == 4
    assert backoff.jittered_up(1, base=4, cap=300, jitter=0.999) == pytest.approx(4 * 1.25, rel=1e-3)
    assert backoff.jittered_up(3, base=4, cap=300, jitter=0.5) == 16 * 1.125
    assert backoff.jittered_up(20, base=4, cap=60, jitter=0.9) == 60
    assert backoff.jittered_up(0, base=4, cap=60, jitter=0.9) == 0.0


def test_jittered_up_never_waits_less_than_the_schedule_whatever_the_jitter() -> None:
    for jitter in (-1.0, 0.0, 0.3, 0.999, 1.0, 7.0):
        for n in range(1, 12):
            delay = backoff.jittered_up(n, base=5, cap=300, jitter=jitter)
            assert backoff.exponential(n, base=5, cap=300) <= delay <= 300
            assert delay <= 1.25 * backoff.exponential(n, base=5, cap=300)


def test_jittered_down_shrinks_by_at_most_half_and_never_past_the_cap() -> None:
    rng = random.Random(1)
    first = [backoff.jittered_down(1, rng, base=0.2, cap=5.0) for _ in range(50)]
    assert all(0.1 <= d <= 0.2 for d in first)
    assert len(set(first)) > 1  # jittered
    assert all(0.4 <= backoff.jittered_down(3, rng, base=0.2, cap=5.0) <= 0.8 for _ in range(50))
    assert all(2.5 <= backoff.jittered_down(50, rng, base=0.2, cap=5.0) <= 5.0 for _ in range(50))


def test_jittered_down_waits_nothing_before_the_first_retry_without_drawing_from_the_rng() -> None:
    rng = random.Random(7)
    assert backoff.jittered_down(0, rng, base=0.2, cap=5.0) == 0.0
    assert rng.random() == random.Random(7).random()
