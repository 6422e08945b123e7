"""The deployment tunes its own policy table (issue 41; docs/scheduling.md §16.2).

The scheduling gateway of a model that runs the packaged SMDP table (``--policy smdp``, the
default) re-solves the table every ``--tune-every`` seconds, or at once when an operator asks
(``POST /admin/scheduler/tune``), on the traffic its schedulers recorded (``traffic_log``, the
last ``tune.WINDOW`` requests) and the profiles its workers measured: ``tokengate policy tune``
in a child process, off the request path and off the serving CPUs' time, at the lowest CPU
priority the system has (``SCHED_IDLE``: it runs only on CPU time nothing else wants), one
simulation at a time, within a hard CPU-time limit. The child tunes on the earlier part of the
window and tests the candidate against the table in force on the later part; only a candidate
that wins there by the margin is swapped in. The swap is then judged on live outcomes
(``sched_core.rollback.SwapWatch``): a drop in SLO attainment or contract accuracy puts the
table before it back.

The table in force and each change (when, which, why, the figures) are kept in Redis
(``wire.policy_key``, ``wire.policy_changes_stream``, ``wire.policy_status_key``): a scheduler
that takes over after a failover or a restart starts from the table in force, and every
gateway shows them (``/admin/scheduler``, the console). ``--policy smdp:FILE`` (a fixed
table) and the other policies are never tuned automatically.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import resource
import signal
import sys
import tempfile
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, Protocol

import orjson
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from common import protocol as p
from common import stepmodel, wire
from common.pools import POOLS
from gateway.dispatch import traffic_log
from gateway.dispatch.scheduling import SchedulerShell
from gateway.settings import GatewaySettings
from sched_core import costmodel
from sched_core.contracts import Accuracy
from sched_core.policies import DEFAULT_POLICY
from sched_core.rollback import SwapWatch
from sched_core.simulate import tune as tn
from sched_core.simulate.metrics import Slo
from sched_core.smdp import PolicyTable

log = logging.getLogger("tokengate.tuning")

LIVE_ENTRIES = 2000  # telemetry entries a re-solve reads (each up to TELEMETRY_MAX_STEPS step records)
LIVE_STEPS = 5000  # and the step records per pool it refits the profile's formulas on (the latest)
POLL_S = 2.0  # how often the scheduling gateway looks whether a re-solve is due or asked for
CPU_LIMIT_S = 900  # CPU seconds one re-solve may use; the kernel stops it past this
WALL_LIMIT_S = 6 * 3600.0  # and wall seconds (at --tune-cpu 0.1, 900 CPU seconds take 2.5 h)
DUTY_PERIOD_S = 0.5  # the child runs --tune-cpu of every such period and is stopped the rest
ASK_TTL_S = 3600  # an operator's ask stays this long for a scheduler to take it up


class Leads(Protocol):
    def lead(self) -> bool: ...


class Host(Protocol):
    """What the self-tuning asks of the gateway's dispatcher."""

    settings: GatewaySettings
    client: aioredis.Redis
    shell: SchedulerShell
    workers: dict[str, p.Heartbeat]
    closing: bool

    @property
    def leading(self) -> Leads: ...

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None: ...


def _idle() -> None:
    """In the child, before it runs: the lowest CPU priority, and the CPU-time limit."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):  # not Linux: the lowest nice value instead
        os.nice(19)
    resource.setrlimit(resource.RLIMIT_CPU, (CPU_LIMIT_S, CPU_LIMIT_S))


async def _duty_cycle(pid: int, share: float) -> None:
    """Let the child ``pid`` run ``share`` of every ``DUTY_PERIOD_S`` and stop it the rest
    (SIGSTOP/SIGCONT): idle priority alone still let a re-solve's bursts evict the model's
    caches between its steps (docs/benchmarks.md, "The table that tunes itself")."""
    if share >= 1.0:
        return
    try:
        while True:
            await asyncio.sleep(DUTY_PERIOD_S * share)
            os.kill(pid, signal.SIGSTOP)
            await asyncio.sleep(DUTY_PERIOD_S * (1.0 - share))
            os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        return
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)  # never left stopped: a kill or its exit must go through


def deployment_args(workers: dict[str, p.Heartbeat], model: str, out: Path,
                    steps: dict[str, list[tuple[int, int, int, float]]] | None = None) -> list[str]:
    """``tokengate policy tune``'s deployment flags for the live workers of ``model``: each
    pool's workers and slots, and the profiles they measured (written to ``out``), each with
    its formulas refit on the pool's live ``steps`` where there are enough
    (``costmodel.fit_steps``). A profile is timed on an idle machine; serving, the workers
    share it with the gateway and Redis (``bench.policies_live``: live steps 0.72-1.22× the
    start profile's per kind of step), and a table is only as good as the speeds it was solved with."""
    live = [hb for hb in workers.values() if hb.model == model and not hb.down]
    args: list[str] = []
    for pool in POOLS:
        mine = [hb for hb in live if hb.pool == pool]
        args += [f"--{pool}-workers", str(len(mine))]
        if mine:
            args += [f"--{pool}-slots", str(max(hb.slots for hb in mine))]
    measured = p.by_pool([hb.profile for hb in live if hb.profile])
    for pool, records in (steps or {}).items():
        fitted = costmodel.fit_steps(records) if pool in measured else None
        if fitted is not None:
            measured[pool] = stepmodel.serving(measured[pool], fitted, len(records))
    if measured:
        out.write_bytes(orjson.dumps(measured))
        args += ["--fleet", str(out)]
    return args


def live_steps(entries: list[tuple[bytes, dict[bytes, bytes]]]) -> dict[str, list[tuple[int, int, int, float]]]:
    """Per pool, the last ``LIVE_STEPS`` step records of the telemetry ``entries`` (newest
    first, as XREVRANGE gives them), oldest first, as ``costmodel.fit_steps`` reads them; an
    entry this version cannot read is skipped."""
    steps: dict[str, list[tuple[int, int, int, float]]] = {}
    for _id, fields in reversed(entries):
        with contextlib.suppress(ValueError, KeyError, TypeError):
            t = p.decode_telemetry(fields)
            steps.setdefault(t.pool, []).extend(
                (s.prefill_tokens, s.decode_seqs, s.kv_tokens, s.ms / 1000) for s in t.steps)
    return {pool: records[-LIVE_STEPS:] for pool, records in steps.items()}


class Tuning:
    """The self-tuning of one model's scheduler, while this gateway schedules it."""

    def __init__(self, d: Host) -> None:
        self.d = d
        s = d.settings
        self.model = s.model_name
        self.enabled = s.policy == DEFAULT_POLICY  # a fixed table (smdp:FILE), the heuristic, a baseline: never
        self.automatic = self.enabled and s.tune_every_s > 0  # else only when an operator asks
        self.every_s = s.tune_every_s
        self.budget = tn.BUDGET  # simulations per re-solve
        self.watch = SwapWatch()
        self.previous: PolicyTable | None = None  # the table before the swap being watched
        self._last_solve = time.monotonic()  # the first re-solve is one interval after the start

    @property
    def tunable(self) -> bool:
        """The policy is the self-tuned SMDP table (``--policy smdp``)."""
        pricing = self.d.shell.driver.pricing
        return self.enabled and pricing is not None and pricing.config.policy_table is not None

    async def _telemetry(self) -> list[tuple[bytes, dict[bytes, bytes]]]:
        """The model's last ``LIVE_ENTRIES`` telemetry entries, newest first."""
        entries: list[tuple[bytes, dict[bytes, bytes]]] = await self.d.client.xrevrange(  # type: ignore[assignment]
            wire.telemetry_stream(self.model), count=LIVE_ENTRIES)
        return entries

    def _fleet(self, out: Path, entries: list[tuple[bytes, dict[bytes, bytes]]]) -> list[str]:
        """``deployment_args`` on the live steps of ``entries`` (in a thread: decoding and a
        few lstsq on thousands of records stay off the event loop)."""
        return deployment_args(dict(self.d.workers), self.model, out, live_steps(entries))

    def in_force(self) -> PolicyTable | None:
        pricing = self.d.shell.driver.pricing
        return pricing.config.policy_table if pricing is not None else None

    # -- the loop (the scheduling gateway's) ----------------------------------------------

    async def loop(self) -> None:
        while not self.d.closing:
            await asyncio.sleep(POLL_S)
            if not self.d.leading.lead() or not self.tunable:
                continue
            try:
                asked = await self.d.client.getdel(wire.tune_asked_key(self.model))
                due = self.automatic and time.monotonic() - self._last_solve >= self.every_s
                if asked is not None or due:
                    await self.solve("asked by an operator" if asked is not None else "due")
            except RedisError as exc:
                log.warning("self-tuning of %s: Redis failed: %s", self.model, exc)

    async def solve(self, reason: str) -> dict[str, Any]:
        """One re-solve: the verdict (also kept in ``wire.policy_status_key``), and the swap
        where the candidate won."""
        self._last_solve = time.monotonic()
        running = self.in_force()
        assert running is not None, "tunable first"
        started = time.time()
        await self._status({"solving_since": started, "reason": reason})
        try:
            verdict = await self._run(running, reason)
        except (OSError, ValueError, KeyError, IndexError) as exc:  # a failed re-solve costs a verdict, not serving
            log.warning("self-tuning of %s failed: %r", self.model, exc)
            verdict = {"swap": False, "why": f"the re-solve failed: {exc!r}"}
        verdict |= {"at": time.time(), "seconds": time.time() - started, "reason": reason}
        candidate = verdict.pop("table", None)
        if verdict.get("swap") and candidate is not None:
            if self.d.leading.lead() and self.in_force() is running:
                await self.put(candidate, "swap", verdict["why"], verdict)
            else:
                verdict |= {"swap": False, "why": "not swapped: the table in force or the scheduler changed meanwhile"}
        await self._status({"last": verdict})
        return verdict

    async def _run(self, running: PolicyTable, reason: str) -> dict[str, Any]:
        """``tokengate policy tune`` in a child process at idle priority: its verdict and the
        candidate (``table``), or why there is none."""
        text = await traffic_log.read_csv(self.d.client, self.model, last=tn.WINDOW)
        requests = max(text.count("\n") - 1, 0)
        if requests < tn.MIN_REQUESTS:
            return {"swap": False, "why": f"{requests} requests recorded: a re-solve needs at least {tn.MIN_REQUESTS}"}
        cfg = self.d.shell.driver.pricing.config if self.d.shell.driver.pricing is not None else None
        with tempfile.TemporaryDirectory(prefix="tokengate-tune-") as tmp:
            folder = Path(tmp)
            (folder / "traffic.csv").write_text(text)
            running.dump(folder / "running.json")
            name = f"tuned-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}"
            cmd = [sys.executable, "-m", "gateway.cli", "policy", "tune", "--trace", str(folder / "traffic.csv"),
                   "--table", str(folder / "running.json"), "--out", str(folder / "candidate.json"),
                   "--name", name, "--json", "--jobs", "1", "--budget", str(self.budget), "--max-queue-wait-ms",
                   str(self.d.settings.max_queue_wait_ms),
                   *await asyncio.to_thread(self._fleet, folder / "fleet.json", await self._telemetry())]
            if cfg is not None:
                cmd += ["--slo-ms", str(cfg.ttft_p99_slo_s * 1000.0), "--slo-tpot-ms", str(cfg.tpot_slo_s * 1000.0)]
            log.info("self-tuning of %s: re-solving on %d recorded requests (%s)", self.model, requests, reason)
            proc = await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.PIPE,
                                                        stderr=asyncio.subprocess.PIPE, preexec_fn=_idle)
            duty = asyncio.create_task(_duty_cycle(proc.pid, self.d.settings.tune_cpu))
            try:
                out, err = await asyncio.wait_for(proc.communicate(), WALL_LIMIT_S)
            except (TimeoutError, asyncio.CancelledError):
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
                raise
            finally:
                duty.cancel()
            if proc.returncode != 0:
                tail = err.decode(errors="replace").strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
                log.warning("self-tuning of %s failed: %s", self.model, tail[0])
                return {"swap": False, "why": f"the re-solve failed: {tail[0]}"}
            doc = json.loads(out.decode().splitlines()[-1])
            verdict: dict[str, Any] = doc["verdict"]
            verdict["requests"] = doc["requests"]
            verdict["table"] = PolicyTable.load(folder / "candidate.json")
        return verdict

    # -- the table in force ---------------------------------------------------------------

    async def put(self, table: PolicyTable, kind: str, why: str, figures: dict[str, Any] | None = None) -> None:
        """``table`` in force now (``kind``: swap or rollback), kept and told in Redis."""
        before = self.in_force()
        pricing = self.d.shell.driver.pricing
        assert pricing is not None, "tunable first"
        pricing.set_table(table)
        if kind == "swap":
            self.previous = before
            self.watch.swapped()
        else:
            self.previous = None
            self.watch.cancel()
        now = time.time()
        log.warning("self-tuning of %s: %s %s -> %s: %s", self.model, kind, before.name if before else "-",
                    table.name, why)
        change = {"at": now, "kind": kind, "from": before.name if before else None, "to": table.name, "why": why,
                  "figures": figures or {}}
        pipe = self.d.client.pipeline(transaction=False)
        pipe.set(wire.policy_key(self.model), orjson.dumps({"table": table.to_json(), "since": now, "kind": kind,
                                                           "why": why}))
        pipe.xadd(wire.policy_changes_stream(self.model), {"c": orjson.dumps(change)},
                  maxlen=wire.POLICY_CHANGES_MAXLEN, approximate=True)
        await pipe.execute()
        await self._status({})  # the watch's state

    async def restore(self) -> None:
        """A scheduler taking over starts from the table in force (a re-solved one), where its
        policy is the self-tuned one."""
        self.watch.cancel()  # a swap another scheduler made is not judged here
        self.previous = None
        if not self.tunable:
            return
        await self._status({"solving_since": None})  # a re-solve of a scheduler that died with it
        raw = await self.d.client.get(wire.policy_key(self.model))
        if raw is None:
            return
        try:
            table = PolicyTable.from_json(orjson.loads(raw)["table"], "the table in force")
        except (ValueError, KeyError, TypeError, orjson.JSONDecodeError) as exc:
            log.warning("self-tuning of %s: the table in force is unreadable (%s); the packaged one runs",
                        self.model, exc)
            return
        pricing = self.d.shell.driver.pricing
        assert pricing is not None
        pricing.set_table(table)
        log.info("self-tuning of %s: the table in force is %s", self.model, table.name)

    # -- the watch ------------------------------------------------------------------------

    def outcome(self, ttft_s: float | None, total_s: float | None, tokens: int, accuracy: Accuracy | None) -> None:
        """A promised request ended here (the scheduler's side): the watch of the last swap
        learns whether it met the SLO and ended inside its bounds; a swap judged a loss is
        rolled back."""
        pricing = self.d.shell.driver.pricing
        if accuracy is None or ttft_s is None or total_s is None or pricing is None:
            return
        cfg = pricing.config
        met = Slo(cfg.ttft_p99_slo_s, cfg.tpot_slo_s).meets(ttft_s, total_s, tokens)
        inside = accuracy.total_inside and accuracy.ttft_inside is not False
        judged = self.watch.observe(met, inside)
        if judged is None:
            return
        figures = {"before": judged.before.to_json(), "after": judged.after.to_json()}
        if judged.rollback and self.previous is not None:
            self.d.spawn(self._quietly(self.put(self.previous, "rollback", judged.why, figures)))
        else:
            self.d.spawn(self._quietly(self._status({"judged": {"at": time.time(), "why": judged.why, **figures}})))

    async def _quietly(self, call: Coroutine[Any, Any, None]) -> None:
        try:
            await call
        except RedisError as exc:
            log.warning("self-tuning of %s: Redis failed: %s", self.model, exc)

    async def _status(self, update: dict[str, Any]) -> None:
        """Merge ``update`` into the status every gateway reads (``read``)."""
        key = wire.policy_status_key(self.model)
        raw = await self.d.client.get(key)
        doc = orjson.loads(raw) if raw else {}
        if "last" in update:
            doc.pop("solving_since", None)
        doc |= update
        for key in [k for k, v in doc.items() if v is None]:  # None: no longer so
            del doc[key]
        doc["watch"] = self.watch.state()
        await self.d.client.set(key, orjson.dumps(doc))


async def ask(client: Any, model: str) -> None:
    """An operator's ask: ``model``'s scheduling gateway re-solves at its next turn."""
    await client.set(wire.tune_asked_key(model), 1, ex=ASK_TTL_S)


async def read(client: Any, model: str, changes: int = 10) -> dict[str, Any]:
    """What any gateway shows of ``model``'s self-tuning: the table in force (when and why it
    came in; none: the packaged one), the status, and the last ``changes`` changes, newest first."""
    in_force, status = await client.mget(wire.policy_key(model), wire.policy_status_key(model))
    entries = await client.xrevrange(wire.policy_changes_stream(model), count=changes)
    doc: dict[str, Any] = {"in_force": None, "status": orjson.loads(status) if status else {}, "changes": []}
    if in_force:
        held = orjson.loads(in_force)
        doc["in_force"] = {"name": held["table"].get("name"), "since": held["since"], "kind": held["kind"],
                           "why": held["why"]}
    for _id, fields in entries or ():
        with contextlib.suppress(KeyError, orjson.JSONDecodeError):
            doc["changes"].append(orjson.loads(fields[b"c"]))
    return doc
