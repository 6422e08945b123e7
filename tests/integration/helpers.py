"""Run a real Worker in a thread against the test Redis."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import redis

from common import protocol as p
from common import wire
from workers.engine import Engine, StepResult
from workers.settings import WorkerSettings, connect
from workers.worker import Worker

MODEL = "test"  # the model the in-process workers serve: their jobs streams are its


@contextmanager
def running_worker(redis_url: str, engine: Engine, model: str = MODEL, tokenizer: tuple[str, bytes] | None = None,
                   **kw: object) -> Iterator[Worker]:
    """A worker of ``model`` in a thread (publishing ``tokenizer``, a ``tokenizer_bundle.pack``, where given)."""
    settings = WorkerSettings(
        redis_url=redis_url, block_ms=50, heartbeat_s=0.2, claim_idle_s=1.0, claim_every_s=0.2, **kw  # type: ignore[arg-type]
    )
    worker = Worker(settings, engine, connect(settings), model=model, tokenizer=tokenizer)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        yield worker
    finally:
        worker.request_stop()
        thread.join(timeout=30)
        assert not thread.is_alive(), "worker did not stop"


def send(client: redis.Redis, job: p.BatchJob, pool: str = "cpu") -> None:
    client.xadd(wire.jobs_stream(MODEL, pool), p.encode_job(job))


def collect(client: redis.Redis, stream: str, until_batches: int, timeout_s: float = 60) -> list[p.Event]:
    """Read a reply stream until ``until_batches`` batch reports arrived."""
    events: list[p.Event] = []
    last = b"0-0"
    import time

    deadline = time.monotonic() + timeout_s
    while sum(isinstance(e, p.BatchReport) for e in events) < until_batches:
        assert time.monotonic() < deadline, f"timed out; got {events}"
        for _s, entries in client.xread({stream: last}, block=200) or []:
            for entry_id, fields in entries:
                last = entry_id
                events.extend(p.decode_events(fields))
    return events


def run_engine(engine: Engine, timeout_s: float = 60) -> list[StepResult]:
    """Step ``engine`` until it holds nothing: every step's result."""
    results = []
    deadline = time.monotonic() + timeout_s
    while engine.busy:
        assert time.monotonic() < deadline, "the engine did not finish"
        results.append(engine.step())
    return results
