"""The webhook's admission metrics expose what prometheus_client's own Counter and Histogram would."""

from __future__ import annotations

import prometheus_client
import pytest

from webhook import admission, metrics

# Bucket bounds themselves (le is inclusive), values between them, and past the last bound.
OBSERVATIONS = [
    ("mutated", 0.0004),
    ("mutated", 0.0005),
    ("mutated", 0.00050001),
    ("denied", 0.001),
    ("denied", 0.0031),
    ("allowed", 0.0),
    ("invalid", 5.0),
    ("error", 7.5),
    ("gated", 0.26),
]


def admission_lines(registry: prometheus_client.CollectorRegistry) -> list[str]:
    """The exposition lines of the two admission families, without ``_created`` (ours has none)."""
    lines = prometheus_client.generate_latest(registry).decode().splitlines()
    return [line for line in lines if "admission" in line and "_created" not in line]


def test_recorded_admissions_expose_the_same_samples_as_a_prometheus_counter_and_histogram() -> None:
    ours = metrics.Metrics()
    oracle = prometheus_client.CollectorRegistry()
    counter = prometheus_client.Counter(
        "gpualloc_webhook_admissions",
        next(ours.admissions.collect()).documentation,
        ["outcome"],
        registry=oracle,
    )
    for outcome in admission.OUTCOMES:
        counter.labels(outcome)
    histogram = prometheus_client.Histogram(
        "gpualloc_webhook_admission_duration_seconds",
        "Time from reading a request body to having the response, claim lookup included",
        buckets=metrics.LATENCY_BUCKETS,
        registry=oracle,
    )
    for outcome, seconds in OBSERVATIONS:
        ours.admissions.record(outcome, seconds)
        counter.labels(outcome).inc()
        histogram.observe(seconds)

    assert admission_lines(ours.registry) == admission_lines(oracle)


def test_every_outcome_is_exposed_from_zero_before_any_admission() -> None:
    text = prometheus_client.generate_latest(metrics.Metrics().registry).decode()
    for outcome in admission.OUTCOMES:
        assert f'gpualloc_webhook_admissions_total{{outcome="{outcome}"}} 0.0' in text
    assert 'gpualloc_webhook_admission_duration_seconds_bucket{le="+Inf"} 0.0' in text
    assert "gpualloc_webhook_admission_duration_seconds_count 0.0" in text


def test_an_unknown_outcome_is_refused_rather_than_invented() -> None:
    with pytest.raises(KeyError):
        metrics.Metrics().admissions.record("maybe", 0.001)
