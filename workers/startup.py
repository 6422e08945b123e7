"""What a worker does before its first heartbeat: a warm-up sequence, so that no client pays
the engine's first-call costs, and the engine's step-time profile, measured or a stored one
re-checked (``workers/selfprofile.py``), which the heartbeats then publish."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from common import protocol as p
from workers import selfprofile
from workers.cpu import QUIET_LOOK_S, EngineThreads
from workers.engine import Engine
from workers.presence import Presence
from workers.settings import WorkerSettings

WARM_UP_PROMPT = tuple(range(100, 132))  # 32 token ids, valid in any vocabulary of a real model
WARM_UP_TEXT = "Count from one to twenty in words: one, two, three,"  # the same, for an upstream engine

log = logging.getLogger("tokengate.worker")


def warm_up(engine: Engine, tokens: int, between_steps: Callable[[], None], presence: Presence) -> None:
    """One short greedy sequence of ``tokens`` (none: no warm-up): the engine's first-call
    costs are paid here, and its steps go out as telemetry at once, so that a gateway's first
    contracts price this machine as it runs now, not only the packaged profile. The threads
    are governed between its steps (``between_steps``): with a neighbour busy already, the
    profile then measures the engine as it will run."""
    if tokens <= 0:
        return
    params = p.SamplingParams(tokens, 0.0, ignore_eos=True)
    engine.add(p.SeqJob("warm-up", WARM_UP_PROMPT, params, text=WARM_UP_TEXT))
    while engine.busy:
        between_steps()
        presence.record(engine.step().records())
    engine.reset()
    presence.publish_telemetry()


def settle(engine: Engine, threads: EngineThreads, settings: WorkerSettings) -> None:
    """Before an engine that computes on this machine's CPUs is measured: wait a moment for
    the CPUs it needs to be idle (``workers.cpu.QUIET_WAIT_S`` at most), and run all its
    threads again if they are. A program busy only while this worker started is not timed into
    the profile; one still busy after the wait is, as the engine will run beside it."""
    if settings.profile_s <= 0 or engine.max_threads <= 0 or engine.device != "cpu":
        return
    quiet, waited = threads.settle()
    if not quiet:
        log.warning("the CPUs stayed busy for %.0f s (another program is running): the engine is measured on %d "
                    "of %d threads, as it will run beside it", waited, threads.threads, threads.maximum)
    elif waited > QUIET_LOOK_S:
        log.info("waited %.1f s for the CPUs to be idle before measuring the engine", waited)


def measure(engine: Engine, settings: WorkerSettings, model: str) -> dict[str, Any]:
    """The engine's step-time profile ({}: none). An upstream server's steps are not this
    worker's to time: gateways fit those online only."""
    if engine.name == "upstream":
        return {}
    echo = engine.name == "echo"
    setup = {"model": model, "slots": engine.slots, "step_tokens": engine.step_tokens,
             "echo_step_s": settings.echo_step_s if echo else 0.0,
             "echo_prefill_s": settings.echo_prefill_s if echo else 0.0}
    return selfprofile.obtain(engine, pool=settings.pool, model=model, setup=setup, budget_s=settings.profile_s,
                              slots=engine.slots, directory=settings.profile_dir) or {}
