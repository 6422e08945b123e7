"""Gateway settings: built once from CLI flags / TOKENGATE_* variables, validated once, frozen."""

from __future__ import annotations

import os
import secrets
import socket
from dataclasses import dataclass, field

from common.pools import POOLS
from common.protocol import TEMPERATURE_MAX, sampling_in_range
from sched_core import SchedulerConfig
from sched_core.driver import MAX_QUEUE_WAIT_MS
from sched_core.policies import DEFAULT_POLICY, make_policy

ADMIN_TOKEN_MIN_CHARS = 16
TOKEN_WEIGHT_MAX = 1000.0  # a token of one model may cost at most this many budget tokens
ROUTINGS = ("prefix", "worker", "round-robin", "pool")  # where a dispatched job goes (--routing; placement.py)


def _gateway_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


@dataclass(frozen=True, slots=True)
class GatewaySettings:
    redis_url: str
    model_name: str
    host: str = "127.0.0.1"
    port: int = 8000
    gateway_id: str = field(default_factory=_gateway_id)
    max_body_bytes: int = 1 << 20
    request_timeout_s: float = 120.0
    default_max_tokens: int = 256
    # a request without temperature/top_p gets the model's generation_config.json values, else these:
    # SmolLM2's model card's (at 1.0 the default model answers the README's request with nonsense)
    default_temperature: float = 0.2
    default_top_p: float = 0.9
    pools: tuple[str, ...] = POOLS
    admin_token: str | None = field(default=None, repr=False)  # None: the admin API refuses all
    usage_retention_s: int = 7 * 86400  # per-minute usage counters live this long
    request_record_ttl_s: int = 300  # how long a request's owner and state stay readable
    auth_cache_s: float = 1.0  # verified keys are reused this long (revocation is immediate)
    handoff_min_prompt: int = 0  # >0: prompts this long prefill on cpu and decode on gpu
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)  # cost priors from --cost-priors
    policy: str = DEFAULT_POLICY  # sched_core.policies.make_policy: smdp, tokengate, fcfs, fixed:batch=B,window_ms=W, …
    routing: str = "prefix"  # prefix: the earliest first token, cached prefixes credited; pool: whichever reads it
    shutdown_grace_s: int = 10  # after Ctrl-C/SIGTERM, in-flight requests get this long
    max_in_flight: int = 4096  # requests admitted here and not yet answered; beyond: 503 at once
    redis_max_connections: int = 256  # the gateway's Redis pool; a request waits for a free one
    redis_timeout_s: float = 5.0  # a Redis command (or a wait for a pooled connection) fails after this
    gateway_dead_after_s: float = 15.0  # a gateway silent this long is dead: a survivor settles its requests
    max_queue_wait_ms: float = MAX_QUEUE_WAIT_MS  # a request without an SLO predicted to wait longer: 503 (0: none)
    tune_every_s: float = 900.0  # --policy smdp: the table is re-solved on the traffic served this often (0: never)
    tune_cpu: float = 0.1  # the share of one core a re-solve may use (its child is stopped the rest of the time)
    # connection hygiene (docs/operations.md, "Connection limits and timeouts")
    header_timeout_s: float = 10.0  # to send the request line and headers, from the first byte
    body_timeout_s: float = 30.0  # to send the whole body, from the end of the headers
    max_connections: int = 16384  # open client connections (capped below the open-file limit); beyond: a fast 503
    keep_alive_timeout_s: int = 75  # an idle keep-alive connection is closed after this
    # (model, weight): a token of that model costs this many tokens of a tenant's budget (1 for the others)
    token_weights: tuple[tuple[str, float], ...] = ()

    def token_weight(self, model: str) -> float:
        """What a token of ``model`` costs a tenant's budget, in tokens (``--token-weight``)."""
        return dict(self.token_weights).get(model, 1.0)

    def __post_init__(self) -> None:
        # an unknown policy stops start-up, naming the forms; so does one that waits for an end
        # of arrivals (fixed:batch=B without a window), which a gateway never sees
        if hasattr(make_policy(self.policy, self.scheduler), "end_of_arrivals"):
            raise ValueError(f"policy {self.policy!r} holds a partial batch until arrivals end, which a "
                             "gateway's never do: add a window (fixed:batch=B,window_ms=W)")
        if not self.redis_url:
            raise ValueError("a Redis URL is required")
        if not 0 < self.port < 65536:
            raise ValueError(f"port {self.port} out of range")
        if self.max_body_bytes < 1024:
            raise ValueError("max body must be at least 1024 bytes")
        if self.request_timeout_s <= 0:
            raise ValueError("request timeout must be positive")
        if self.default_max_tokens < 1:
            raise ValueError("default max tokens must be at least 1")
        if not sampling_in_range("temperature", self.default_temperature):
            raise ValueError(f"the default temperature must be within [0, {TEMPERATURE_MAX:g}], as a request's")
        if not sampling_in_range("top_p", self.default_top_p):
            raise ValueError("the default top_p must be within (0, 1], as a request's")
        if self.admin_token is not None and len(self.admin_token) < ADMIN_TOKEN_MIN_CHARS:
            raise ValueError(f"the admin token must have at least {ADMIN_TOKEN_MIN_CHARS} characters")
        if self.auth_cache_s < 0:
            raise ValueError("the auth cache time must not be negative")
        if self.shutdown_grace_s <= 0:
            raise ValueError("the shutdown grace time must be positive")
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {', '.join(ROUTINGS)}, not {self.routing!r}")
        if self.handoff_min_prompt < 0:
            raise ValueError("the hand-off prompt length must not be negative")
        if self.max_in_flight < 1 or self.redis_max_connections < 4:
            raise ValueError("max in flight must be >= 1 and the Redis pool must hold at least 4 connections")
        if not self.redis_timeout_s > 1.0:
            raise ValueError("the Redis timeout must exceed 1 s (the reply reader blocks that long)")
        if self.gateway_dead_after_s < 5.0:
            raise ValueError("a gateway may be declared dead only after 5 s of silence (ten renewals)")
        if self.header_timeout_s <= 0 or self.body_timeout_s <= 0 or self.keep_alive_timeout_s <= 0:
            raise ValueError("the header, body and keep-alive timeouts must be positive")
        if not 0.0 <= self.max_queue_wait_ms <= 600_000.0:
            raise ValueError("the longest queue wait must be 0 (no bound) to 600000 ms")
        if self.max_connections < 1:
            raise ValueError("max connections must be at least 1")
        if self.tune_every_s != 0.0 and not 60.0 <= self.tune_every_s <= 7 * 86400.0:
            raise ValueError("the self-tuning interval must be 0 (never) or 60 s to 7 days")
        if not 0.01 <= self.tune_cpu <= 1.0:
            raise ValueError("a re-solve's share of a core must lie in [0.01, 1]")
        if any(not 0.0 < w <= TOKEN_WEIGHT_MAX for _m, w in self.token_weights):
            raise ValueError(f"a token weight must be in (0, {TOKEN_WEIGHT_MAX:g}]")
        if self.usage_retention_s < 60 or self.request_record_ttl_s < 1:
            raise ValueError("usage retention must be >= 60 s and the request record TTL positive")
