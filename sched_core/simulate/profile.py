"""Cost profiles: how long a simulated worker of one path takes for a prefill and a decode step.

A profile is the fitted model of one worker running the real model (``bench/cost_profile.py``
measures it and writes the JSON; this module only reads the parsed data):

    prefill of B sequences padded to L tokens:       P(B, L) = a + b·B·L + b2·B·L²
    one decode step, n running, KV padded to K:       D(n, K) = c + d·n + e·n·K

``b2`` is attention's quadratic term. The formulas and the scheduler's prior made of them are
``common.stepmodel``'s, as for a worker's own profile (the prior still folds ``b2`` into the
per-token term at a typical prompt length: ``path_config``).

``noise_cv`` is the relative spread of measured times around the fit; the simulator draws
each step's time from a lognormal with that spread. A ``derived`` profile was not measured:
it was computed from published figures, named in ``source``, and every report that uses it
says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from common import stepmodel
from sched_core.types import PathConfig


@dataclass(frozen=True, slots=True)
class CostProfile:
    name: str
    device: str
    model: str
    derived: bool
    source: str
    prefill_a: float
    prefill_b: float
    prefill_b2: float
    decode_c: float
    decode_d: float
    decode_e: float
    noise_cv: float = 0.0
    step_tokens: int = 0  # the step budget its step_model names (0: none)
    _fit: dict[str, Any] = field(init=False, repr=False, compare=False)  # ``fit_dict``, for the formulas

    def __post_init__(self) -> None:
        coefficients = (self.prefill_a, self.prefill_b, self.prefill_b2, self.decode_c,
                        self.decode_d, self.decode_e, self.noise_cv)
        if any(not math.isfinite(x) or x < 0.0 for x in coefficients):
            raise ValueError(f"profile {self.name!r}: coefficients must be finite and >= 0")
        # a decode step's time may all be in its KV term (a worker measured while another program
        # ran can fit it so): every sequence holds KV tokens, so such a step still takes time
        if (self.prefill_a + self.prefill_b + self.prefill_b2 <= 0.0
                or self.decode_c + self.decode_d + self.decode_e <= 0.0):
            raise ValueError(f"profile {self.name!r}: prefill and decode must take time")
        object.__setattr__(self, "_fit", self.fit_dict())

    @property
    def label(self) -> str:
        """The name as reports print it: derived profiles say so."""
        return f"{self.name} (derived: {self.source})" if self.derived else self.name

    def prefill_s(self, batch: int, padded_tokens: int) -> float:
        return stepmodel.prefill_s(self._fit, batch, padded_tokens)

    def decode_step_s(self, running: int, kv_tokens: float) -> float:
        return stepmodel.decode_s(self._fit, running, kv_tokens)

    def path_config(self, max_batch: int, prompt_tokens: float) -> PathConfig:
        """The scheduler's step-time prior for this worker: ``common.stepmodel.step_model``'s
        mapping, except that attention's term is still linearized into ``prefill_token`` at a
        typical prompt length, as the packaged SMDP table was solved with (mapping it term for
        term as a worker's own profile does changes what the simulator's policies do: left to
        the policy's re-tuning, docs/scheduling.md §13.2)."""
        terms = stepmodel.step_model(self._fit, max_batch, 0)
        del terms["step_tokens"]  # (the scheduler's own step budget)
        terms["prefill_token"] += terms.pop("prefill_attention") * prompt_tokens
        return PathConfig(**terms)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CostProfile:
        """Read the JSON written by ``bench/cost_profile.py``; errors name the missing field."""
        try:
            fit = data["fit"]
            prefill, decode = fit["prefill"], fit["decode"]
            return cls(
                name=str(data["name"]),
                device=str(data["device"]),
                model=str(data["model"]),
                derived=bool(data.get("derived", False)),
                source=str(data.get("source", "")),
                prefill_a=float(prefill["a"]),
                prefill_b=float(prefill["b"]),
                prefill_b2=float(prefill.get("b2", 0.0)),
                decode_c=float(decode["c"]),
                decode_d=float(decode["d"]),
                decode_e=float(decode.get("e", 0.0)),
                noise_cv=float(fit.get("noise_cv", 0.0)),
                step_tokens=int(data.get("step_model", {}).get("step_tokens", 0)),
            )
        except KeyError as exc:
            raise ValueError(f"cost profile: missing field {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            raise ValueError(f"cost profile: {exc}") from None

    def fit_dict(self) -> dict[str, Any]:
        return {
            "prefill": {"a": self.prefill_a, "b": self.prefill_b, "b2": self.prefill_b2},
            "decode": {"c": self.decode_c, "d": self.decode_d, "e": self.decode_e},
            "noise_cv": self.noise_cv,
        }
