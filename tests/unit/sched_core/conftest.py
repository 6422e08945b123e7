"""Fixtures shared by the sched_core tests: every scheduler test runs on both builds."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, settings

import sched_core
from sched_core import SchedulerConfig

# Default runs stay quick on a small machine; HYPOTHESIS_PROFILE=thorough searches harder.
settings.register_profile(
    "quick", max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile(
    "thorough", max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "quick"))

Factory = Callable[..., "sched_core.Scheduler | sched_core.ReferenceScheduler"]


@pytest.fixture(params=sorted(sched_core.IMPLEMENTATIONS))
def make(request: pytest.FixtureRequest) -> Factory:
    """Build a scheduler of the parametrized implementation: ``make(**config_fields)``."""
    cls = sched_core.IMPLEMENTATIONS[request.param]

    def build(**fields: object) -> sched_core.Scheduler | sched_core.ReferenceScheduler:
        return cls(SchedulerConfig(**fields))  # type: ignore[arg-type]

    return build
