"""Interface stub of the step-time model (replaced by the real fit)."""

from __future__ import annotations

from collections.abc import Iterable

from sched_core.types import PathConfig, SchedulerConfig

COEFFICIENTS = ("decode_launch", "decode_seq", "kv_token", "prefill_launch", "prefill_token")


class StepModel:
    def __init__(self, prior: PathConfig, config: SchedulerConfig) -> None:
        self.theta = tuple(float(getattr(prior, c)) for c in COEFFICIENTS)
        self.observations = 0

    def observe(self, prefill_tokens: int, decode_seqs: int, kv_tokens: int, seconds: float) -> None:
        self.observe_many([(prefill_tokens, decode_seqs, kv_tokens, seconds)])

    def observe_many(self, records: Iterable[tuple[int, int, int, float]]) -> None:
        for _ in records:
            self.observations += 1

    def coefficients(self) -> tuple[float, float, float, float, float]:
        t = self.theta
        return (t[0], t[1], t[2], t[3], t[4])
