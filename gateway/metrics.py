"""Prometheus metrics, one registry per app (so tests can build many apps in one process)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from common import protocol as p
from sched_core.contracts import Accuracy

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    """The gateway's metric families, in its own registry. Every series carries ``model``: the
    model a generation request asked for (one this gateway serves; "" for the other routes) or
    the scheduling domain a series describes (issue 39); ``of`` gives one model's view."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._models: dict[str, ModelMetrics] = {}
        self.requests = Counter(
            "tokengate_requests",
            "HTTP requests by route and status code",
            ["model", "route", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "tokengate_request_latency_seconds",
            "Time from request received to last byte handed to the server",
            ["model", "route"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.ttft = Histogram(
            "tokengate_time_to_first_token_seconds",
            "Time from request received to the first generated text",
            ["model", "route"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.tokens = Counter(
            "tokengate_tokens",
            "Tokens processed, by kind (prompt, completion)",
            ["model", "kind"],
            registry=self.registry,
        )
        self.admitted = Counter(
            "tokengate_admitted",
            "Generation requests admitted (their budget reserved and the scheduler's contract given)",
            ["model"], registry=self.registry,
        )
        self.in_flight = Gauge(
            "tokengate_requests_in_flight", "Generation requests awaiting their result", ["model"],
            registry=self.registry,
        )
        self.backlog_requests = Gauge(
            "tokengate_backlog_requests",
            "Requests queued in this gateway, by the pool each would go to were both pools staffed "
            "(docs/operations.md, \"Scaling on backlog\")",
            ["model", "pool"],
            registry=self.registry,
        )
        self.backlog_tokens = Gauge(
            "tokengate_backlog_tokens",
            "Tokens (prompt and expected output) of the requests queued in this gateway, by pool",
            ["model", "pool"],
            registry=self.registry,
        )
        self.contract_inside = Counter(
            "tokengate_contract_outcomes",
            "Finished requests with a contract, by path, component (ttft: first token; total: last) and "
            "whether it came within its p99 bound",
            ["model", "path", "component", "within_p99"],
            registry=self.registry,
        )
        self.contract_error = Histogram(
            "tokengate_contract_error_ratio",
            "Absolute percentage error of the predicted latency (as a fraction), by path, component and "
            "prediction: calibrated (the promise) or raw (the step-time model before calibration)",
            ["model", "path", "component", "prediction"],
            buckets=(0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1, 2, 5),
            registry=self.registry,
        )
        self.workers = Gauge(
            "tokengate_workers_alive", "Workers with a live heartbeat, by pool", ["model", "pool"],
            registry=self.registry
        )
        labels = ["model", "worker", "pool", "device", "dtype", "amx"]
        self.worker_prefill = Gauge(
            "tokengate_worker_prefill_tokens_per_second",
            "Each live worker's prefill speed on a 512-token prompt, measured by the worker at start",
            labels, registry=self.registry,
        )
        self.worker_decode = Gauge(
            "tokengate_worker_decode_step_seconds",
            "Each live worker's decode step of one sequence holding 256 KV tokens, measured at start",
            labels, registry=self.registry,
        )
        self.worker_profile = Gauge(
            "tokengate_worker_profile_seconds",
            "What each live worker's start-up self-profile cost (a re-check of a stored one is short)",
            labels, registry=self.registry,
        )
        self.worker_starved = Gauge(
            "tokengate_worker_cpu_starved_ratio",
            "Each live worker's share of thread time spent waiting for a CPU since its last heartbeat "
            "(another program on its CPUs: every step slows)",
            ["model", "worker", "pool"], registry=self.registry,
        )
        self.budget_wait = Histogram(
            "tokengate_budget_wait_seconds",
            "How long admitted requests waited for their tenant's token budget (waits > 0 only)",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )

    def of(self, model: str) -> ModelMetrics:
        """One model's series (made once per model)."""
        view = self._models.get(model)
        if view is None:
            view = self._models[model] = ModelMetrics(self, model)
        return view


class ModelMetrics:
    """One model's series: its scheduling domain's workers, backlog and contracts, and its
    generation requests' admissions, tokens and first tokens."""

    def __init__(self, families: Metrics, model: str) -> None:
        self.families = families
        self.model = model
        self.admitted = families.admitted.labels(model)
        self.in_flight = families.in_flight.labels(model)
        self.budget_wait = families.budget_wait.labels(model)
        self._prompt = families.tokens.labels(model, "prompt")
        self._completion = families.tokens.labels(model, "completion")
        self._worker_series: set[tuple[Any, tuple[str, ...]]] = set()  # (gauge, labels) set at the last look

    def tokens(self, prompt: int, completion: int) -> None:
        self._prompt.inc(prompt)
        self._completion.inc(completion)

    def ttft(self, route: str, seconds: float) -> None:
        self.families.ttft.labels(self.model, route).observe(seconds)

    def observe_workers(self, workers: dict[str, p.Heartbeat], pools: tuple[str, ...]) -> None:
        """The model's live workers: how many per pool, and their measured profiles
        (workers/selfprofile.py); a gone worker's series go with it (only this model's)."""
        f = self.families
        for pool in pools:
            f.workers.labels(self.model, pool).set(sum(1 for w in workers.values() if w.pool == pool))
        now: set[tuple[Any, tuple[str, ...]]] = set()
        for wid, hb in workers.items():
            now.add((f.worker_starved, (self.model, wid, hb.pool)))
            f.worker_starved.labels(self.model, wid, hb.pool).set(hb.cpu_starved)
            summary, facts = hb.profile_part("summary"), hb.profile_part("facts")
            if not summary or not facts:
                continue
            labels: tuple[str, ...] = (self.model, wid, hb.pool, hb.device, hb.dtype,
                                       "true" if facts.get("amx_used") else "false")
            try:
                values = ((f.worker_prefill, float(summary["prefill_tokens_per_s"])),
                          (f.worker_decode, float(summary["decode_step_ms"]) / 1000.0),
                          (f.worker_profile, float(hb.profile.get("cost_s", 0.0))))
            except (KeyError, TypeError, ValueError):
                continue
            for gauge, value in values:
                gauge.labels(*labels).set(value)
                now.add((gauge, labels))
        for gauge, labels in self._worker_series - now:
            gauge.remove(*labels)
        self._worker_series = now

    def observe_backlog(self, backlog: dict[str, dict[str, int]]) -> None:
        f = self.families
        for pool, queued in backlog.items():
            f.backlog_requests.labels(self.model, pool).set(queued["requests"])
            f.backlog_tokens.labels(self.model, pool).set(queued["tokens"])

    def observe_contract(self, acc: Accuracy | None) -> None:
        """How a finished request's promise fared (None: it had none, or did not finish)."""
        if acc is None:
            return
        f = self.families
        for component, inside, error, raw in (("ttft", acc.ttft_inside, acc.ttft_ape, acc.raw_ttft_ape),
                                              ("total", acc.total_inside, acc.total_ape, acc.raw_total_ape)):
            if inside is None or error is None or raw is None:  # the first token was not seen apart
                continue
            f.contract_inside.labels(self.model, acc.path, component, "true" if inside else "false").inc()
            f.contract_error.labels(self.model, acc.path, component, "calibrated").observe(error)
            f.contract_error.labels(self.model, acc.path, component, "raw").observe(raw)
