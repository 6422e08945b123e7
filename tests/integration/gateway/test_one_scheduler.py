"""Two gateways on one Redis and one worker: one schedules for both (docs/scheduling.md §15).

The first gateway to start holds the lease; the second forwards its admissions, gets its
contracts back, and its clients' results come from the worker directly. When the scheduler
goes without a word (its loops stop, as at a kill), the other takes the lease within about a
second and what was queued there is not lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest

from common import wire
from gateway.dispatch import election
from gateway.dispatch.prompts import PromptBuilder
from gateway.http import console
from gateway.http.app import create_app
from gateway.http.services import Gateway, redis_client
from gateway.settings import GatewaySettings
from tests.integration.gateway.conftest import ADMIN, Harness, make_harness
from tests.integration.helpers import running_worker
from workers.engine import EchoEngine
from workers.model_store import ModelSpec

pytestmark = pytest.mark.anyio


@contextlib.asynccontextmanager
async def follower(redis_url: str, prompts: PromptBuilder, model: str) -> AsyncIterator[Harness]:
    """A second gateway on the same Redis, without a worker of its own."""
    config = GatewaySettings(redis_url=redis_url, model_name=model, admin_token=ADMIN, request_timeout_s=10)
    client = redis_client(config)
    gw = Gateway(config, prompts, client)
    await gw.domain().dispatcher.start()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(gw)), base_url="http://follower") as http:
        yield Harness(gw, http, model)
    await gw.drain()
    await gw.domain().dispatcher.close()
    await client.aclose()


async def _until(check: Callable[[], bool], what: str, timeout_s: float = 5.0) -> float:
    started = time.monotonic()
    while not check():
        assert time.monotonic() - started < timeout_s, what
        await asyncio.sleep(0.02)
    return time.monotonic() - started


def _id(entry_id: bytes) -> tuple[int, int]:
    ms, _, seq = entry_id.partition(b"-")
    return int(ms), int(seq)


async def _outcomes(lead: Harness, component: str) -> float:
    """Requests the scheduler's /metrics counts as finished under a contract."""
    text = (await lead.http.get("/metrics")).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("tokengate_contract_outcomes_total{") and f'component="{component}"' in line)


async def _none_pending(lead: Harness, timeout_s: float = 5.0) -> None:
    """Nothing left pending in the arrivals group (notes are acknowledged just after they are read)."""
    deadline = time.monotonic() + timeout_s
    arrivals = lead.gw.domain().dispatcher.leading.arrivals
    while (await lead.gw.domain().dispatcher.client.xpending(arrivals, wire.ARRIVALS_GROUP))["pending"]:
        assert time.monotonic() < deadline, "arrivals still pending"
        await asyncio.sleep(0.02)


async def test_a_follower_gets_its_contract_from_the_scheduler_and_its_result_from_the_worker(
    redis_url: str, prompts: PromptBuilder, model_spec: ModelSpec
) -> None:
    async with make_harness(redis_url, prompts, model_spec.name) as lead, \
            follower(redis_url, prompts, model_spec.name) as other:
        assert lead.gw.domain().dispatcher.leading.leader and not other.gw.domain().dispatcher.leading.leader
        assert (await other.admin("GET", "/scheduler")).json()["role"] == "follower"
        _, key = await lead.tenant("acme", rate=10**6, burst=10**8)
        responses = await asyncio.gather(*(other.complete(key) for _ in range(12)), lead.complete(key))
        for r in responses:
            assert r.status_code == 200, r.text
            assert float(r.headers["x-tokengate-p99-ms"]) > 0  # a contract, made by the scheduler
        assert {r.json()["choices"][0]["text"] for r in responses[:12]} == {responses[0].json()["choices"][0]["text"]}
        # the scheduler saw every request (one view) and has every slot back
        driver = lead.gw.domain().dispatcher.shell.driver
        await _until(lambda: driver.running("cpu") == 0 and not driver.open_batches(), "slots came back")
        # every forwarded admission was dispatched and acknowledged once, and the followers'
        # notes (their requests' ends, read after the answers went out) are acknowledged too
        await _none_pending(lead)
        # the scheduler's calibration and contract accuracy count every request, wherever it
        # was answered (the followers' notes of each request's end come after the answer)
        deadline = time.monotonic() + 5.0
        while (counted := await _outcomes(lead, "total")) < 13:
            assert time.monotonic() < deadline, f"{counted} outcomes counted by the scheduler"
            await asyncio.sleep(0.05)
        assert counted == 13
        client = lead.gw.domain().dispatcher.client
        assert await client.xlen(lead.gw.domain().dispatcher.leading.arrivals) >= 12  # the admissions at least
        group = (await client.xinfo_groups(lead.gw.domain().dispatcher.leading.arrivals))[0]
        await lead.gw.domain().dispatcher.leading.trim_arrivals()  # what was settled leaves the stream
        left = [entry_id for entry_id, _ in await client.xrange(lead.gw.domain().dispatcher.leading.arrivals)]
        assert all(_id(e) >= _id(group["last-delivered-id"]) for e in left), (left, group)


async def test_a_refusal_made_by_the_scheduler_reaches_the_follower_s_client(
    redis_url: str, prompts: PromptBuilder, model_spec: ModelSpec
) -> None:
    async with make_harness(redis_url, prompts, model_spec.name) as lead, \
            follower(redis_url, prompts, model_spec.name) as other:
        _, key = await lead.tenant("acme", rate=10**6, burst=10**8)
        doc = {"model": other.model, "prompt": [1, 2, 3], "max_tokens": 4}
        headers = {"authorization": f"Bearer {key}", "x-slo-ttft-ms": "0.01"}  # no worker is that fast
        r = await other.http.post("/v1/completions", json=doc, headers=headers)
        assert r.status_code == 503 and r.json()["error"]["code"] == "slo_unattainable", r.text
        assert int(r.headers["retry-after"]) >= 1
        await _none_pending(lead)


async def test_when_the_scheduler_goes_silent_the_follower_takes_over_and_loses_nothing_queued(
    redis_url: str, prompts: PromptBuilder, model_spec: ModelSpec
) -> None:
    """The scheduler stops without releasing its lease (its loops die, as at kill -9) while
    forwarded requests wait in its queue: the follower takes the lease once it lapses, takes
    up the pending arrivals, and every request is answered, once."""
    engine = EchoEngine(tokens=8, step_s=0.05)  # slow enough that a queue builds
    async with make_harness(redis_url, prompts, model_spec.name, engine=engine) as lead, \
            follower(redis_url, prompts, model_spec.name) as other:
        assert lead.gw.domain().dispatcher.leading.leader and not other.gw.domain().dispatcher.leading.leader
        _, key = await lead.tenant("acme", rate=10**6, burst=10**8)
        calls = [asyncio.create_task(other.complete(key)) for _ in range(40)]
        await _until(lambda: lead.gw.domain().dispatcher.shell.driver.queued > 0, "a queue at the scheduler")
        # the scheduler dies: no release, no more dispatches. Its loops also stop at their next
        # turn (``closing``, as ``close`` does): a cancel that lands as a Redis call's own time-out
        # fires reads as that time-out, which a loop retries; its election loop would then renew
        # the lease it still holds and take over again, and the follower would never get it
        lead.gw.domain().dispatcher.closing = True
        for task in lead.gw.domain().dispatcher._tasks:
            task.cancel()
        lead.gw.domain().dispatcher.leading.leader = False
        try:
            took = await _until(lambda: other.gw.domain().dispatcher.leading.leader, "the follower took over",
                                timeout_s=3.0)
        except AssertionError:  # say who holds the lease, and whether a loop of the follower stopped
            holder = await other.gw.client.get(wire.scheduler_lease(other.gw.settings.model_name))
            lead_alive = [t.get_name() for t in lead.gw.domain().dispatcher._tasks if not t.done()]
            raise AssertionError(
                f"the follower did not take over in 3 s: the lease is held by {holder!r} (lead "
                f"{lead.gw.settings.gateway_id}, follower {other.gw.settings.gateway_id}); the follower's "
                f"failure: {other.gw.domain().dispatcher.failed}; the lead's loops still running: "
                f"{lead_alive}") from None
        assert took <= election.LEASE_MS / 1000 + 1.0  # the lease lapses, then the next renewal takes it
        responses = await asyncio.gather(*calls)
        assert [r.status_code for r in responses] == [200] * 40, [r.text for r in responses if r.status_code != 200]
        ids = [r.json()["id"] for r in responses]
        assert len(set(ids)) == 40


async def test_a_scheduler_whose_lease_lapses_steps_down_and_hands_its_queue_on_with_nothing_failed(
    redis_url: str, prompts: PromptBuilder, model_spec: ModelSpec
) -> None:
    """The scheduler cannot renew its lease for 3 s (its renewal hangs, as when the process is
    paused or cut off from Redis) while its own clients' requests and forwarded ones wait in
    its queue: once the lease's time has passed by its own clock it dispatches nothing; the
    follower takes over; when its renewal answers, it steps down and hands its own queued
    requests on with their contracts, and every request is answered 200, once."""
    engine = EchoEngine(tokens=8, step_s=0.05)  # slow enough that a queue builds
    async with make_harness(redis_url, prompts, model_spec.name, engine=engine) as lead, \
            follower(redis_url, prompts, model_spec.name) as other:
        _, key = await lead.tenant("acme", rate=10**6, burst=10**8)
        calls = [asyncio.create_task((lead if i % 2 else other).complete(key)) for i in range(40)]
        await _until(lambda: lead.gw.domain().dispatcher.shell.driver.queued > 4, "a queue at the scheduler")
        leading = lead.gw.domain().dispatcher.leading
        renew = leading._hold

        async def cut_off(*args: object, **kwargs: object) -> object:
            await asyncio.sleep(3.0)
            leading._hold = renew  # type: ignore[method-assign]
            return await renew(*args, **kwargs)  # type: ignore[arg-type]

        leading._hold = cut_off  # type: ignore[method-assign,assignment]
        await _until(lambda: other.gw.domain().dispatcher.leading.leader, "the follower took over", timeout_s=3.0)
        assert not leading.lead()  # still holding in its own eyes, but it acts as the scheduler no more
        await _until(lambda: not leading.leader, "the scheduler stepped down", timeout_s=5.0)
        lease = wire.scheduler_lease(other.gw.settings.model_name)
        assert (await other.gw.client.get(lease)) == other.gw.settings.gateway_id.encode()
        responses = await asyncio.gather(*calls)
        assert [r.status_code for r in responses] == [200] * 40, [r.text for r in responses if r.status_code != 200]
        assert len({r.json()["id"] for r in responses}) == 40
        assert {r.json()["choices"][0]["text"] for r in responses} == {responses[0].json()["choices"][0]["text"]}


async def test_each_job_goes_to_a_worker_with_a_free_slot_and_no_worker_runs_more_than_its_slots(
    redis_url: str, prompts: PromptBuilder, model_spec: ModelSpec
) -> None:
    """Two workers of 2 slots each, 12 requests at once: the scheduler places each on a worker
    (its jobs land in that worker's pending entries), and neither ever runs more than 2."""
    slow = {"tokens": 6, "slots": 2, "step_s": 0.02}
    async with make_harness(redis_url, prompts, model_spec.name, engine=EchoEngine(**slow)) as lead:  # type: ignore[arg-type]
        with running_worker(redis_url, EchoEngine(**slow), model_spec.name, profile_s=0,  # type: ignore[arg-type]
                            worker_id="second") as second:
            await _until(lambda: len(lead.gw.domain().dispatcher.workers) == 2, "two workers in view")
            first = next(w for w in lead.gw.domain().dispatcher.workers if w != "second")
            _, key = await lead.tenant("acme", rate=10**6, burst=10**8)
            calls = asyncio.gather(*(lead.complete(key, max_tokens=6) for _ in range(12)))
            most = {first: 0, "second": 0}
            ran = {first: 0, "second": 0}
            explained: list[dict[str, Any]] = []
            while not calls.done():
                for wid, held in lead.gw.domain().dispatcher.shell.placement.held().items():  # type: ignore[union-attr]
                    most[wid] = max(most[wid], held)
                    ran[wid] += held > 0
                most["second"] = max(most["second"], second.engine.running)
                for rid in list(lead.gw.domain().dispatcher.pending):
                    why = lead.gw.domain().dispatcher.shell.explain(rid)
                    if why is not None and why["state"] == "dispatched":
                        explained.append(why)
                await asyncio.sleep(0.005)
            assert [r.status_code for r in await calls] == [200] * 12
            assert most[first] <= 2 and most["second"] <= 2, most
            # a running request's explanation says where it went and what was credited there
            placed = [why["placement"] for why in explained]
            assert placed and all(pl["worker"] in (first, "second") and pl["cached_tokens"] == 0  # echo: no cache
                                  and set(pl["first_token_s"]) <= {first, "second"} for pl in placed), placed
            assert ran[first] and ran["second"], ran  # both took work


async def test_a_follower_s_console_shows_the_cluster_and_explains_what_the_scheduler_holds(
    redis_url: str, prompts: PromptBuilder, model_spec: ModelSpec
) -> None:
    slow = EchoEngine(tokens=4, slots=1, step_s=0.1)  # one at a time: the others queue at the scheduler
    async with make_harness(redis_url, prompts, model_spec.name, engine=slow) as lead, \
            follower(redis_url, prompts, model_spec.name) as other:
        _, key = await lead.tenant("acme", rate=10**6, burst=10**8)
        for gw in (lead.gw, other.gw):
            await console.publish(gw)
        view = (await other.admin("GET", "/cluster")).json()
        assert view["gateway"] == other.gw.settings.gateway_id
        roles = {g["gateway"]: g["role"] for g in view["gateways"]}
        assert roles == {lead.gw.settings.gateway_id: "scheduler", other.gw.settings.gateway_id: "follower"}
        assert view["scheduler"]["gateway"] == lead.gw.settings.gateway_id  # the queues are the scheduler's
        assert [w["engine"] for w in view["workers"]] == ["echo"]
        sent = [asyncio.create_task(other.complete(key, max_tokens=4)) for _ in range(3)]
        shell = lead.gw.domain().dispatcher.shell
        await _until(lambda: bool(shell.queued_ids()), "a forwarded request queued at the scheduler")
        rid = shell.queued_ids()[-1]
        doc = (await other.admin("GET", f"/requests/{rid}")).json()  # asked of the scheduler, answered by it
        assert doc["id"] == rid and doc["schedule"]["state"] == "queued", doc
        there = lead.gw.domain().dispatcher.shell.explain(rid)
        assert there is not None and set(doc["schedule"]) == set(there)
        assert all(doc["schedule"][k] == there[k] for k in ("request_id", "tenant", "bucket", "max_prompt"))
        assert [r.status_code for r in await asyncio.gather(*sent)] == [200] * 3
        # the follower's admissions and the scheduler's verdicts on its promises (each from the
        # request's end note, which reaches the scheduler after the answer went out)
        deadline = time.monotonic() + 5.0
        while True:
            for gw in (lead.gw, other.gw):
                await console.publish(gw)
            counters = (await other.admin("GET", "/cluster")).json()["counters"]
            total = counters["contracts"].get("cpu", {}).get("total", {})
            if total.get("inside", 0) + total.get("outside", 0) == 3 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        assert counters["admitted"] == 3 and total["inside"] + total["outside"] == 3, counters
        # a request the scheduler no longer holds: its record, without a schedule
        assert "schedule" not in (await other.admin("GET", f"/requests/{rid}")).json()
