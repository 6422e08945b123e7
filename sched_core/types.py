"""Inputs and outputs of the scheduler, shared by both implementations.

All times are seconds on the caller's clock (``time.monotonic()`` in the gateway, simulated
time in the simulator); the scheduler never reads a clock itself. Token counts are integers.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from sched_core.smdp import PolicyTable

#: ln(100): the factor between the mean and the 99th percentile of an exponential tail.
#: Defined once here so that the Python and the compiled core use the very same double.
LN100: float = math.log(100.0)

#: The TPOT hold (docs/scheduling.md §6) keeps a request only while it would still get its
#: first token within this share of the TTFT SLO: holding it to the last moment leaves the
#: step-time model's error no room, and measured live, such holds broke TTFT SLOs by the
#: dozen (docs/benchmarks.md, "Policies on real traffic").
HOLD_SLACK: float = 0.5

#: A queued request that has waited this share of the TTFT SLO goes ahead of the order if it
#: still makes the SLO when it starts now (docs/scheduling.md §6, "The late go first"): the
#: shortest-first order alone left a live slice's longest prompts waiting past the SLO at 0.9×
#: the worker's capacity, where FCFS made every first token in time (docs/benchmarks.md).
RESCUE_AFTER: float = 0.5


@dataclass(frozen=True, slots=True)
class Request:
    """One request as the scheduler sees it.

    ``weight`` is the tenant's budget in tokens/s (its share under overload);
    ``expected_output_tokens == 0`` asks the scheduler to estimate the output length;
    ``priority``: lower is more urgent, 0 is the default class; ``deadline`` is absolute;
    ``budget_wait`` is how long the budget limiter already held the request (it is part of
    the contract, and the scheduler's own wait is measured from ``arrival + budget_wait``);
    ``slo_ttft_s``/``slo_tpot_s`` are the client's (or its tenant's) SLO: the driver refuses
    the request at admission when its calibrated bounds cannot meet them (the core ignores
    them); ``max_wait_s`` bounds the wait of a request without a first-token SLO: the driver
    refuses it at admission when its predicted first token is more than this past the time
    its own prompt takes alone (None: no bound).
    """

    id: str
    tenant: str
    weight: float
    prompt_tokens: int
    max_tokens: int
    arrival: float
    expected_output_tokens: int = 0
    priority: int = 0
    deadline: float | None = None
    budget_wait: float = 0.0
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None
    max_wait_s: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id:
            raise ValueError("request id must be a non-empty str")
        if not self.weight > 0.0 or not math.isfinite(self.weight):
            raise ValueError(f"weight must be a positive finite tokens/s budget, got {self.weight}")
        if self.prompt_tokens < 1 or self.max_tokens < 1:
            raise ValueError("prompt_tokens and max_tokens must be at least 1")
        if self.expected_output_tokens < 0 or self.budget_wait < 0.0:
            raise ValueError("expected_output_tokens and budget_wait must not be negative")
        if not math.isfinite(self.arrival):
            raise ValueError("arrival must be finite")
        for slo in (self.slo_ttft_s, self.slo_tpot_s, self.max_wait_s):
            if slo is not None and not (slo > 0.0 and math.isfinite(slo)):
                raise ValueError(f"an SLO or wait bound must be positive and finite, got {slo}")


@dataclass(frozen=True, slots=True)
class Contract:
    """The latency promise made at admission, in seconds from ``arrival``, budget wait included.

    ``ttft_s`` and ``total_s`` are the predicted first and last token, ``tpot_s`` the time per
    output token after the first, ``output_tokens`` the output length ``total_s`` assumes;
    ``ttft_p99_s``, ``tpot_p99_s`` and ``p99_s`` bound the first token, the time per token and
    the last token 99 times in 100, ``p99_s`` for ``output_tokens_hi`` tokens. The core
    returns its model's raw terms; ``sched_core.contracts`` calibrates them on outcomes.
    """

    request_id: str
    bucket: int
    path: str
    ttft_s: float
    total_s: float
    p99_s: float
    tokens_ahead: int
    budget_wait_s: float
    tpot_s: float = 0.0
    output_tokens: int = 0
    ttft_p99_s: float = 0.0
    tpot_p99_s: float = 0.0
    output_tokens_hi: int = 0  # the output length ``p99_s`` assumes (its 99th percentile, or max_tokens)


@dataclass(frozen=True, slots=True)
class Dispatch:
    """Run these requests (in this order) as one batch on ``path``; ``predicted_s`` is the
    batch time the fitted cost model expects (prefill + decode)."""

    batch_id: int
    path: str
    bucket: int
    request_ids: tuple[str, ...]
    predicted_s: float


@dataclass(frozen=True, slots=True)
class Reject:
    """A request the scheduler will not run. ``reason`` is a stable code: ``duplicate``,
    ``too_long``, ``queue_full``, ``deadline`` or (from the driver) ``slo`` and ``wait``; ``estimate_s`` is
    the completion estimate (from arrival) that motivated it, 0 where none applies; an ``slo``
    refusal carries the best bounds the gateway could promise (``ttft_p99_s``, ``p99_s``)."""

    request_id: str
    reason: str
    message: str
    retry_after_s: float
    estimate_s: float
    ttft_p99_s: float = 0.0
    p99_s: float = 0.0


@dataclass(frozen=True, slots=True)
class BatchTimings:
    """What a worker reports when a batch finishes.

    ``prompt_tokens`` is the padded length per sequence; ``decode_s`` is the total over
    ``decode_steps`` steps; ``output_tokens`` lists each request's output in dispatch order.
    ``mean_running`` is the mean number of sequences alive per decode step; 0 means "derive
    it": sequences that stop early leave the batch, so the running total over all steps is
    then ``sum(output_tokens)``. A failed batch is reported with zero sizes: its slots are
    returned and nothing is fitted.
    """

    batch_id: int
    path: str
    batch_size: int
    prompt_tokens: int
    prefill_s: float
    decode_steps: int
    decode_s: float
    output_tokens: tuple[int, ...]
    mean_running: float = 0.0

    def __post_init__(self) -> None:
        if min(self.batch_size, self.prompt_tokens, self.decode_steps) < 0:
            raise ValueError("batch_size, prompt_tokens and decode_steps must not be negative")
        if min(self.prefill_s, self.decode_s, self.mean_running) < 0.0:
            raise ValueError("timings must not be negative")
        if any(n < 0 for n in self.output_tokens):
            raise ValueError("output token counts must not be negative")


@dataclass(frozen=True, slots=True)
class PathConfig:
    """Prior step-time model and batch limit of one path (see ``sched_core.costmodel``).

    One worker step takes ``decode_launch·[decoding] + decode_seq·decode_seqs +
    kv_token·kv_tokens + prefill_launch·[prefilling] + prefill_token·prefill_tokens`` seconds,
    ``kv_tokens`` being the KV-cache tokens held by the decoding sequences. The scheduler refits
    all five online; these values seed the fit and hold its shape. ``step_tokens`` is the
    workers' per-step token budget (decode tokens plus the prefill chunk).
    ``prefill_attention`` (s per squared prompt token) is attention's quadratic share of one
    prompt's prefill, ``prefill_attention·L²`` beyond the line, chunked or not: measured by
    a worker at start (``workers/selfprofile.py``), not refitted online; 0 leaves it out.
    """

    decode_launch: float
    decode_seq: float
    kv_token: float
    prefill_launch: float
    prefill_token: float
    max_batch: int
    step_tokens: int = 256
    prefill_attention: float = 0.0

    def __post_init__(self) -> None:
        coefficients = (self.decode_launch, self.decode_seq, self.kv_token, self.prefill_launch,
                        self.prefill_token, self.prefill_attention)
        if not all(math.isfinite(c) for c in coefficients):
            raise ValueError("cost priors must be finite")
        if min(coefficients) < 0.0:
            raise ValueError("cost priors must be >= 0")
        if self.decode_launch + self.decode_seq <= 0.0 or self.prefill_launch + self.prefill_token <= 0.0:
            raise ValueError("cost priors: a decode and a prefill step must take time")
        if self.max_batch < 1 or self.step_tokens < 1:
            raise ValueError("max_batch and step_tokens must be at least 1")

    @classmethod
    def from_profile(cls, profile: Mapping[str, Any]) -> PathConfig:
        """The ``step_model`` object of a profile written by ``bench/cost_profile.py``."""
        fields = profile.get("step_model")
        if not isinstance(fields, dict):
            raise ValueError(f"profile {profile.get('name', '?')!r} has no step_model object")
        return cls(**fields)


#: The packaged measured profiles (``sched_core/profiles``) that seed each path by default.
DEFAULT_PROFILES: dict[str, str] = {"cpu": "cpu-smollm2-135m.json", "gpu": "gpu-h100-sxm-smollm2-135m.json"}


@functools.cache
def packaged_profile(filename: str) -> dict[str, Any]:
    """A profile shipped as package data, parsed (cached: the files never change)."""
    text = resources.files("sched_core").joinpath("profiles", filename).read_text(encoding="utf-8")
    profile: dict[str, Any] = json.loads(text)
    return profile


def _default_cpu() -> PathConfig:
    return PathConfig.from_profile(packaged_profile(DEFAULT_PROFILES["cpu"]))


def _default_gpu() -> PathConfig:
    return PathConfig.from_profile(packaged_profile(DEFAULT_PROFILES["gpu"]))


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Scheduler settings, validated once at construction.

    bucket_bounds: inclusive upper prompt lengths of the buckets; longer prompts are rejected.
    ttft_p99_slo_s: SLO on the 99th percentile of the scheduler's time to first token; the
        tail-cut time T_cut is solved from it.
    aging_tokens_per_s: how many tokens of cost one second of waiting forgives.
    priority_tokens: cost added per priority class (priority 1 counts as this much longer).
    fair_input_weight, fair_output_weight: weights of prompt and output tokens in the
        virtual token counters; fair_slack_tokens: how many (weighted) tokens a tenant may
        be served ahead of the most-behind backlogged tenant before it must wait (about one
        full GPU batch: smaller values keep shares tighter and break batches up).
    rate_window_s: time constant of the arrival-rate estimates.
    ewma_alpha: smoothing of observed output lengths and of the request mix.
    default_output_tokens: output estimate before anything was observed.
    cpu, gpu: the paths' prior step-time models; by default the ``step_model`` of the packaged
        measured profiles (``DEFAULT_PROFILES``).
    fit_forgetting: per-step decay of old step records in the step-time fits (0.999: a memory
        of about 1000 steps, 10-100 s of one worker); prior_weight: how many typical steps of a
        full worker the priors count as, in each coefficient's direction.
    prefill_queue_steps: how many worker steps' worth of prompt tokens (per worker: the step
        budget less the sequences it decodes, at least a quarter of the budget) a busy path
        may hold dispatched and not yet prefilled (inf: no limit); beyond that new work
        waits in the scheduler, where the order and fair share apply, instead of in the
        worker's FIFO prefill queue (workers report a step that prefilled at once, so the
        count lags by a step at most).
    policy_table: the design notes' SMDP table (``sched_core.smdp``): per macro-state, the
        prefill queue steps, slot share, aging and admission threshold; None: the heuristic
        (every state takes ``prefill_queue_steps`` and the neutral knobs).
    """

    bucket_bounds: tuple[int, ...] = (64, 128, 256, 512, 1024, 2048, 4096, 8192)
    cpu: PathConfig = field(default_factory=_default_cpu)
    gpu: PathConfig = field(default_factory=_default_gpu)
    ttft_p99_slo_s: float = 2.0
    tpot_slo_s: float = 0.1
    aging_tokens_per_s: float = 1000.0
    priority_tokens: float = 4096.0
    max_queued: int = 250_000
    fair_input_weight: float = 1.0
    fair_output_weight: float = 2.0
    fair_slack_tokens: float = 65536.0
    rate_window_s: float = 10.0
    ewma_alpha: float = 0.1
    default_output_tokens: int = 16
    fit_forgetting: float = 0.999
    prior_weight: float = 10.0
    prefill_queue_steps: float = 4.0
    policy_table: PolicyTable | None = None

    def __post_init__(self) -> None:
        bounds = self.bucket_bounds
        if not bounds or bounds[0] < 1 or list(bounds) != sorted(set(bounds)):
            raise ValueError("bucket_bounds must be positive and strictly increasing")
        positive = {
            "ttft_p99_slo_s": self.ttft_p99_slo_s,
            "tpot_slo_s": self.tpot_slo_s,
            "aging_tokens_per_s": self.aging_tokens_per_s,
            "rate_window_s": self.rate_window_s,
            "prior_weight": self.prior_weight,
        }
        for name, value in positive.items():
            if not value > 0.0 or not math.isfinite(value):
                raise ValueError(f"{name} must be positive and finite, got {value}")
        if min(self.priority_tokens, self.fair_input_weight, self.fair_output_weight) < 0.0:
            raise ValueError("priority_tokens and fairness weights must not be negative")
        if self.fair_input_weight + self.fair_output_weight <= 0.0 or self.fair_slack_tokens < 0.0:
            raise ValueError("fairness needs a positive token weight and a slack >= 0")
        if not 0.0 < self.ewma_alpha <= 1.0 or not 0.0 < self.fit_forgetting <= 1.0:
            raise ValueError("ewma_alpha and fit_forgetting must lie in (0, 1]")
        if not self.prefill_queue_steps > 0.0:  # inf: no gate
            raise ValueError(f"prefill_queue_steps must be positive, got {self.prefill_queue_steps}")
        if self.max_queued < 1 or self.default_output_tokens < 1:
            raise ValueError("max_queued and default_output_tokens must be at least 1")

    def path(self, index: int) -> PathConfig:
        """The config of path ``POOLS[index]``."""
        return self.gpu if index else self.cpu
