"""The discrete-event simulator: the scheduler (or a baseline) driven on simulated time by
simulated workers whose step times come from cost profiles. Pure: no I/O, no clock.

    workload = replay(parse_trace(lines), time_scale=0.05)
    result = simulate(Scheduler(config), workload, SimConfig(pools))
    summarize(result, Slo())
"""

from sched_core.simulate.engine import Outcome, Policy, Pool, Result, SimConfig, simulate
from sched_core.simulate.experiment import POLICIES, Setup, run_point, sweep, targets
from sched_core.simulate.metrics import Slo, summarize
from sched_core.simulate.profile import CostProfile
from sched_core.simulate.workload import (
    Arrival,
    Tenant,
    TraceError,
    Workload,
    on_off,
    parse_trace,
    poisson,
    replay,
)

__all__ = [
    "POLICIES",
    "Arrival",
    "CostProfile",
    "Outcome",
    "Policy",
    "Pool",
    "Result",
    "Setup",
    "SimConfig",
    "Slo",
    "Tenant",
    "TraceError",
    "Workload",
    "on_off",
    "parse_trace",
    "poisson",
    "replay",
    "run_point",
    "simulate",
    "summarize",
    "sweep",
    "targets",
]
