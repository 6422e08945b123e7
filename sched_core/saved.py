"""What a scheduler learnt that a restart starts from: the one place both the gateway (its saved
state in Redis, ``gateway/dispatch/saved_model.py``) and the simulator (a run started from an
earlier run's end, ``tokengate policy report``'s restart) take it and put it back. Pure: no I/O.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection
from dataclasses import replace
from typing import Any

from sched_core.driver import Driver

#: What a driver learnt that a restart starts from (``learnt``): per path the fitted step-time
#: coefficients, and the contracts' calibration (``Contracts.state``).
Learnt = tuple[dict[str, dict[str, float]], dict[str, Any]]


def learnt(driver: Driver, paths: Collection[str]) -> Learnt | None:
    """What ``driver`` learnt on ``paths`` that a restart can start from: per path its fitted
    step-time coefficients (paths with fitted steps only), and the contracts' calibration (the
    windows of ``paths``, and the output lengths). None for a baseline, which learns nothing."""
    if driver.pricing is None:
        return None
    fitted = {pool: path["step_model"] for pool, path in driver.pricing.snapshot()["paths"].items()
              if path["fitted_steps"] > 0 and pool in paths}
    calibration = driver.contracts.state()
    calibration["ratios"] = [r for r in calibration["ratios"] if r[1] in paths]
    return fitted, calibration


def restore(driver: Driver, path: str, coefficients: object, calibration: dict[str, Any]) -> None:
    """Start ``path`` from what was learnt on it (``learnt``): its fitted ``coefficients`` as the
    step-time model's prior, and its calibration windows; malformed parts are skipped."""
    if driver.pricing is None:
        return
    if isinstance(coefficients, dict):
        with contextlib.suppress(TypeError, ValueError):
            driver.prior(path, replace(getattr(driver.pricing.config, path), **coefficients))
    driver.contracts.load({"ratios": [r for r in calibration.get("ratios", ())
                                      if isinstance(r, list) and len(r) == 5 and r[1] == path]})
