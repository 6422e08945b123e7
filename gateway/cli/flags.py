"""The gateway's flag table: every ``GatewaySettings`` field a command line sets, its flag,
its help, and its default read from the field (``TOKENGATE_<FLAG>`` overrides it). `tokengate
gateway` and `serve` add these flags; `serve` passes them on to the gateway processes it starts."""

from __future__ import annotations

import argparse
import functools

from common.settings import add_flags, env_default, field_default
from gateway.settings import GatewaySettings
from sched_core import SchedulerConfig

# every GatewaySettings flag: (flag, field, help); its dest is the field's name, its default the field's
GATEWAY_FLAGS: tuple[tuple[str, str, str | None], ...] = (
    ("host", "host", "address to listen on"),
    ("port", "port", "port to listen on"),
    ("max-body-bytes", "max_body_bytes", "largest request body on /v1 (413 beyond)"),
    ("request-timeout", "request_timeout_s",
     "seconds before an accepted request ends with 503"),
    ("default-max-tokens", "default_max_tokens",
     "max_tokens of a chat completion that sends none (trimmed to what the context and the tenant leave)"),
    ("default-temperature", "default_temperature",
     "temperature of a request that sends none, unless the model's generation_config.json sets one"),
    ("default-top-p", "default_top_p",
     "top_p of a request that sends none, unless the model's generation_config.json sets one"),
    ("admin-token", "admin_token",
     "bearer token for /admin (16+ characters); without one the admin API is disabled, "
     "except that `serve` makes one up, keeps it in its --data-dir and prints it at every start"),
    ("usage-retention", "usage_retention_s",
     "seconds per-minute usage counters are kept"),
    ("handoff-min-prompt", "handoff_min_prompt",
     "prompts of at least this many tokens prefill on a cpu worker and decode on the gpu pool "
     "when both are alive (0: never)"),
    ("auth-cache", "auth_cache_s",
     "seconds a verified API key is reused without a lookup (revocation is still immediate; "
     "tenant changes reach other replicas within this time)"),
    ("shutdown-grace", "shutdown_grace_s",
     "seconds in-flight requests may still finish after Ctrl-C/SIGTERM; then they end with a "
     "503 (or a final error event); the process exits at the latest 10 s after that"),
    ("request-record-ttl", "request_record_ttl_s",
     "seconds a request's owner and state stay readable"),
    ("header-timeout", "header_timeout_s",
     "seconds a client may take to send a request line and headers (from its first byte; "
     "from the connection on a new one); a slower one is closed"),
    ("body-timeout", "body_timeout_s",
     "seconds a client may take to send a request body (408 after)"),
    ("max-connections", "max_connections",
     "open client connections; beyond it new ones get an immediate 503 (capped below the "
     "open-file limit)"),
    ("keep-alive-timeout", "keep_alive_timeout_s",
     "seconds an idle keep-alive connection stays open"),
    ("policy", "policy",
     "scheduling policy: smdp (default) or smdp:FILE (the step-time scheduler: fair share, least slack, "
     "latency contracts, its knobs set per macro-state by the packaged SMDP table or one `tokengate policy "
     "solve` wrote), tokengate (the same scheduler with one fixed set of knobs: the heuristic), fcfs, or "
     "fixed:batch=B,window_ms=W (a dynamic batcher); baselines send no contract headers"),
    ("tune-every", "tune_every_s",
     "with --policy smdp: seconds between re-solves of the policy table on the traffic served (the last "
     "3,000 requests, in a child process at idle CPU priority); a candidate runs only where it beats the "
     "table in force on the later third of that traffic, and is rolled back if live SLO attainment or "
     "contract accuracy drops (docs/scheduling.md §16.2; 0: only when POST /admin/scheduler/tune asks)"),
    ("tune-cpu", "tune_cpu",
     "the share of one core a re-solve may use: its child runs this share of every half second and is "
     "stopped the rest (on top of its idle CPU priority), so that serving keeps its cores"),
    ("routing", "routing",
     "prefix (default): the scheduler sends each job to the worker of its pool where its first token "
     "is predicted earliest, crediting the prompt prefix that worker's engine should hold cached, within "
     "that worker's free slots (docs/scheduling.md §15); worker: the same without the cache credit; "
     "round-robin: to each worker with a free slot in turn; pool: to whichever worker of the pool reads it "
     "first"),
    ("max-in-flight", "max_in_flight",
     "requests this gateway holds at once (admitted, not yet answered); beyond it a 503 at once"),
    ("redis-max-connections", "redis_max_connections",
     "the gateway's Redis connection pool; a request waits (up to --redis-timeout) for a free one"),
    ("redis-timeout", "redis_timeout_s",
     "seconds a Redis command or a wait for a pooled connection may take before the request gets a 503"),
    ("gateway-dead-after", "gateway_dead_after_s",
     "seconds of silence after which a gateway is dead and a survivor settles its requests"),
    ("max-queue-wait-ms", "max_queue_wait_ms",
     "a request without a first-token SLO whose first token is predicted to wait longer than this "
     "(beyond its own prompt's time) is refused at once with 503 `overloaded` and Retry-After; a "
     "tenant's max_queue_wait_ms overrides it (0: no bound)"),
)
SETTING_FLAGS = frozenset(name for _flag, name, _help in GATEWAY_FLAGS)


setting_default = functools.partial(field_default, GatewaySettings)  # a GatewaySettings field's default


def token_weight(text: str) -> tuple[str, float]:
    """``MODEL=W`` as (model, weight); the weight's range is checked with the settings."""
    model, sep, weight = text.rpartition("=")
    try:
        if sep and model:
            return model, float(weight)
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"expected MODEL=WEIGHT (a number), got {text!r}")


def add_gateway_args(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, GatewaySettings, GATEWAY_FLAGS, dest=lambda _flag, name: name)
    parser.add_argument("--token-weight", action="append", type=token_weight, metavar="MODEL=W",
                        default=[token_weight(x) for x in (env_default("token_weight") or "").split(",") if x],
                        help="a token of MODEL costs W tokens of a tenant's budget (default 1); again for each "
                        "model; TOKENGATE_TOKEN_WEIGHT takes a comma-separated list (docs/tenants.md)")
    parser.add_argument("--cost-priors", default=env_default("cost_priors"),
                        help="JSON file of measured per-path cost priors for the scheduler "
                        "(docs/scheduling.md); default: the packaged measured profiles, refitted online")
    # the SLO the scheduler plans for; the defaults are SchedulerConfig's (one source)
    defaults = SchedulerConfig()
    parser.add_argument("--slo-ttft-ms", type=float,
                        default=env_default("slo_ttft_ms", defaults.ttft_p99_slo_s * 1000),
                        help="time to first token the scheduler plans for (p99): a request that can no "
                        "longer make it takes the faster path (docs/scheduling.md)")
    parser.add_argument("--slo-tpot-ms", type=float,
                        default=env_default("slo_tpot_ms", defaults.tpot_slo_s * 1000),
                        help="time per output token the running sequences are kept within: the "
                        "scheduler holds a new prompt that would push them past it (docs/scheduling.md §6)")
    parser.add_argument("--aging-tokens", type=float,
                        default=env_default("aging_tokens", defaults.aging_tokens_per_s),
                        help="prompt tokens of cost one second of waiting forgives in the scheduler's "
                        "shortest-prompt-first order (docs/scheduling.md §2): lower favours short prompts "
                        "longer; scale it with your prompts' lengths")
