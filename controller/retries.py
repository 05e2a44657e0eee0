"""The retry bookkeeping behind a claim's ``retryPolicy`` (pure)."""

from __future__ import annotations

import dataclasses

from gpualloc.api import constants, models
from gpualloc.runtime import backoff

MAX_BACKOFF_SECONDS = 300.0  # retries never wait longer than this, whatever the claim's backoff base


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RetryState:
    """Failed allocation attempts of one claim, kept in memory (seeded from status.retryCount).

    ``failures`` counts attempts that failed at or after ``not_before`` (the
    end of the previous backoff). An attempt that an event triggered earlier
    (capacity changed) and that failed too is not counted, so a busy cluster
    does not burn a claim's ``maxRetries`` faster than its backoff allows.
    """

    failures: int = 0
    not_before: float = 0.0  # monotonic seconds
    generation: int = 0

    @property
    def retry_count(self) -> int:
        """The status field: retries made so far (attempts after the first)."""
        return max(0, self.failures - 1)


def initial_retry_state(claim: models.GpuClaim) -> RetryState:
    failed_before = any(
        c.type == constants.CONDITION_ALLOCATED and c.status == "False" for c in claim.status.conditions
    )
    failures = claim.status.retry_count + 1 if failed_before else 0
    return RetryState(failures=failures, not_before=0.0, generation=claim.metadata.generation)


def record_failure(
    state: RetryState, *, now: float, policy: models.RetryPolicy, jitter: float
) -> tuple[RetryState, bool]:
    """The state after a failed attempt at ``now``, and whether the attempt counted."""
    if now < state.not_before:
        return state, False
    failures = state.failures + 1
    delay = backoff.jittered_up(
        failures, base=float(policy.backoff_seconds), cap=MAX_BACKOFF_SECONDS, jitter=jitter
    )
    return dataclasses.replace(state, failures=failures, not_before=now + delay), True


def retries_exhausted(state: RetryState, policy: models.RetryPolicy) -> bool:
    """``maxRetries`` retries were made and failed (never, for ``maxRetries: 0``)."""
    return policy.max_retries > 0 and state.retry_count >= policy.max_retries
