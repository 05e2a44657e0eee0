"""The webhook's Prometheus metrics, in a registry of their own (one per app: tests build many)."""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Iterator

import prometheus_client
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric

from webhook import admission

# Admissions take well under a millisecond when the claim is cached; a cache miss costs a GET.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class Admissions:
    """``gpualloc_webhook_admissions_total{outcome}`` and ``gpualloc_webhook_admission_duration_seconds``.

    Recorded once per admission with plain additions, and turned into
    Prometheus families only when scraped (a custom collector). A
    ``prometheus_client`` Counter and Histogram take a lock and run several
    functions per observation: 4 to 5 µs per admission in the server, where
    the whole decision has about 25 (BENCHMARKS.md). The event loop is the
    only writer, so no lock is needed; a scrape reads whole numbers.
    """

    def __init__(self, outcomes: Iterable[str], buckets: Iterable[float] = LATENCY_BUCKETS) -> None:
        self.bounds = tuple(sorted(buckets))
        self.counts = dict.fromkeys(outcomes, 0)
        self.buckets = [0] * (len(self.bounds) + 1)  # per bucket, not cumulative; the last is +Inf
        self.sum = 0.0

    def record(self, outcome: str, seconds: float) -> None:
        self.counts[outcome] += 1
        self.buckets[bisect.bisect_left(self.bounds, seconds)] += 1  # le: bound >= seconds
        self.sum += seconds

    def describe(self) -> list[Metric]:
        return list(self.collect())

    def collect(self) -> Iterator[Metric]:
        counter = CounterMetricFamily(
            "gpualloc_webhook_admissions",
            "AdmissionReviews answered, by outcome: allowed (nothing to change), mutated, gated, "
            "denied, invalid (malformed review or object), error (an unexpected failure, answered "
            "with a denial)",
            labels=["outcome"],
        )
        for outcome, count in self.counts.items():
            counter.add_metric([outcome], count)
        yield counter
        cumulative = 0
        buckets: list[tuple[str, float]] = []
        for bound, count in zip((*self.bounds, math.inf), self.buckets, strict=True):
            cumulative += count
            buckets.append(("+Inf" if bound == math.inf else repr(float(bound)), cumulative))
        yield HistogramMetricFamily(
            "gpualloc_webhook_admission_duration_seconds",
            "Time from reading a request body to having the response, claim lookup included",
            buckets=buckets,
            sum_value=self.sum,
        )


class Metrics:
    """Counters and a histogram; ``registry`` is what ``/metrics`` serves."""

    def __init__(self) -> None:
        self.registry = prometheus_client.CollectorRegistry()
        self.admissions = Admissions(admission.OUTCOMES)
        self.registry.register(self.admissions)
        self.cache_misses = prometheus_client.Counter(
            "gpualloc_webhook_claim_cache_misses_total",
            "Admissions whose claim was not in the watch cache and was read with a GET",
            registry=self.registry,
        )
        self.lookup_errors = prometheus_client.Counter(
            "gpualloc_webhook_claim_lookup_errors_total",
            "GETs of a claim that failed (the pod was denied: fail closed)",
            registry=self.registry,
        )
        self.cert_reloads = prometheus_client.Counter(
            "gpualloc_webhook_certificate_reloads_total",
            "Reloads of the serving certificate after its files changed, by result",
            ["result"],
            registry=self.registry,
        )
        for result in ("success", "failure"):
            self.cert_reloads.labels(result)
        self.cert_expiry = prometheus_client.Gauge(
            "gpualloc_webhook_certificate_expiry_timestamp_seconds",
            "notAfter of the serving certificate in use, as a Unix time",
            registry=self.registry,
        )
