"""The webhook's three steps on a review held as a JSON value, as the server runs them on a body.

``admit`` is what the API server gets back (the answer as JSON, the patch in
base64); ``decide`` keeps the outcome too. Claims come from a mapping keyed
``namespace/name`` (``lookup_from``), as the watch cache serves them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from gpualloc.api import models
from webhook import admission

DEFAULTS = admission.Options()


def lookup_from(claims: Mapping[str, models.GpuClaim]) -> admission.ClaimLookup:
    """A ClaimLookup over a mapping keyed ``namespace/name``."""

    def lookup(namespace: str, name: str, /) -> models.GpuClaim | None:
        return claims.get(f"{namespace}/{name}")

    return lookup


def body_of(review: bytes | Any) -> bytes:
    return review if isinstance(review, bytes) else json.dumps(review).encode()


def decide(
    review: bytes | Any, claims: admission.ClaimLookup, options: admission.Options = DEFAULTS
) -> admission.Decision:
    """decode -> decide. Raises BadReview or NotJSON only when there is no uid to answer."""
    return admission.decide(admission.decode(body_of(review)), claims, options)


def admit(
    review: bytes | Any, claims: admission.ClaimLookup, options: admission.Options = DEFAULTS
) -> dict[str, Any]:
    """decode -> decide -> encode: the AdmissionReview sent back, as JSON."""
    return answer_of(decide(review, claims, options))


def claim_ref(review: bytes | Any) -> tuple[str, str] | None:
    """``(namespace, name)`` of the claim the server would look up for this review, else None."""
    try:
        prepared = admission.decode(body_of(review))
    except (admission.BadReview, admission.NotJSON):
        return None
    return prepared.claim_ref if isinstance(prepared, admission.PodCreate) else None


def answer_of(decision: admission.Decision) -> dict[str, Any]:
    """The decision's answer as the JSON sent."""
    answer: dict[str, Any] = json.loads(admission.encode(decision.answer))
    return answer
