"""The webhook's Prometheus metrics, in a registry of their own (one per app: tests build many)."""

from __future__ import annotations

import prometheus_client

from webhook import admission

# Admissions take well under a millisecond when the claim is cached; a cache miss costs a GET.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class Metrics:
    """Counters and a histogram; ``registry`` is what ``/metrics`` serves."""

    def __init__(self) -> None:
        self.registry = prometheus_client.CollectorRegistry()
        self.admissions = prometheus_client.Counter(
            "gpualloc_webhook_admissions_total",
            "AdmissionReviews answered, by outcome: allowed (nothing to change), mutated, gated, "
            "denied, invalid (malformed review or object), error (an unexpected failure, answered "
            "with a denial)",
            ["outcome"],
            registry=self.registry,
        )
        # The labelled children, bound once: ``labels()`` takes a lock and builds a key every call.
        self.outcomes = {outcome: self.admissions.labels(outcome) for outcome in admission.OUTCOMES}
        self.latency = prometheus_client.Histogram(
            "gpualloc_webhook_admission_duration_seconds",
            "Time from reading a request body to having the response, claim lookup included",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
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
