"""``bench.chaos``'s abuse of the HTTP side: abusive prompts, the wait bound under 4x
overload, oversized requests, slow connections (slowloris)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import time
from collections import Counter
from typing import Any

import orjson

from bench.chaos_stack import ECHO_TOKENS, MODEL, Load, Stack, findings, measure_capacity, print_phases, summary
from bench.harness import RawClient, pct, table
from gateway.http.protocol import raise_nofile_limit
from gateway.tenancy.limits import REFUSAL_BURST_BYTES, REFUSAL_BYTES_PER_S, REFUSAL_OVERHEAD_BYTES


async def prompts(args: argparse.Namespace) -> dict[str, Any]:
    """Target 6a: two clients (tenants of their own) sending 1 MB prompts; a third's p99
    within 2× its own baseline. Twice: abusers that hammer on through their 429s, and
    abusers that wait the ``Retry-After`` they are told (as the openai client does)."""
    with Stack(gateways=1, workers=1) as stack:
        load = Load(stack, args.rate, seed=7)
        t0 = time.monotonic()
        await load.run(15.0)
        base = summary(load.outcomes, t0, time.monotonic())
        huge = {"model": MODEL, "messages": [{"role": "user", "content": "word " * 200_000}], "max_tokens": 4}
        payload = orjson.dumps(huge)  # encoded once: the load generator's own cost stays out of the figures
        keys = [stack.new_tenant(f"abuser-{i}")[1] for i in range(2)]
        variants: dict[str, Any] = {}
        for name, honor in (("hammering", False), ("honoring Retry-After", True)):
            statuses: Counter[int | str] = Counter()
            stop = asyncio.Event()

            async def abuser(key: str, honor: bool = honor, statuses: Counter[int | str] = statuses,
                             stop: asyncio.Event = stop) -> None:
                client = RawClient("127.0.0.1", stack.ports[0], {"authorization": f"Bearer {key}"})
                while not stop.is_set():  # closed loop: the next one as soon as the last is answered
                    try:
                        status, _ = await client.post("/v1/chat/completions", payload)
                        statuses[status] += 1
                        if honor and status == 429:
                            with contextlib.suppress(TimeoutError):
                                await asyncio.wait_for(stop.wait(), 1.0)
                    except (OSError, asyncio.IncompleteReadError):
                        statuses["reset"] += 1
                await client.close()

            abusers = [asyncio.create_task(abuser(key)) for key in keys]
            third = Load(stack, args.rate, seed=8)
            t1 = time.monotonic()
            await third.run(15.0)
            stop.set()
            await asyncio.gather(*abusers)
            under = summary(third.outcomes, t1, time.monotonic())
            await third.close()
            variants[name] = {**under, "p99_ratio": under["p99_ms"] / base["p99_ms"], "abusers": dict(statuses),
                              "findings": dict(findings(third.outcomes))}
            await asyncio.sleep(2)  # the holds run out
        await load.close()
        print_phases("1 MB prompts from two clients", {"alone": base, **variants})
        result = {"alone": base, "variants": variants, "findings": dict(findings(load.outcomes))}
        result["met"] = all(v["p99_ratio"] <= 2.0 and not v["findings"] for v in variants.values())
        return result


def _trickle(port: int, connections: int, seconds: float, report: Any) -> None:
    """In a process of its own (so its work does not delay the measured client): hold
    ``connections`` that send a header line every 2 s and never finish their request."""

    async def main() -> None:
        stop = asyncio.Event()
        opened, refused, closed_by_server = 0, 0, 0

        async def one() -> None:
            nonlocal opened, refused, closed_by_server
            try:
                _reader, writer = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                refused += 1
                return
            opened += 1
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")
            try:
                await asyncio.sleep(random.uniform(0, 2.0))  # attackers are not in step with each other
                while not stop.is_set():
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), 2.0)
                    writer.write(b"x-a: b\r\n")
                    await writer.drain()
            except OSError:
                closed_by_server += 1
            writer.close()

        tasks = [asyncio.create_task(one()) for _ in range(connections)]
        await asyncio.sleep(seconds)
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        report.put({"opened": opened, "refused": refused, "closed_by_server": closed_by_server})

    raise_nofile_limit()
    asyncio.run(main())


async def wait_bound(args: argparse.Namespace) -> dict[str, Any]:
    """Issue 23: 4× the worker's capacity (an echo worker of ``--slots`` slots and ``--step-ms``
    steps: the queue forms in the scheduler, where the gateway can see it) from clients without
    an SLO (half streaming), after a calm warm-up
    that calibrates the first-token predictions: every request answered within the default
    wait bound (``--max-queue-wait-ms``, 5 s) plus 1 s, or refused within 50 ms; none left for
    its client's time-out."""
    bound_s = 5.0
    with Stack(gateways=1, workers=1, step_ms=args.step_ms, slots=args.slots) as stack:
        capacity = await measure_capacity(stack)
        calm = Load(stack, 0.3 * capacity, seed=11)
        await calm.run(8.0)
        base = summary(calm.outcomes, 0, time.monotonic())
        spike = Load(stack, 4 * capacity, seed=12, max_outstanding=4000)
        t0 = time.monotonic()
        await spike.run(args.spike_s)
        took = time.monotonic() - t0
        answered = [o for o in spike.outcomes if o.kind != "unsent"]
        ok = [o.t1 - o.t0 for o in answered if o.kind == "ok"]
        refused = [o.t1 - o.t0 for o in answered if o.kind == "refused"]
        late = sum(1 for x in ok if x > bound_s + 1.0)
        slow = sum(1 for x in refused if x > 0.05)
        for lg in (calm, spike):
            await lg.close()
        spiked = summary(spike.outcomes, 0, time.monotonic())
        print_phases("4× capacity without an SLO", {"calm": base, "spike": spiked})
        table("the spike, per request", ["offered/s", "sent", "ok", "ok p50 ms", "ok p99 ms", "ok max ms",
                                         f"ok > {bound_s + 1:g} s", "refused", "refused p50 ms", "refused p99 ms",
                                         "refused max ms", "refused > 50 ms", "findings", "unsent"],
              [[4 * capacity, len(answered), len(ok), pct(ok, 50) * 1e3, pct(ok, 99) * 1e3,
                max(ok, default=0) * 1e3, late, len(refused), pct(refused, 50) * 1e3, pct(refused, 99) * 1e3,
                max(refused, default=0) * 1e3, slow, sum(1 for o in answered if o.kind == "finding"),
                sum(1 for o in spike.outcomes if o.kind == "unsent")]])
        result: dict[str, Any] = {
            "capacity_rps": capacity, "offered_rps": 4 * capacity, "spike_s": took, "sent": len(answered),
            "ok": len(ok), "ok_late": late, "refused": len(refused), "refused_slow": slow,
            "refusals": dict(Counter(o.detail for o in answered if o.kind == "refused")),
            "ok_p99_ms": pct(ok, 99) * 1e3, "refused_p99_ms": pct(refused, 99) * 1e3,
            "findings": dict(findings(spike.outcomes)), "exited": stack.exited(),
        }
        result["met"] = not late and not slow and not result["findings"] and not result["exited"]
        return result


async def _oversized(port: int, key: str, size: int, declared: int | None = None) -> int | str:
    """One request of ``size`` body bytes (declaring ``declared``, by default its size) on a
    connection of its own, sent the way a careful client does: the body stops once an answer
    has arrived. Its status, or what broke."""
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {declared or size}\r\n\r\n").encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head)
        answer = asyncio.ensure_future(reader.readline())
        chunk, sent = b" " * 65536, 0
        with contextlib.suppress(OSError):
            while sent < size and not answer.done():
                writer.write(chunk[: size - sent])
                sent += min(len(chunk), size - sent)
                await writer.drain()
        line = await asyncio.wait_for(answer, 10)
        return int(line.split()[1]) if line else "closed"
    except (OSError, TimeoutError, IndexError, ValueError) as exc:
        return type(exc).__name__
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def oversize(args: argparse.Namespace) -> dict[str, Any]:
    """Issue 23: one header-only request declaring 10^12 bytes, one 20 MB request and ten in a
    row cost the tenant nothing more (its next small request is a 200); a tenant sending 20 MB
    bodies back to back for ``--duration`` s is held to the refill rate, while a second tenant's
    p99 stays within 1.5× its p99 alone."""
    big = 20_000_000
    with Stack(gateways=1, workers=1) as stack:
        port = stack.ports[0]
        _, mistaken = stack.new_tenant("mistaken")
        sequence = [await _oversized(port, mistaken, 0, declared=10**12), await _oversized(port, mistaken, big)]
        sequence += [await _oversized(port, mistaken, big) for _ in range(10)]
        small = RawClient("127.0.0.1", port, {"authorization": f"Bearer {mistaken}"})
        body = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Say hello."}],
                             "max_tokens": ECHO_TOKENS})
        after, _ = await small.post("/v1/chat/completions", body)
        await small.close()
        alone = Load(stack, args.rate, seed=21)
        t0 = time.monotonic()
        await alone.run(15.0)
        base = summary(alone.outcomes, t0, time.monotonic())
        _, abuser = stack.new_tenant("flood")
        statuses: Counter[int | str] = Counter()
        stop = asyncio.Event()

        async def flood() -> None:
            while not stop.is_set():
                statuses[await _oversized(port, abuser, big)] += 1

        flooding = asyncio.create_task(flood())
        during = Load(stack, args.rate, seed=22)
        t1 = time.monotonic()
        await during.run(args.duration)
        stop.set()
        await flooding
        flood_s = time.monotonic() - t1
        under = summary(during.outcomes, t1, time.monotonic())
        for lg in (alone, during):
            await lg.close()
        print_phases("a second tenant, alone and beside a 20 MB flood", {"alone": base, "beside the flood": under})
        refused = statuses.get(413, 0)
        allowed = (REFUSAL_BURST_BYTES + REFUSAL_BYTES_PER_S * flood_s) / REFUSAL_OVERHEAD_BYTES
        table("the flood (20 MB bodies, back to back)",
              ["seconds", "sent", "413", "429 held", "other", "413 per s", "413 the bucket allows"],
              [[flood_s, sum(statuses.values()), refused, statuses.get(429, 0),
                sum(v for k, v in statuses.items() if k not in (413, 429)), refused / flood_s, allowed]])
        result: dict[str, Any] = {
            "sequence": sequence, "after": after, "alone": base, "beside": under,
            "p99_ratio": under["p99_ms"] / base["p99_ms"], "flood": {str(k): v for k, v in statuses.items()},
            "flood_s": flood_s, "refused_413": refused, "allowed_413": allowed,
            "findings": dict(findings(alone.outcomes + during.outcomes)),
        }
        result["met"] = (after == 200 and all(s == 413 for s in sequence) and result["p99_ratio"] <= 1.5
                         and refused <= allowed * 1.05 and not result["findings"])
        return result


async def slowloris(args: argparse.Namespace) -> dict[str, Any]:
    """Target 6b: thousands of connections that trickle their headers; others unaffected."""
    import multiprocessing

    with Stack(gateways=1, workers=1) as stack:
        load = Load(stack, args.rate, seed=9)
        t0 = time.monotonic()
        await load.run(10.0)
        base = summary(load.outcomes, t0, time.monotonic())
        ctx = multiprocessing.get_context("fork")
        report = ctx.Queue()
        slow = ctx.Process(target=_trickle, args=(stack.ports[0], args.connections, 20.0, report))
        slow.start()
        await asyncio.sleep(3)  # all of them open
        load2 = Load(stack, args.rate, seed=10)
        t1 = time.monotonic()
        await load2.run(15.0)
        under = summary(load2.outcomes, t1, time.monotonic())
        counts = await asyncio.to_thread(report.get, True, 60)
        await asyncio.to_thread(slow.join, 30)
        for lg in (load, load2):
            await lg.close()
        print_phases(f"{args.connections} slow connections", {"alone": base, "with slow connections": under})
        ratio = under["p99_ms"] / base["p99_ms"]
        result = {"alone": base, "with_slow": under, "p99_ratio": ratio, **counts,
                  "findings": dict(findings(load.outcomes + load2.outcomes)), "exited": stack.exited()}
        result["met"] = ratio <= 2.0 and not result["findings"] and not result["exited"]
        return result
