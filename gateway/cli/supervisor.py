"""`serve` keeps its children alive: a worker or a redis-server that dies is started again.

The decision (how long to wait before the next start) is ``RestartPolicy``, a pure object
of the number of exits in a row and how long the child had run; the ``Supervisor`` polls
its children on the gateway's event loop and does the starting.
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from redis.backoff import AbstractBackoff, ExponentialBackoff

from gateway.cli import processes
from gateway.cli.embedded_redis import EmbeddedRedis

log = logging.getLogger("tokengate.serve")

POLL_S = 0.25


@dataclass(frozen=True)
class RestartPolicy:
    """A child that ran at least ``stable_s`` before exiting starts a new count; each exit in
    a row waits ``backoff.compute(exits - 1)`` before the next start (0.25 s, 0.5 s, 1 s, ...
    up to 30 s by default)."""

    backoff: AbstractBackoff = field(default_factory=lambda: ExponentialBackoff(cap=30.0, base=0.25))
    stable_s: float = 60.0

    def after_exit(self, exits_in_a_row: int, ran_s: float) -> tuple[int, float]:
        """(exits in a row now, seconds to wait before starting the child again)."""
        exits = 1 if ran_s >= self.stable_s else exits_in_a_row + 1
        return exits, self.backoff.compute(exits - 1)


@dataclass(eq=False)
class Child:
    """One supervised process: ``start`` runs it (again), ``proc`` is the current one."""

    name: str
    start: Callable[[], subprocess.Popen[bytes]]
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    exits: int = 0
    restart_at: float | None = None  # set while it waits to be started again


def worker_child(pool: str, argv: Sequence[str], model: str = "") -> Child:
    return Child(f"worker (pool {pool}{f', model {model}' if model else ''})", lambda: processes.spawn(argv))


def redis_child(redis: EmbeddedRedis) -> Child:
    def start() -> subprocess.Popen[bytes]:
        redis.launch()  # same port, same data directory
        assert redis.proc is not None
        return redis.proc

    return Child(f"redis-server (port {redis.port})", start, proc=redis.proc)


def _status(code: int) -> str:
    return f"signal {-code}" if code < 0 else f"status {code}"


def gateway_child(index: int, argv: Sequence[str], env: dict[str, str]) -> Child:
    return Child(f"gateway process {index}", lambda: processes.spawn(argv, env=env))


class Supervisor:
    """Starts its children, restarts any (gateway process, worker or the private
    redis-server) that exits while ``run`` is active, and stops them in order: gateway
    processes and workers drain, then Redis."""

    def __init__(
        self,
        workers: Sequence[Child],
        redis: EmbeddedRedis | None = None,
        policy: RestartPolicy | None = None,
        clock: Callable[[], float] = time.monotonic,
        gateways: Sequence[Child] = (),
    ) -> None:
        self.gateways = list(gateways)
        self._gateways_told = False
        self.workers = list(workers)
        self.redis = redis
        self.children = self.gateways + self.workers + ([redis_child(redis)] if redis is not None else [])
        self.policy = policy or RestartPolicy()
        self.clock = clock

    def start(self) -> None:
        for child in self.children:
            if child.proc is None:
                with processes.signals_deferred():
                    child.proc = child.start()
                child.started_at = self.clock()

    def procs(self) -> list[subprocess.Popen[bytes]]:
        return [c.proc for c in self.children if c.proc is not None]

    def workers_exited(self) -> bool:
        return all(c.proc is None or c.proc.poll() is not None for c in self.workers)

    def check(self) -> None:
        """One round: note children that exited, start those whose wait is over."""
        now = self.clock()
        for child in self.children:
            if self._gateways_told and child in self.gateways:
                continue  # stopping: a gateway process that exits stays stopped
            if child.restart_at is None and child.proc is not None:
                code = child.proc.poll()
                if code is None:
                    continue
                child.exits, delay = self.policy.after_exit(child.exits, now - child.started_at)
                child.restart_at = now + delay
                log.warning(
                    "%s exited with %s; starting it again in %.2g s (%d exit(s) in a row)",
                    child.name, _status(code), delay, child.exits,
                )
            if child.restart_at is not None and now >= child.restart_at:
                child.restart_at = None
                child.started_at = now
                with processes.signals_deferred():
                    child.proc = child.start()
                log.warning("%s started again (pid %d)", child.name, child.proc.pid)

    async def run(self) -> None:
        """Supervise until cancelled."""
        while True:
            self.check()
            await asyncio.sleep(POLL_S)

    def stop_gateways(self) -> None:
        """SIGTERM to the gateway processes, once: they stop admitting and drain (``stop``
        then waits for them). A second SIGTERM would tell them to hurry."""
        if not self._gateways_told:
            self._gateways_told = True
            processes.signal_all([c.proc for c in self.gateways if c.proc is not None])

    def stop(self, timeout_s: float, hurry: Callable[[], bool] = lambda: False) -> None:
        """Gateway processes and workers first (SIGTERM: they drain; ``hurry`` cuts that
        short), then redis-server (SIGTERM: it writes its AOF), then its temporary files. Call
        it with ``run`` stopped."""
        self.stop_gateways()
        processes.stop([c.proc for c in self.workers if c.proc is not None], timeout_s, hurry,
                       signalled=[c.proc for c in self.gateways if c.proc is not None])
        if self.redis is not None:
            self.redis.stop()
