"""The `tokengate` command."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gateway import admin_cli, simulate_cli
from gateway.embedded_redis import FSYNC_CHOICES, default_data_dir
from gateway.settings import GatewaySettings
from sched_core import SchedulerConfig
from workers import cli as worker_cli
from workers.cli import env_default

_SETTINGS = {f.name: f for f in dataclasses.fields(GatewaySettings)}
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
     "scheduling policy: tokengate (the step-time scheduler: fair share, least slack, latency "
     "contracts), fcfs, or fixed:batch=B,window_ms=W (a dynamic batcher); baselines send no "
     "contract headers"),
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


def setting_default(name: str) -> Any:
    """The default of a ``GatewaySettings`` field: the one place it is written."""
    default = _SETTINGS[name].default
    assert default is not dataclasses.MISSING, f"GatewaySettings.{name} has no plain default"
    return default


def _setting(parser: argparse.ArgumentParser, flag: str, name: str, help: str | None = None) -> None:
    """A flag for the ``GatewaySettings`` field ``name``: its default comes from the field,
    ``TOKENGATE_<FLAG>`` overrides it (argparse converts a string default with ``type``)."""
    default = setting_default(name)
    kind = str if default is None else type(default)
    parser.add_argument(f"--{flag}", dest=name, type=kind, default=env_default(flag, default), help=help)


def _add_gateway_args(parser: argparse.ArgumentParser) -> None:
    for flag, name, help in GATEWAY_FLAGS:
        _setting(parser, flag, name, help)
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


SHARED_REDIS = "the shared Redis, e.g. redis://host:6379/0 (required, unless TOKENGATE_REDIS_URL is set)"


def _processes(text: str) -> int:
    n = int(text)
    if not 1 <= n <= 256:
        raise argparse.ArgumentTypeError(f"expected 1 to 256 processes, got {n}")
    return n


def build_parser() -> argparse.ArgumentParser:
    helpful = worker_cli.HelpFormatter  # every flag's --help shows its default
    parser = argparse.ArgumentParser(prog="tokengate", description="Multi-tenant token-budget LLM gateway",
                                     formatter_class=helpful)
    parser.add_argument("--log-level", default=env_default("log_level", "INFO"), help="DEBUG, INFO, WARNING or ERROR")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="the whole product on one machine: Redis, gateway, workers",
                           formatter_class=helpful)
    serve.add_argument("--redis-url", default=env_default("redis_url"),
                       help="use this Redis instead of starting a private redis-server (default: start one)")
    serve.add_argument("--pools", default=env_default("pools", "auto"),
                       help="worker pools to start: auto (cpu, plus gpu when CUDA is present) or e.g. cpu,gpu")
    serve.add_argument("--data-dir", type=Path, default=env_default("data_dir"),
                       help=f"where the private redis-server keeps its append-only file (tenants, keys, "
                       f"budgets), and serve its admin token and the demo tenant's key (with --redis-url too); "
                       f"default {default_data_dir()}")
    serve.add_argument("--redis-fsync", choices=FSYNC_CHOICES, default=env_default("redis_fsync", FSYNC_CHOICES[0]),
                       help="everysec: a crash of the private redis-server may lose its last second of writes; "
                       "always: none is lost (budget refunds stay exact through a crash), an fsync per write batch")
    _add_gateway_args(serve)
    serve.add_argument("--gateways", type=_processes, default=env_default("gateways", 1),
                       help="gateway processes sharing the port, one per core you give it (docs/operations.md)")
    worker_cli.add_model_args(serve)
    worker_cli.add_worker_args(serve)

    gateway = sub.add_parser("gateway", help="the HTTP gateway alone, against a shared Redis", formatter_class=helpful)
    gateway.add_argument("--redis-url", default=env_default("redis_url"), required=env_default("redis_url") is None,
                         help=SHARED_REDIS)
    _add_gateway_args(gateway)
    gateway.add_argument("--workers", type=_processes, default=env_default("workers", 1),
                         help="gateway processes sharing the port (SO_REUSEPORT), one per core you give it; "
                         "this process supervises them (docs/operations.md)")
    gateway.add_argument("--reuse-port", action="store_true",
                         help="bind with SO_REUSEPORT, so that other gateway processes can share the port")
    worker_cli.add_model_args(gateway)

    worker = sub.add_parser("worker", help="one pool worker, against a shared Redis (any host)",
                            formatter_class=helpful)
    worker.add_argument("--redis-url", default=env_default("redis_url"), required=env_default("redis_url") is None,
                        help=SHARED_REDIS)
    worker_cli.add_model_args(worker)
    worker_cli.add_worker_args(worker)

    simulate = sub.add_parser("simulate", help="compare scheduling policies in the discrete-event "
                              "simulator (no Redis, no model)", formatter_class=helpful)
    simulate_cli.add_args(simulate)

    admin_cli.add_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if args.command in ("tenants", "keys", "workers"):
        return admin_cli.run(args)
    if args.command == "simulate":
        return simulate_cli.run(args)
    try:
        if args.command == "worker":
            worker_cli.run(worker_cli.settings_from_args(args))
        elif args.command == "gateway":
            from gateway.server import run_gateway

            run_gateway(args)
        elif args.command == "serve":
            from gateway.server import serve

            serve(args)
    except KeyboardInterrupt:
        return 130
    except (ValueError, RuntimeError) as exc:
        print(f"tokengate: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
