"""Prometheus metrics, one registry per app (so tests can build many apps in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "tokengate_requests",
            "HTTP requests by route and status code",
            ["route", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "tokengate_request_latency_seconds",
            "Time from request received to last byte handed to the server",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.ttft = Histogram(
            "tokengate_time_to_first_token_seconds",
            "Time from request received to the first generated text",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.tokens = Counter(
            "tokengate_tokens",
            "Tokens processed, by kind (prompt, completion)",
            ["kind"],
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "tokengate_requests_in_flight", "Generation requests awaiting their result", registry=self.registry
        )
        self.contract_ratio = Histogram(
            "tokengate_contract_latency_ratio",
            "Actual end-to-end latency divided by the contract's predicted latency",
            buckets=(0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5, 2, 3, 5, 10),
            registry=self.registry,
        )
        self.contract_kept = Counter(
            "tokengate_contract_outcomes",
            "Finished requests by whether they ended within their contract's p99 bound",
            ["within_p99"],
            registry=self.registry,
        )
        self.workers = Gauge(
            "tokengate_workers_alive", "Workers with a live heartbeat, by pool", ["pool"], registry=self.registry
        )
        self.budget_wait = Histogram(
            "tokengate_budget_wait_seconds",
            "How long admitted requests waited for their tenant's token budget (waits > 0 only)",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )

    def observe_contract(self, record: dict[str, float]) -> None:
        total, predicted, bound = record.get("total_s"), record.get("contract_total_s"), record.get("contract_p99_s")
        if total is None or predicted is None or bound is None:
            return
        if predicted > 0:
            self.contract_ratio.observe(total / predicted)
        self.contract_kept.labels("true" if total <= bound else "false").inc()
