"""The `tokengate` command."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from common.settings import HelpFormatter, add_redis_url, env_default, env_flag
from gateway.cli import admin as admin_cli
from gateway.cli.embedded_redis import FSYNC_CHOICES, default_data_dir
from gateway.cli.flags import add_gateway_args
from sched_core.simulate import cli as simulate_cli
from sched_core.simulate import policy_cli
from workers import cli as worker_cli


def _processes(text: str) -> int:
    n = int(text)
    if not 1 <= n <= 256:
        raise argparse.ArgumentTypeError(f"expected 1 to 256 processes, got {n}")
    return n


ENVIRONMENT = ("Every flag can also come from the environment as TOKENGATE_<FLAG> (upper case, dashes as "
               "underscores: TOKENGATE_REDIS_URL, TOKENGATE_MAX_QUEUE_WAIT_MS); a flag given on the command line wins.")


def build_parser() -> argparse.ArgumentParser:
    helpful = HelpFormatter  # every flag's --help shows its default
    parser = argparse.ArgumentParser(prog="tokengate", description="Multi-tenant token-budget LLM gateway",
                                     formatter_class=helpful, epilog=ENVIRONMENT)
    parser.add_argument("--log-level", default=env_default("log_level", "INFO"), help="DEBUG, INFO, WARNING or ERROR")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="the whole product on one machine: Redis, gateway, workers",
                           formatter_class=helpful, epilog=ENVIRONMENT)
    add_redis_url(serve, private="use this Redis instead of starting a private redis-server (default: start one)")
    serve.add_argument("--pools", default=env_default("pools", "auto"),
                       help="worker pools to start: auto (cpu, plus gpu when CUDA is present) or e.g. cpu,gpu")
    serve.add_argument("--data-dir", type=Path, default=env_default("data_dir"),
                       help=f"where the private redis-server keeps its append-only file (tenants, keys, "
                       f"budgets), and serve its admin token and the demo tenant's key (with --redis-url too); "
                       f"default {default_data_dir()}")
    serve.add_argument("--redis-fsync", choices=FSYNC_CHOICES, default=env_default("redis_fsync", FSYNC_CHOICES[0]),
                       help="everysec: a crash of the private redis-server may lose its last second of writes; "
                       "always: none is lost (budget refunds stay exact through a crash), an fsync per write batch")
    add_gateway_args(serve)
    serve.add_argument("--gateways", type=_processes, default=env_default("gateways", 1),
                       help="gateway processes sharing the port, one per core you give it (docs/operations.md)")
    worker_cli.add_model_args(serve, several=True)
    worker_cli.add_worker_args(serve)

    gateway = sub.add_parser("gateway", help="the HTTP gateway alone, against a shared Redis", formatter_class=helpful,
                             epilog=ENVIRONMENT)
    add_redis_url(gateway)
    add_gateway_args(gateway)
    gateway.add_argument("--processes", "--workers", dest="workers", type=_processes,
                         default=env_default("processes", env_default("workers", 1)),
                         help="gateway processes sharing the port (SO_REUSEPORT), one per core you give it; "
                         "this process supervises them (docs/operations.md). --workers is its older name: "
                         "these are gateway processes, not model workers (`serve --gateways`)")
    gateway.add_argument("--reuse-port", action="store_true",
                         help="bind with SO_REUSEPORT, so that other gateway processes can share the port")
    worker_cli.add_model_args(gateway, several=True)
    gateway.add_argument("--model-from-workers", action="store_true",
                         default=env_flag("model_from_workers"),
                         help="no local model files: wait for a live worker (serving --model-name, where given) "
                         "to publish its model's tokenizer in Redis, and count tokens with that; every other "
                         "model a worker announces is served too, as with --model (docs/operations.md); "
                         "not with --model")

    worker = sub.add_parser("worker", help="one pool worker, against a shared Redis (any host)",
                            formatter_class=helpful, epilog=ENVIRONMENT)
    add_redis_url(worker)
    worker_cli.add_model_args(worker)
    worker_cli.add_worker_args(worker)

    simulate = sub.add_parser("simulate", help="compare scheduling policies in the discrete-event "
                              "simulator (no Redis, no model)", formatter_class=helpful)
    simulate_cli.add_args(simulate)
    policy_cli.add_commands(sub)

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
    if args.command == "policy":
        return policy_cli.run(args)
    try:
        if args.command == "worker":
            worker_cli.run(worker_cli.settings_from_args(args))
        elif args.command == "gateway":
            from gateway.cli.server import run_gateway

            run_gateway(args)
        elif args.command == "serve":
            from gateway.cli.server import serve

            serve(args)
    except KeyboardInterrupt:
        return 130
    except (ValueError, RuntimeError) as exc:
        print(f"tokengate: {exc}", file=sys.stderr)
        return 2
    return 0

