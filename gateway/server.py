"""Process wiring: `tokengate gateway` (HTTP only) and `tokengate serve` (everything on one host).

`serve` owns its children: a private redis-server (unless --redis-url) and one worker per
pool, each in its own session so that Ctrl-C reaches only this process, which then stops
the gateway, drains the workers and stops Redis, in that order. Children also get
PR_SET_PDEATHSIG, so even a SIGKILL of this process leaves no orphans.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import faulthandler
import logging
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import uvloop

from gateway.scheduling import scheduler_config
from gateway.settings import GatewaySettings
from workers import model_store

if TYPE_CHECKING:
    import uvicorn

log = logging.getLogger("tokengate.serve")

DEMO_TENANT = "demo"
CHILD_STOP_S = 15.0  # `serve`: workers drain this long before they are killed
SHUTDOWN_SLACK_S = 10.0  # lifespan shutdown (settling, deregistering) after the grace time

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def _settings(args: argparse.Namespace, redis_url: str, model_name: str) -> GatewaySettings:
    return GatewaySettings(
        redis_url=redis_url,
        model_name=model_name,
        host=args.host,
        port=args.port,
        max_body_bytes=args.max_body_bytes,
        request_timeout_s=args.request_timeout,
        default_max_tokens=args.default_max_tokens,
        admin_token=args.admin_token,
        usage_retention_s=args.usage_retention,
        request_record_ttl_s=args.request_record_ttl,
        auth_cache_s=args.auth_cache,
        handoff_min_prompt=args.handoff_min_prompt,
        shutdown_grace_s=args.shutdown_grace,
        scheduler=scheduler_config(args.cost_priors),  # a bad file stops start-up, naming it
    )


def _model(args: argparse.Namespace) -> model_store.ModelSpec:
    model_store.offline()
    cache = args.cache_dir or model_store.default_cache_dir()
    log.info("model cache directory: %s", cache)
    spec = model_store.resolve(args.model, Path(cache), args.model_name)
    log.info("model %s at %s", spec.name, spec.path)
    return spec


async def _run_gateway(
    settings: GatewaySettings,
    model_dir: Path,
    ready: Callable[[], None] | None = None,
    children: list[subprocess.Popen[bytes]] | None = None,
) -> None:
    import uvicorn

    from gateway.app import Gateway, create_app, redis_client
    from gateway.prompts import PromptBuilder

    prompts = PromptBuilder.load(model_dir)
    client = redis_client(settings)
    gw = Gateway(settings, prompts, client)
    config = uvicorn.Config(
        create_app(gw),
        host=settings.host,
        port=settings.port,
        loop="uvloop",
        http="httptools",
        lifespan="on",
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=settings.shutdown_grace_s,
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    watchdog = asyncio.create_task(_arm_watchdog(server, settings.shutdown_grace_s))
    try:
        if ready is not None:
            while not task.done():
                if server.started and gw.dispatcher.workers:
                    ready()
                    break
                if children and all(c.poll() is not None for c in children):
                    log.error("every worker exited before becoming ready; stopping")
                    server.should_exit = True
                    break
                await asyncio.sleep(0.1)
        await task
    finally:
        watchdog.cancel()
        await client.aclose()


async def _arm_watchdog(server: uvicorn.Server, grace_s: float) -> None:
    """Once shutdown begins, a C-level timer guarantees the process ends: if it is still alive
    ``SHUTDOWN_SLACK_S`` after the grace time (a stuck connection, a task that ignores its
    cancellation, a thread that never joins), every thread's stack goes to stderr and the
    process exits with status 1 instead of hanging."""
    while not server.should_exit:
        await asyncio.sleep(0.1)
    _exit_within(grace_s + SHUTDOWN_SLACK_S)


def _exit_within(seconds: float) -> None:
    """Arms (or re-arms) the exit timer of ``_arm_watchdog``."""
    faulthandler.dump_traceback_later(seconds, exit=True)


def run_gateway(args: argparse.Namespace) -> None:
    spec = _model(args)
    settings = _settings(args, args.redis_url, spec.name)
    log.info("gateway %s on http://%s:%d", settings.gateway_id, settings.host, settings.port)
    if settings.admin_token is None:
        log.warning("no --admin-token: the admin API under /admin is disabled")
    uvloop.run(_run_gateway(settings, spec.path))


def _pools(choice: str) -> list[str]:
    if choice != "auto":
        pools = [x.strip() for x in choice.split(",") if x.strip()]
        bad = [x for x in pools if x not in ("cpu", "gpu")]
        if bad or not pools:
            raise ValueError(f"--pools: expected auto or a list of cpu/gpu, got {choice!r}")
        return pools
    import torch

    return ["cpu", "gpu"] if torch.cuda.is_available() else ["cpu"]


def _spawn_worker(pool: str, redis_url: str, args: argparse.Namespace, model_dir: Path, model_name: str,
                  log_level: str) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable, "-m", "workers",
        "--log-level", log_level,
        "--redis-url", redis_url,
        "--pool", pool,
        "--engine", args.engine,
        "--slots", str(args.slots),
        "--echo-tokens", str(args.echo_tokens),
        "--echo-step-ms", str(args.echo_step_ms),
        "--claim-idle", str(args.claim_idle),
        "--heartbeat", str(args.heartbeat),
        "--heartbeat-ttl", str(args.heartbeat_ttl),
        "--max-deliveries", str(args.max_deliveries),
        "--model", str(model_dir),
        "--model-name", model_name,
    ]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    return subprocess.Popen(cmd, start_new_session=True, preexec_fn=_die_with_parent)


def _stop(children: list[subprocess.Popen[bytes]], timeout_s: float = CHILD_STOP_S) -> None:
    for child in children:
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for child in children:
        try:
            child.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


async def _demo_key(redis_url: str) -> str:
    """A fresh key for the demo tenant, created on first use with a generous budget."""
    import redis.asyncio as aioredis

    from gateway.errors import NotFound
    from gateway.tenant_store import TenantStore
    from gateway.tenants import Tenant, new_id

    client = aioredis.Redis.from_url(redis_url)
    try:
        store = TenantStore(client)
        try:
            tenant = await store.get(DEMO_TENANT)
        except NotFound:
            demo = Tenant(
                new_id(), DEMO_TENANT, rate=10_000.0, burst=200_000, max_queue_delay_s=5.0,
                created=int(time.time()),
            )
            tenant = await store.create(demo)
        key, _info = await store.issue_key(tenant.id, "tokengate serve")
        return key
    finally:
        await client.aclose()


def serve(args: argparse.Namespace) -> None:
    from gateway.embedded_redis import EmbeddedRedis

    if args.admin_token is None:
        args.admin_token = secrets.token_urlsafe(24)
    spec = _model(args)
    embedded: EmbeddedRedis | None = None
    redis_url = args.redis_url
    if not redis_url:
        embedded = EmbeddedRedis()
        embedded.start()
        redis_url = embedded.url
        log.info("private redis-server (%s) at %s", embedded.binary, redis_url)
    children: list[subprocess.Popen[bytes]] = []
    try:
        settings = _settings(args, redis_url, spec.name)
        pools = _pools(args.pools)
        children = [_spawn_worker(pool, redis_url, args, spec.path, spec.name, args.log_level) for pool in pools]
        base = f"http://{settings.host}:{settings.port}"
        key = uvloop.run(_demo_key(redis_url))

        def banner() -> None:
            body = (
                f'{{"model": "{spec.name}", "messages": [{{"role": "user", "content": "Say hello in five words."}}]}}'
            )
            print(
                f"\ntokengate is ready at {base}  (model {spec.name}; workers: {', '.join(pools)}; redis {redis_url})\n"
                f"Tenant '{DEMO_TENANT}', API key: {key}\n"
                f"Admin token (for /admin and `tokengate tenants|keys`): {args.admin_token}\n"
                f"Try:\n  curl {base}/v1/chat/completions -H 'Content-Type: application/json' "
                f"-H 'Authorization: Bearer {key}' -d '{body}'\n"
                "Ctrl-C stops everything.\n",
                flush=True,
            )

        uvloop.run(_run_gateway(settings, spec.path, ready=banner, children=children))
    finally:
        _exit_within(CHILD_STOP_S + SHUTDOWN_SLACK_S)
        _stop(children)
        if embedded is not None:
            embedded.stop()
        faulthandler.cancel_dump_traceback_later()
