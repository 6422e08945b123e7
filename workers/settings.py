"""A worker's settings, built once from its flags (``workers/cli.py``), validated once, frozen;
and its Redis client."""

from __future__ import annotations

import math
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from common.pools import POOLS
from workers.devices import DTYPES

ENGINES = ("hf", "echo", "upstream")


@dataclass(frozen=True, slots=True)
class WorkerSettings:
    redis_url: str
    pool: str = "cpu"
    worker_id: str = field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")
    engine: str = "hf"  # "hf" | "echo" | "upstream"
    model: str | None = None
    model_name: str | None = None
    cache_dir: Path | None = None
    slots: int = 32
    step_tokens: int = 64  # per-step token budget, decode plus prefill (0: none); see docs/benchmarks.md
    echo_tokens: int = 16
    echo_step_s: float = 0.0
    echo_prefill_s: float = 0.0  # the echo engine's seconds per prompt token prefilled (a step's extra time)
    threads: int | None = None
    dtype: str = "auto"  # a CPU worker's dtype (workers.devices.DTYPES)
    heartbeat_s: float = 1.0
    heartbeat_ttl_s: float = 5.0
    block_ms: int = 100  # an idle read's block: a stop signal is noticed within it (it cannot cut it short)
    reply_maxlen: int = 100_000
    claim_idle_s: float = 15.0  # a pending entry idle this long belongs to a dead worker
    claim_every_s: float = 1.0
    max_deliveries: int = 3
    redis_timeout_s: float = 5.0  # socket connect and read timeout of every Redis call
    retry_base_s: float = 0.05  # backoff after a failed Redis call: base·2^failures seconds,
    retry_cap_s: float = 2.0  # at most this
    trim_every_s: float = 5.0  # how often the heartbeat thread trims the jobs stream
    telemetry_every_s: float = 0.25  # step records go out at least this often while busy
    warm_up_tokens: int = 16  # a greedy sequence of this many tokens runs before the first heartbeat (0: none)
    profile_s: float = 10.0  # the self-profile's time budget at start (0: none; workers/selfprofile.py)
    profile_dir: Path | None = None  # profiles kept per machine fingerprint (default ~/.cache/tokengate/profiles)
    upstream_url: str | None = None  # engine "upstream": the OpenAI-compatible server it fronts
    upstream_model: str | None = None  # the model name sent upstream (default: the first of its /v1/models)
    upstream_timeout_s: float = 60.0  # longest wait for the upstream's next chunk before it counts as down
    # an upstream's context window (prompt plus completion tokens) where it does not say its own
    # (llama-cpp-python's server); 0: the model's own. Gateways refuse longer requests
    context_tokens: int = 0

    def __post_init__(self) -> None:
        if self.pool not in POOLS:
            raise ValueError(f"pool must be one of {POOLS}, not {self.pool!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, not {self.dtype!r}")
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, not {self.engine!r}")
        if (self.engine == "upstream") != (self.upstream_url is not None):
            raise ValueError("the upstream engine needs an upstream URL, and only it takes one")
        if self.upstream_timeout_s <= 0:
            raise ValueError("the upstream timeout must be positive")
        if self.context_tokens < 0:
            raise ValueError("context tokens must be 0 (the model's own) or more")
        if self.slots < 1:
            raise ValueError("slots must be at least 1")
        if self.step_tokens < 0:
            raise ValueError("step tokens must be 0 (no budget) or more")
        if self.claim_idle_s <= 3 * self.heartbeat_s:
            raise ValueError("claim idle time must exceed three heartbeat intervals")
        if self.heartbeat_ttl_s <= self.heartbeat_s:
            raise ValueError("heartbeat TTL must exceed the heartbeat interval")
        if self.max_deliveries < 1:
            raise ValueError("max deliveries must be at least 1")
        if self.redis_timeout_s * 1000 <= self.block_ms:
            raise ValueError("the Redis timeout must exceed the blocking read time")
        if not 0 < self.retry_base_s <= self.retry_cap_s:
            raise ValueError("retry backoff needs 0 < base <= cap")
        if not 0 <= self.profile_s < math.inf:
            raise ValueError("the self-profile budget must be 0 (none) or a number of seconds")


def connect(settings: WorkerSettings) -> redis.Redis:
    """The worker's Redis client. redis-py retries nothing itself: a pipeline re-sent after
    a timeout could run a fenced publish twice (the same reply written twice); the
    worker's loops retry instead, each with its own backoff (``common/retry.py``)."""
    return redis.Redis.from_url(
        settings.redis_url,
        socket_timeout=settings.redis_timeout_s,
        socket_connect_timeout=settings.redis_timeout_s,
        retry=Retry(NoBackoff(), 0),
    )
