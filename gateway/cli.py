"""The `tokengate` command."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from gateway import admin_cli, simulate_cli
from workers import cli as worker_cli
from workers.cli import env_default


def _add_gateway_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default=env_default("host", "127.0.0.1"))
    parser.add_argument("--port", type=int, default=int(env_default("port", 8000)))
    parser.add_argument("--max-body-bytes", type=int, default=int(env_default("max_body_bytes", 1 << 20)))
    parser.add_argument("--request-timeout", type=float, default=float(env_default("request_timeout", 120)),
                        help="seconds before an accepted request ends with 503")
    parser.add_argument("--default-max-tokens", type=int, default=int(env_default("default_max_tokens", 256)))
    parser.add_argument("--admin-token", default=env_default("admin_token"),
                        help="bearer token for /admin (16+ characters); without one the admin "
                        "API is disabled, except that `serve` makes one up and prints it")
    parser.add_argument("--usage-retention", type=int,
                        default=int(env_default("usage_retention", 7 * 86400)),
                        help="seconds per-minute usage counters are kept")
    parser.add_argument("--handoff-min-prompt", type=int, default=int(env_default("handoff_min_prompt", 0)),
                        help="prompts of at least this many tokens prefill on a cpu worker and decode on the "
                             "gpu pool when both are alive (0: never)")
    parser.add_argument("--auth-cache", type=float, default=float(env_default("auth_cache", 1.0)),
                        help="seconds a verified API key is reused without a lookup (revocation is "
                        "still immediate; tenant changes reach other replicas within this time)")
    parser.add_argument("--cost-priors", default=env_default("cost_priors"),
                        help="JSON file of measured per-path cost priors for the scheduler "
                        "(docs/scheduling.md); default: built-in guesses, refitted online")
    parser.add_argument("--shutdown-grace", type=int, default=int(env_default("shutdown_grace", 10)),
                        help="seconds in-flight requests may still finish after Ctrl-C/SIGTERM; the "
                        "process exits at the latest 10 s after that, with its stacks in the log")
    parser.add_argument("--request-record-ttl", type=int,
                        default=int(env_default("request_record_ttl", 3600)),
                        help="seconds a request's owner and state stay readable")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokengate", description="Multi-tenant token-budget LLM gateway")
    parser.add_argument("--log-level", default=env_default("log_level", "INFO"))
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="the whole product on one machine: Redis, gateway, workers")
    serve.add_argument("--redis-url", default=env_default("redis_url"),
                       help="use this Redis instead of starting a private redis-server")
    serve.add_argument("--pools", default=env_default("pools", "auto"),
                       help="worker pools to start: auto (cpu, plus gpu when CUDA is present) or e.g. cpu,gpu")
    _add_gateway_args(serve)
    worker_cli.add_model_args(serve)
    worker_cli.add_worker_args(serve)

    gateway = sub.add_parser("gateway", help="the HTTP gateway alone, against a shared Redis")
    gateway.add_argument("--redis-url", default=env_default("redis_url"), required=env_default("redis_url") is None)
    _add_gateway_args(gateway)
    worker_cli.add_model_args(gateway)

    worker = sub.add_parser("worker", help="one pool worker, against a shared Redis (any host)")
    worker.add_argument("--redis-url", default=env_default("redis_url"), required=env_default("redis_url") is None)
    worker_cli.add_model_args(worker)
    worker_cli.add_worker_args(worker)

    simulate = sub.add_parser("simulate", help="compare scheduling policies in the discrete-event "
                              "simulator (no Redis, no model)")
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
    if args.command in ("tenants", "keys"):
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
