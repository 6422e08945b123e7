"""tokengate's scheduling core: pure decisions, no I/O, no clock.

``Scheduler`` is the compiled core. If the extension did not build, importing this package
fails: there is deliberately no silent fallback to the reference implementation.
"""

from sched_core._core import Scheduler
from sched_core.reference import Scheduler as ReferenceScheduler
from sched_core.types import (
    BatchTimings,
    Contract,
    Dispatch,
    PathConfig,
    Reject,
    Request,
    SchedulerConfig,
)

IMPLEMENTATIONS: dict[str, type[Scheduler] | type[ReferenceScheduler]] = {
    "cython": Scheduler,
    "reference": ReferenceScheduler,
}

__all__ = [
    "BatchTimings",
    "Contract",
    "Dispatch",
    "IMPLEMENTATIONS",
    "PathConfig",
    "Reject",
    "ReferenceScheduler",
    "Request",
    "Scheduler",
    "SchedulerConfig",
]
