"""How long to wait before a retry: exponential backoff, and its two jitter rules. Pure.

``exponential`` is the schedule every retry loop here follows: ``base``, then
twice that, and so on, never above ``cap``. Where many clients may fail at the
same moment, jitter spreads their retries out, in one of two directions,
depending on which bound is the promise:

* ``jittered_up``: ``base`` is the promise (a claim's ``backoffSeconds`` is the
  shortest first wait), so jitter only lengthens a wait, by up to a quarter,
  and the cap still holds. The caller passes the random number in, so the
  controller's planning stays deterministic under test.
* ``jittered_down``: ``cap`` is the promise (the longest a watch stays down), so
  jitter only shortens a wait, to as little as half, drawn from ``rng``.

Retry number 1 is the first retry; 0 or less waits nothing.
"""

from __future__ import annotations

import random

# 2**32 times any sane base is past any sane cap; the clamp keeps a huge retry count a float.
_MAX_EXPONENT = 32


def exponential(attempt: int, *, base: float, cap: float) -> float:
    """Seconds before retry ``attempt``: ``base * 2**(attempt-1)``, at most ``cap``; no jitter."""
    if attempt < 1:
        return 0.0
    return float(min(cap, base * 2.0 ** min(attempt - 1, _MAX_EXPONENT)))


def jittered_up(attempt: int, *, base: float, cap: float, jitter: float) -> float:
    """``exponential`` stretched by up to a quarter by ``jitter`` (in ``[0, 1)``), still at most ``cap``.

    ``base * 2**(attempt-1)`` is therefore the shortest wait; ``jitter`` outside
    ``[0, 1]`` is clamped into it.
    """
    jitter = min(max(jitter, 0.0), 1.0)
    return exponential(attempt, base=base * (1.0 + 0.25 * jitter), cap=cap)


def jittered_down(attempt: int, rng: random.Random, *, base: float, cap: float) -> float:
    """``exponential`` shrunk to between a half and all of itself, at random from ``rng``.

    ``min(cap, base * 2**(attempt-1))`` is therefore the longest wait.
    """
    if attempt < 1:
        return 0.0  # without drawing from ``rng``
    return exponential(attempt, base=base, cap=cap) * (0.5 + 0.5 * rng.random())
