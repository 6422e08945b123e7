"""The CPUs a worker shares with other programs: how starved of them its threads are, and how
many threads its engine should run so that a neighbour does not stall it.

A CPU-bound neighbour on a 2-core machine costs a torch engine that runs one intra-op thread
per core far more than the core it takes: every parallel region ends at a barrier where one
thread waits for the other, and the other is off its core for a scheduler time slice. Measured
on the AMD VM under ``tokengate serve`` with one spinning program: steps 20-100x slower with
two threads, 1.0-1.5x with one (SmolLM2, bf16; quiet, one thread is 1.5x slower than two).
So the worker watches the share of its threads' time spent runnable but waiting for a CPU
(Linux's schedstat, per thread: it sees the neighbours whatever the container or VM shows of
the machine) and gives up a thread while that share is large; it tries one back later, when
the share is small again, waiting twice as long after each try that starved at once.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from common.protocol import STARVED_SHARE

log = logging.getLogger("tokengate.worker")


def cpu_times() -> tuple[float, float]:
    """(seconds run, seconds runnable but waiting for a CPU) of this process's threads so far,
    from Linux's /proc/self/task/*/schedstat; (0, 0) where there is none."""
    run = wait = 0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 0.0, 0.0
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/schedstat") as f:
                ran, waited, _ = f.read().split()
        except (OSError, ValueError):
            continue  # a thread that ended meanwhile
        run += int(ran)
        wait += int(waited)
    return run / 1e9, wait / 1e9


class Starvation:
    """This process's thread time since it was made (``since()``), and the share of it spent
    waiting for a CPU (``share()``): 0 on a quiet machine, large with another program on it."""

    def __init__(self) -> None:
        self._start = cpu_times()

    def since(self) -> tuple[float, float]:
        """(seconds run, seconds waiting for a CPU) since this was made."""
        run, wait = cpu_times()
        return run - self._start[0], wait - self._start[1]

    def share(self) -> float:
        ran, waited = self.since()
        return waited / (ran + waited) if ran + waited > 0 else 0.0


def idle_cpus() -> tuple[float, float]:
    """(seconds the machine's CPUs have been idle, all of them together, uptime seconds) so
    far, from /proc/stat and /proc/uptime; (0, 0) where there are none."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0, 0.0
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    return (int(fields[4]) + int(fields[5])) / tick, uptime  # idle + iowait


class Idle:
    """The machine's idle CPUs (in cores) since the last look (``cores()``)."""

    def __init__(self) -> None:
        self._last = idle_cpus()

    def cores(self) -> float:
        idle, at = idle_cpus()
        last_idle, last_at = self._last
        self._last = idle, at
        return (idle - last_idle) / (at - last_at) if at > last_at else 0.0


#: A worker measures its engine at start once the machine has had its threads' worth of CPUs
#: idle (less ``IDLE_CORES``) over one look of ``QUIET_LOOK_S``, waiting at most
#: ``QUIET_WAIT_S`` for it: a program busy for a moment at start (another process starting or
#: ending beside it) would otherwise be timed into the profile, and with it, a thread given up
#: meanwhile (a profile of one thread that serves on two is 1.5-2x slow for good).
QUIET_LOOK_S = 0.25
QUIET_WAIT_S = 5.0


def wait_for_idle(cores: float, max_s: float, look: Callable[[], float], sleep: Callable[[float], None] = time.sleep,
                  look_s: float = QUIET_LOOK_S) -> tuple[bool, float]:
    """Wait, at most ``max_s``, until one look of ``look_s`` saw ``cores`` idle CPUs (``look``:
    the idle CPUs since its last call): (whether it saw them, seconds waited)."""
    look()
    waited = 0.0
    while True:
        sleep(look_s)
        waited += look_s
        if look() >= cores:
            return True, waited
        if waited >= max_s:
            return False, waited


#: Giving up a thread: the share of thread time spent waiting for a CPU over an interval in
#: which the engine's threads ran or waited at least ``BUSY_S``; a thread is tried back once
#: the share is under ``STARVED_SHARE``, ``backoff`` has passed since the last change, and
#: the machine had ``IDLE_CORES`` idle (a neighbour that still keeps a core busy would stall
#: the try: a step at two threads beside it takes seconds). A try that starves within
#: ``RECENT_S`` doubles the backoff, up to ``BACKOFF_MAX_S``.
GIVE_UP = 0.25
BUSY_S = 0.1
IDLE_CORES = 0.5
BACKOFF_S = 10.0
BACKOFF_MAX_S = 300.0
RECENT_S = 10.0


@dataclass(slots=True)
class ThreadGovernor:
    """How many intra-op threads an engine runs, at most ``maximum``: decisions only, time is
    an argument (the heartbeat thread feeds it, the engine's loop applies it between steps)."""

    maximum: int
    threads: int = 0
    backoff: float = BACKOFF_S
    changed_at: float = float("-inf")
    raised_at: float = float("-inf")

    def __post_init__(self) -> None:
        self.threads = self.threads or self.maximum

    def observe(self, ran_s: float, waited_s: float, now: float, idle_cores: float = math.inf) -> int:
        """The engine's threads ran ``ran_s`` and waited ``waited_s`` for a CPU since the last
        call, while the machine had ``idle_cores`` idle on average: the number of threads to
        run from now on."""
        if ran_s + waited_s < BUSY_S:
            return self.threads  # idle: nothing learnt
        share = waited_s / (ran_s + waited_s)
        if share >= GIVE_UP and self.threads > 1:
            recent = now - self.raised_at < RECENT_S
            self.backoff = min(2.0 * self.backoff, BACKOFF_MAX_S) if recent else BACKOFF_S
            self.threads -= 1
            self.changed_at = now
        elif (share < STARVED_SHARE and self.threads < self.maximum and now - self.changed_at >= self.backoff
              and idle_cores >= IDLE_CORES):
            self.threads += 1
            self.changed_at = self.raised_at = now
        return self.threads


class EngineThreads:
    """An engine's intra-op threads, governed between its steps: what they ran and waited for
    a CPU since the last look goes to the ``governor`` (None: ``--threads`` fixes them) once
    it is enough to judge, and the engine runs the threads it wants (``set_threads``). Judged
    between steps rather than at a heartbeat: a starved step can take seconds, and each one
    more is the neighbour's doing."""

    def __init__(self, governor: ThreadGovernor | None, threads: int, set_threads: Callable[[int], None],
                 clock: Callable[[], float]) -> None:
        self.governor = governor
        self.maximum = threads  # the most it runs
        self.threads = threads  # the engine's now
        self._set = set_threads
        self._clock = clock
        self._cpu = Starvation()  # the threads' time since the governor last looked
        self._idle = Idle()  # and the machine's idle CPUs

    def settle(self, max_s: float = QUIET_WAIT_S, sleep: Callable[[float], None] = time.sleep,
               look: Callable[[], float] | None = None) -> tuple[bool, float]:
        """Wait, at most ``max_s``, for the machine to have as many idle CPUs as the engine
        runs threads at most; then run them all again (a neighbour busy for a moment may have
        taken one): (whether it was quiet, seconds waited). ``look``: the idle CPUs since its
        last call (the machine's); where the machine shows no CPU times, it is taken as quiet."""
        if look is None:
            if idle_cpus()[1] <= 0:
                return True, 0.0
            look = self._idle.cores
        quiet, waited = wait_for_idle(self.maximum - IDLE_CORES, max_s, look, sleep)
        governor = self.governor
        if quiet and governor is not None and governor.threads < governor.maximum:
            governor.threads = governor.maximum
            governor.changed_at = governor.raised_at = self._clock()
        self._cpu = Starvation()
        self.between_steps()
        return quiet, waited

    def between_steps(self) -> None:
        governor = self.governor
        if governor is None:
            return
        ran, waited = self._cpu.since()
        if ran + waited >= BUSY_S:
            governor.observe(ran, waited, self._clock(), self._idle.cores())
            self._cpu = Starvation()
        if governor.threads != self.threads:
            log.info("the CPUs are %s: running on %d of %d threads", "shared with a busy neighbour"
                     if governor.threads < governor.maximum else "free again", governor.threads, governor.maximum)
            self._set(governor.threads)
            self.threads = governor.threads
