"""What a hop through Redis costs a request when one elected scheduler serves many gateways
(docs/scheduling.md §15, the design of issue 26).

    python -m bench.hops [--rates 200,1000,2000] [--seconds 5] [--json]

A follower gateway XADDs each admitted request to the scheduler's arrivals stream (through
``AutoPipeline``, as the gateway sends) and waits for its contract on its own reply stream.
The scheduler, in a process of its own as another gateway would be, reads the arrivals with
one blocking XREADGROUP and answers each with an XADD to the sender's stream (and XACKs
it), as the leader would after ``SchedulerShell.arrive``. Measured: the round trip a
follower's request waits for its contract, open loop at each rate, against the same decision
taken in process (the single-gateway path, no hop). A private redis-server; the payloads are
the size of a real encoded job of a 1 KB prompt.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import time
from multiprocessing.synchronize import Event as EventType
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from bench.harness import json_lines, pct, table
from common import wire
from gateway.cli.embedded_redis import EmbeddedRedis
from gateway.redis_batch import AutoPipeline

ARRIVALS, GROUP, REPLIES = "bench:{tg}:arrivals", "scheduler", "bench:{tg}:replies:follower"
PAYLOAD = b"x" * 1200  # an encoded job of ~250 prompt tokens, and its origin


async def leader(url: str, stop: EventType) -> None:
    client = aioredis.Redis.from_url(url)
    with contextlib.suppress(ResponseError):  # BUSYGROUP: a previous rate's run made it
        await client.xgroup_create(ARRIVALS, GROUP, id="0", mkstream=True)
    try:
        while not stop.is_set():
            reply: Any = await client.xreadgroup(GROUP, "leader", {ARRIVALS: ">"}, count=256, block=100)
            for _stream, entries in reply or []:
                pipe = client.pipeline(transaction=False)
                for _entry_id, fields in entries:
                    pipe.xadd(fields[b"reply_to"], {"rid": fields[b"rid"], "contract": b"c" * 200}, maxlen=10_000)
                pipe.xack(ARRIVALS, GROUP, *[entry_id for entry_id, _ in entries])
                await pipe.execute()
    finally:
        await client.aclose()


def leader_process(url: str, stop: EventType) -> None:
    """The scheduler in a process of its own, as it would run: another gateway."""
    asyncio.run(leader(url, stop))


async def follower(url: str, rate: float, seconds: float) -> list[float]:
    client, reader = aioredis.Redis.from_url(url), aioredis.Redis.from_url(url)
    sender = AutoPipeline(client)  # as the gateway sends: one write per loop turn
    waiting: dict[bytes, tuple[float, asyncio.Future[float]]] = {}
    done = asyncio.Event()

    async def read() -> None:
        last = b"$"
        while not done.is_set() or waiting:
            reply: Any = await reader.xread({REPLIES: last}, count=512, block=100)
            for _stream, entries in reply or []:
                for entry_id, fields in entries:
                    last = entry_id
                    found = waiting.pop(fields[b"rid"], None)
                    if found is not None:
                        found[1].set_result(time.perf_counter() - found[0])

    reading = asyncio.create_task(read())
    await asyncio.sleep(0.2)  # the reader is blocked on the stream before the first send
    t0 = time.perf_counter()

    async def one(i: int) -> float:
        await asyncio.sleep(max(0.0, i / rate - (time.perf_counter() - t0)))
        rid = str(i).encode()
        future: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        waiting[rid] = (time.perf_counter(), future)
        await sender.call("XADD", ARRIVALS, "*", "rid", rid, "reply_to", REPLIES, "job", PAYLOAD)
        return await future

    latencies = await asyncio.gather(*(one(i) for i in range(int(rate * seconds))))
    done.set()
    await reading
    await sender.close()
    await client.aclose()
    await reader.aclose()
    return list(latencies)


def in_process(n: int) -> list[float]:
    """The same decision without a hop: the single-gateway path's ``SchedulerShell.arrive``."""
    from common import protocol as p
    from gateway.dispatch.scheduling import Origin, SchedulerShell

    shell = SchedulerShell("gw", wire.replies_stream("m", "gw"))
    who = Origin(tenant="t", weight=1.0)
    out = []
    for i in range(n):
        seq = p.SeqJob(f"r{i}", tuple(range(250)), p.SamplingParams(16))
        started = time.perf_counter()
        shell.arrive(seq, who, now=time.monotonic())
        out.append(time.perf_counter() - started)
        if len(shell) > 1000:
            shell = SchedulerShell("gw", wire.replies_stream("m", "gw"))
    return out


async def run(rates: list[float], seconds: float) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    local = in_process(5000)
    rows.append({"path": "in process (one gateway)", "rate": None, "requests": len(local),
                 "p50_ms": pct(local, 50) * 1e3, "p99_ms": pct(local, 99) * 1e3})
    with EmbeddedRedis() as redis:
        for rate in rates:
            stop = multiprocessing.Event()
            serving = multiprocessing.Process(target=leader_process, args=(redis.url, stop))
            serving.start()
            latencies = await follower(redis.url, rate, seconds)
            stop.set()
            serving.join(timeout=10)
            async with aioredis.Redis.from_url(redis.url) as client:
                await client.delete(ARRIVALS, REPLIES)
            rows.append({"path": "follower -> leader -> follower (Redis)", "rate": rate, "requests": len(latencies),
                         "p50_ms": pct(latencies, 50) * 1e3, "p99_ms": pct(latencies, 99) * 1e3})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", default="200,1000,2000", help="requests/s a follower sends, one run each")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = asyncio.run(run([float(r) for r in args.rates.split(",") if r], args.seconds))
    if args.json:
        json_lines(rows)
        return
    table("a contract's round trip: in process, and through an elected scheduler over Redis (this machine)",
          ["path", "rate /s", "requests", "p50 ms", "p99 ms"],
          [[r["path"], "" if r["rate"] is None else f"{r['rate']:g}", r["requests"], r["p50_ms"], r["p99_ms"]]
           for r in rows])


if __name__ == "__main__":
    main()
