"""Process wiring: `tokengate gateway` (HTTP only) and `tokengate serve` (everything on one host).

`serve` owns its children: a private redis-server (unless --redis-url; durable in
--data-dir) and one worker per pool, each in its own session so that Ctrl-C reaches only
this process (``gateway.cli.processes``). While the gateway serves, a ``Supervisor`` starts again
any child that dies. On SIGINT or SIGTERM (``gateway.cli.shutdown``) the gateway stops admitting,
in-flight requests get --shutdown-grace, then the workers drain, then Redis writes its AOF
and stops, then temporary files go, in that order. Children also get PR_SET_PDEATHSIG, so
even a SIGKILL of this process leaves no orphans. The admin token `serve` makes up and the demo
tenant's key are kept in --data-dir (``gateway.cli.serve_state``) and printed again at each start.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import faulthandler
import gc
import logging
import socket
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import uvloop

from common import protocol as p
from common.pools import POOLS
from gateway.cli import banners, processes, serve_state, served
from gateway.cli.banners import DEMO_TENANT
from gateway.cli.embedded_redis import EmbeddedRedis, default_data_dir
from gateway.cli.flags import GATEWAY_FLAGS, SETTING_FLAGS
from gateway.cli.shutdown import FORCED_EXIT_S, Interrupted, StopSignals, exit_within
from gateway.cli.supervisor import POLL_S, Supervisor, gateway_child, worker_child
from gateway.dispatch.fleet import scheduler_config
from gateway.settings import GatewaySettings
from workers import cli as worker_cli
from workers import model_store

if TYPE_CHECKING:
    import uvicorn

log = logging.getLogger("tokengate.serve")

CHILD_STOP_S = 15.0  # `serve`: workers drain this long before they are killed
SHUTDOWN_SLACK_S = 10.0  # lifespan shutdown (settling, deregistering) after the grace time
DRAIN_SLACK_S = 2  # uvicorn's own cancellation waits this long after ``Drain`` has ended requests
LISTEN_BACKLOG = 2048  # uvicorn's default


def settings_from_args(args: argparse.Namespace, redis_url: str, model_name: str, nofile: int) -> GatewaySettings:
    from gateway.http.protocol import connection_cap

    max_connections = connection_cap(args.max_connections, nofile)
    if max_connections < args.max_connections:
        log.warning("--max-connections %d lowered to %d: the open-file limit is %d",
                    args.max_connections, max_connections, nofile)
    given = {name: getattr(args, name) for name in SETTING_FLAGS}
    given |= {
        "redis_url": redis_url,
        "model_name": model_name,
        "max_connections": max_connections,
        "token_weights": tuple(args.token_weight or ()),
        # a bad file or SLO stops start-up, naming it
        "scheduler": scheduler_config(args.cost_priors, ttft_p99_slo_s=args.slo_ttft_ms / 1000,
                                      tpot_slo_s=args.slo_tpot_ms / 1000,
                                      aging_tokens_per_s=args.aging_tokens),
    }
    return GatewaySettings(**given)


def listen_socket(host: str, port: int) -> socket.socket:
    """A listening socket that other gateway processes bind too (SO_REUSEPORT): the kernel
    spreads new connections over them. A port held by anything else is a clear error."""
    try:
        family, kind, proto, _name, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                              flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(addr)
    except OSError as exc:
        raise RuntimeError(f"cannot listen on {host}:{port}: {exc}") from None
    sock.listen(LISTEN_BACKLOG)
    return sock


async def _run_gateway(
    settings: GatewaySettings,
    specs: list[model_store.ModelSpec],
    signals: StopSignals,
    ready: Callable[[dict[str, p.Heartbeat]], None] | None = None,
    supervisor: Supervisor | None = None,
    reuse_port: bool = False,
    cache_dir: Path | None = None,
) -> None:
    """Serves ``specs`` (the first is ``settings.model_name``) and every model its workers
    announce (``served.watch``) until a signal (or, under `serve`, until every worker died
    before the first became ready); ``supervisor`` keeps the children alive from the moment it
    is ready. ``reuse_port``: share the port with other gateway processes (``--workers``)."""
    import uvicorn

    from gateway.cli.shutdown import Drain, QuietServer, expire_after_grace
    from gateway.http.app import create_app
    from gateway.http.protocol import ConnectionLimits, protocol_class
    from gateway.http.services import Gateway, redis_client

    client = redis_client(settings)
    prompts, sampling = served.tokens(specs[0], settings)
    gw = Gateway(settings, prompts, client, sampling)
    for spec in specs[1:]:
        gw.add_model(spec.name, *served.tokens(spec, settings))
    drain = Drain(create_app(gw), settings.shutdown_grace_s)
    limits = ConnectionLimits(settings.header_timeout_s, settings.body_timeout_s, settings.max_connections)
    config = uvicorn.Config(
        drain,
        host=settings.host,
        port=settings.port,
        loop="uvloop",
        http=protocol_class(limits),
        backlog=LISTEN_BACKLOG,
        proxy_headers=False,  # nothing reads the client's address; X-Forwarded-For is not parsed
        ws="none",  # no route speaks websocket: an Upgrade request is served as plain HTTP
        lifespan="on",
        log_level="warning",
        access_log=False,
        timeout_keep_alive=settings.keep_alive_timeout_s,
        timeout_graceful_shutdown=settings.shutdown_grace_s + DRAIN_SLACK_S,
    )
    server = QuietServer(config)
    lost: list[str] = []

    def fatal(why: str) -> None:  # a dispatch loop stopped: this process cannot serve; exit non-zero
        lost.append(why)
        server.should_exit = True

    for dom in gw.domains.values():
        dom.dispatcher.on_fatal = fatal
    signals.serving(server, drain)
    # what start-up made (the tokenizer, transformers and torch: ~300,000 objects) lives as long
    # as the process: out of the collector's sight, a full collection takes microseconds
    # instead of holding the event loop for ~150 ms (issue 23: 1 request in 100 stalled)
    gc.freeze()
    task = asyncio.create_task(server.serve([listen_socket(settings.host, settings.port)] if reuse_port else None))
    stopped = asyncio.Event()  # the watch for announced models ends at its next look
    background = [
        asyncio.create_task(_arm_watchdog(server, settings.shutdown_grace_s, supervisor)),
        asyncio.create_task(expire_after_grace(server, drain, settings.shutdown_grace_s)),
    ]
    try:
        while not (server.started or task.done()):  # the lifespan has started the first domains
            await asyncio.sleep(0.05)
        ending = lambda: server.should_exit or stopped.is_set()  # noqa: E731
        background.append(asyncio.create_task(served.watch(gw, cache_dir, fatal, ending)))
        if ready is not None:
            # a stop signal during start-up raised inside the loop can be lost in a callback;
            # ``StopSignals.serving`` then told the server to exit: it says no "ready"
            while not task.done() and not server.should_exit:
                workers = {wid: hb for dom in gw.domains.values() for wid, hb in dom.dispatcher.workers.items()}
                if server.started and workers:
                    ready(workers)
                    break
                if supervisor is not None and supervisor.workers_exited():
                    log.error("every worker exited before becoming ready; stopping")
                    server.should_exit = True
                    break
                await asyncio.sleep(0.1)
        if supervisor is not None and not server.should_exit:
            background.append(asyncio.create_task(supervisor.run()))
        await task
    finally:
        stopped.set()
        for t in background:
            t.cancel()
        await client.aclose()
    if lost:
        raise RuntimeError(f"stopped because {lost[0]}")  # `tokengate` exits with status 2


async def _arm_watchdog(server: uvicorn.Server, grace_s: float, supervisor: Supervisor | None) -> None:
    """Once shutdown begins, a C-level timer guarantees the process ends: if it is still alive
    ``SHUTDOWN_SLACK_S`` after the grace time (a stuck connection, a task that ignores its
    cancellation, a thread that never joins), every thread's stack goes to stderr and the
    process exits with status 1 instead of hanging."""
    while not server.should_exit:
        await asyncio.sleep(0.1)
    exit_within(grace_s + SHUTDOWN_SLACK_S)
    if supervisor is not None:
        supervisor.stop_gateways()  # `serve --gateways`: the others stop admitting now too


@contextlib.contextmanager
def _stoppable(signals: StopSignals) -> Iterator[None]:
    """The first SIGINT/SIGTERM during the start-up (``Interrupted``) ends it quietly; once
    the block is left, whichever way, a signal hurries the cleanup instead."""
    try:
        yield
    except Interrupted as exc:
        log.info("%s during start-up: stopping", exc)
    finally:
        signals.stopping()


def run_gateway(args: argparse.Namespace) -> None:
    from gateway.http.protocol import raise_nofile_limit

    if args.workers > 1:
        run_gateway_group(args)
        return
    signals = StopSignals().install()
    with _stoppable(signals):
        if args.model_from_workers:
            if args.model:
                raise ValueError("--model-from-workers counts tokens with the workers' model: not with --model")
            name = args.model_name[0] if args.model_name else None
            specs = [asyncio.run(served.wait_for(args.redis_url, name, args.cache_dir))]
        else:
            specs = served.local(args)
        settings = settings_from_args(args, args.redis_url, specs[0].name, raise_nofile_limit())
        log.info("gateway %s on http://%s:%d", settings.gateway_id, settings.host, settings.port)
        if settings.admin_token is None:
            log.warning("no --admin-token: the admin API under /admin is disabled")
        uvloop.run(_run_gateway(settings, specs, signals, reuse_port=args.reuse_port, cache_dir=args.cache_dir))
    faulthandler.cancel_dump_traceback_later()


def gateway_argv(args: argparse.Namespace, redis_url: str, model: list[str] | None,
                 model_name: list[str] | None) -> list[str]:
    """The command of one more gateway process like this one, sharing its port: every
    gateway flag as given, each model (``--model``, ``--model-name``: again for each) as given
    (the admin token travels in the environment, not the command line; ``gateway_env``)."""
    cmd = [sys.executable, "-m", "gateway.cli", "--log-level", args.log_level, "gateway",
           "--redis-url", redis_url, "--reuse-port", "--workers", "1"]  # never TOKENGATE_WORKERS' group
    for flag, name, _help in GATEWAY_FLAGS:
        value = getattr(args, name)
        if value is not None and name != "admin_token":
            cmd += [f"--{flag}", str(value)]
    cmd += ["--slo-ttft-ms", str(args.slo_ttft_ms), "--slo-tpot-ms", str(args.slo_tpot_ms),
            "--aging-tokens", str(args.aging_tokens)]
    for flag, value in (("--cost-priors", args.cost_priors), ("--cache-dir", args.cache_dir)):
        if value is not None:
            cmd += [flag, str(value)]
    for flag, values in (("--model", model), ("--model-name", model_name),
                         ("--token-weight", [f"{m}={w!r}" for m, w in args.token_weight or ()])):
        for value in values or []:
            cmd += [flag, value]
    if getattr(args, "model_from_workers", False):  # (`serve` has no such flag: its gateways get --model)
        cmd.append("--model-from-workers")
    return cmd


def gateway_env(args: argparse.Namespace) -> dict[str, str]:
    return {"TOKENGATE_ADMIN_TOKEN": args.admin_token} if args.admin_token is not None else {}


def run_gateway_group(args: argparse.Namespace) -> None:
    """`tokengate gateway --workers N`: N gateway processes on one port (SO_REUSEPORT), one
    per core, supervised here: one that dies is started again; SIGINT/SIGTERM stops them
    all, each draining as a single gateway does. Each is a gateway of its own (its own id,
    reply stream and scheduler), sharing the workers' capacity like replicas on several
    hosts do."""
    from gateway.http.protocol import raise_nofile_limit

    # a bad flag or a port held by another program stops the group here, not N processes in a loop
    settings_from_args(args, args.redis_url, "checked", raise_nofile_limit())
    listen_socket(args.host, args.port).close()
    argv = gateway_argv(args, args.redis_url, args.model, args.model_name)
    supervisor = Supervisor([], gateways=[gateway_child(i, argv, gateway_env(args)) for i in range(args.workers)])
    signals = StopSignals().install()
    try:
        supervisor.start()
        log.info("%d gateway processes on http://%s:%d", args.workers, args.host, args.port)
        while True:  # no event loop: a stop signal raised inside one can leave it running
            supervisor.check()
            time.sleep(POLL_S)
    except Interrupted as exc:
        log.info("%s: stopping the gateway processes", exc)
    finally:
        signals.stopping()
        exit_within(FORCED_EXIT_S if signals.forced else args.shutdown_grace_s + CHILD_STOP_S + SHUTDOWN_SLACK_S)
        supervisor.stop(args.shutdown_grace_s + CHILD_STOP_S, hurry=lambda: signals.forced)
        faulthandler.cancel_dump_traceback_later()


def _pools(choice: str, upstream: bool = False) -> list[str]:
    """``auto``: cpu, plus gpu where CUDA is present; with an upstream server the workers run
    no model here, so auto is the cpu pool alone."""
    if choice != "auto":
        pools = [x.strip() for x in choice.split(",") if x.strip()]
        bad = [x for x in pools if x not in POOLS]
        if bad or not pools:
            raise ValueError(f"--pools: expected auto or a list of cpu/gpu, got {choice!r}")
        return pools
    if upstream:
        return ["cpu"]
    import torch

    return ["cpu", "gpu"] if torch.cuda.is_available() else ["cpu"]


def _worker_argv(pool: str, redis_url: str, args: argparse.Namespace, model_dir: Path, model_name: str,
                 log_level: str) -> list[str]:
    return [sys.executable, "-m", "workers", "--log-level", log_level, "--redis-url", redis_url, "--pool", pool,
            *worker_cli.worker_argv(args), "--model", str(model_dir), "--model-name", model_name]


async def _demo_key(redis_url: str, saved: str | None) -> str | None:
    """The demo tenant's key: None while ``saved`` still authenticates as the demo tenant, else
    a new one (the tenant is created on first use, with a generous budget)."""
    import redis.asyncio as aioredis

    from gateway.errors import NotFound
    from gateway.tenancy.tenant_store import TenantStore
    from gateway.tenancy.tenants import Tenant, new_id

    # bounded: it runs with stop signals deferred
    client = aioredis.Redis.from_url(redis_url, socket_timeout=10.0, socket_connect_timeout=10.0)
    try:
        store = TenantStore(client)
        if saved is not None:
            owner = await store.authenticate(saved)
            if owner is not None and owner.name == DEMO_TENANT:
                return None
            log.info("the saved demo key no longer authenticates (revoked, or another Redis): issuing a new one")
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


def _supervise_gateways(settings: GatewaySettings, supervisor: Supervisor,
                        ready: Callable[[dict[str, p.Heartbeat]], None]) -> None:
    """`serve --gateways N` (N > 1): this process serves no request; it keeps the gateway
    processes, the workers and Redis alive, and prints the banner once a gateway is ready,
    until a stop signal (``Interrupted``) or every worker exits before the first is ready."""
    import httpx

    host = "127.0.0.1" if settings.host in ("0.0.0.0", "::", "") else settings.host
    probe = f"http://{host}:{settings.port}/readyz"
    shown = False
    try:
        while True:  # no event loop: a stop signal raised inside one can leave it running
            supervisor.check()
            if not shown:
                if supervisor.workers_exited():
                    log.error("every worker exited before becoming ready; stopping")
                    return
                with contextlib.suppress(httpx.HTTPError):
                    shown = httpx.get(probe, timeout=1.0).status_code == 200
                if shown:
                    with processes.signals_deferred():
                        ready(uvloop.run(_live_workers(settings)))
            time.sleep(POLL_S)
    except Interrupted as exc:
        log.info("%s: stopping", exc)


async def _live_workers(settings: GatewaySettings) -> dict[str, p.Heartbeat]:
    from gateway.dispatch.liveness import Liveness
    from gateway.http.services import redis_client

    client = redis_client(settings)
    try:
        return await Liveness(client, settings).workers()
    finally:
        await client.aclose()


def serve(args: argparse.Namespace) -> None:
    from gateway.http.protocol import raise_nofile_limit

    signals = StopSignals().install()
    embedded: EmbeddedRedis | None = None
    supervisor: Supervisor | None = None
    try:
        with _stoppable(signals):
            specs = served.local(args)
            redis_url = args.redis_url
            data_dir = Path(args.data_dir or default_data_dir()).expanduser()
            if not redis_url:
                log.info("data directory: %s", data_dir)
                # not the port the gateway is about to listen on (free until it binds it)
                embedded = EmbeddedRedis(data_dir=data_dir, fsync=args.redis_fsync, avoid=(args.port,))
                embedded.start()  # locks the directory: one `serve` per data directory
                redis_url = embedded.url
                log.info("private redis-server (%s) at %s", embedded.binary, redis_url)
            else:
                log.info("data directory (the admin token and the demo key; Redis is yours): %s", data_dir)
            token_from = "from --admin-token"
            if args.admin_token is None:  # an explicit token wins; the kept one stays as it is
                args.admin_token = serve_state.admin_token(data_dir)
                token_from = f"kept in {data_dir / serve_state.ADMIN_TOKEN_FILE}"
            key_file = serve_state.demo_key_file(data_dir, None if embedded is not None else redis_url)
            settings = settings_from_args(args, redis_url, specs[0].name, raise_nofile_limit())
            pools = _pools(args.pools, upstream=bool(args.upstream_url))
            several = len(specs) > 1  # one worker per model and pool
            workers = [
                worker_child(pool, _worker_argv(pool, redis_url, args, spec.path, spec.name, args.log_level),
                             spec.name if several else "")
                for spec in specs for pool in pools
            ]
            # one gateway runs in this process; several are all children, so that a kill -9 of any
            # of them (the elected scheduler included) is a failover, not the supervisor's end
            own = args.gateways == 1
            argv = gateway_argv(args, redis_url, [str(s.path) for s in specs], [s.name for s in specs])
            gateways = [gateway_child(i, argv, gateway_env(args)) for i in range(0 if not own else 1, args.gateways)]
            supervisor = Supervisor(workers, embedded, gateways=gateways)
            supervisor.start()
            saved = serve_state.read_secret(key_file)
            with processes.signals_deferred():  # a stop signal raised inside the loop could leave it running
                issued = uvloop.run(_demo_key(redis_url, saved))
                if issued is not None:
                    serve_state.write_secret(key_file, issued)
            key = issued or saved
            assert key is not None

            def banner(workers: dict[str, p.Heartbeat]) -> None:
                print(banners.banner(settings, [s.name for s in specs], pools, key, key_file, token_from, workers),
                      flush=True)

            if own:
                uvloop.run(_run_gateway(settings, specs, signals, ready=banner, supervisor=supervisor,
                                        cache_dir=args.cache_dir))
            else:
                _supervise_gateways(settings, supervisor, banner)
    finally:
        stop_s = CHILD_STOP_S + (0.0 if args.gateways == 1 else args.shutdown_grace_s)  # children drain too
        exit_within(FORCED_EXIT_S if signals.forced else stop_s + SHUTDOWN_SLACK_S)
        if supervisor is not None:
            supervisor.stop(stop_s, hurry=lambda: signals.forced)
        elif embedded is not None:
            embedded.stop()
        faulthandler.cancel_dump_traceback_later()
