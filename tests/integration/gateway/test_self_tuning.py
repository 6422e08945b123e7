"""The scheduler's self-tuning through a real gateway and Redis (``gateway/dispatch/tuning.py``):
the table in force survives a restart, an operator's ask re-solves it in a child process on the
traffic recorded, a swap is told in ``/admin/scheduler``, and a swap that loses live is rolled
back."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import orjson
import pytest
import redis.asyncio as aioredis

from common import wire
from gateway.dispatch import tuning
from gateway.dispatch.prompts import PromptBuilder
from gateway.dispatch.tuning import Tuning
from sched_core.contracts import Accuracy
from sched_core.recorded import TRAFFIC_WINDOW
from sched_core.rollback import SwapWatch
from sched_core.smdp import Action, PolicyTable
from tests.integration.gateway.conftest import Harness, make_harness
from workers.model_store import ModelSpec

pytestmark = [pytest.mark.redis, pytest.mark.anyio]

STARVING = PolicyTable.uniform(Action(slot_share=0.25), name="starving")  # a quarter of every worker's slots


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def seed(redis_url: str, model: str, requests: int) -> None:
    """What an earlier scheduler left: the starving table in force, and ``requests`` of traffic
    (Poisson, 3 req/s, log-normal prompts), as ``traffic_log.flush`` writes them."""
    client = aioredis.Redis.from_url(redis_url)
    rng = random.Random(1)
    at = 1.7e9  # a fixed wall time: the gaps, rounded to the millisecond as stored, are the same every run
    pipe = client.pipeline(transaction=False)
    for _ in range(requests):
        at += rng.expovariate(3.0)
        row = [round(at, 3), int(rng.lognormvariate(4.5, 0.8)) + 1, rng.randint(2, 40), 1, "t1"]
        pipe.xadd(wire.traffic_stream(model), {"r": orjson.dumps(row)}, maxlen=TRAFFIC_WINDOW)
    pipe.set(wire.policy_key(model), orjson.dumps({"table": STARVING.to_json(), "since": time.time(),
                                                   "kind": "swap", "why": "seeded"}))
    await pipe.execute()
    await client.aclose()


async def scheduler(h: Harness) -> dict[str, Any]:
    r = await h.admin("GET", "/scheduler")
    assert r.status_code == 200, r.text
    doc: dict[str, Any] = r.json()
    return doc


async def test_an_asked_re_solve_swaps_a_starving_table_for_one_that_won_on_the_later_traffic(
        redis_url: str, prompts: PromptBuilder, model_spec: ModelSpec) -> None:
    await seed(redis_url, model_spec.name, 450)
    async with make_harness(redis_url, prompts, model_spec.name, tune_cpu=1.0) as h:  # a whole core: the test's time
        snap = await scheduler(h)
        assert snap["policy"]["name"] == "starving"  # the table in force, restored at the take-over
        assert snap["tuning"]["enabled"] and snap["tuning"]["every_s"] == 900.0
        assert snap["tuning"]["in_force"]["name"] == "starving" and snap["tuning"]["changes"] == []
        h.gw.domain().dispatcher.tuning.budget = 40  # a short search: the test's time, not the swap's grounds
        r = await h.admin("POST", "/scheduler/tune")
        assert r.status_code == 202 and r.json() == {"model": model_spec.name, "asked": True}
        deadline = time.monotonic() + 240
        while "last" not in (snap := await scheduler(h))["tuning"]["status"]:
            assert time.monotonic() < deadline, snap["tuning"]
            await asyncio.sleep(0.5)
        last, tuning = snap["tuning"]["status"]["last"], snap["tuning"]
        assert last["reason"] == "asked by an operator" and last["requests"] == 450
        assert last["swap"] and last["score_candidate"] >= last["score_running"] + last["margin"], last
        assert last["running"] == "starving" and last["candidate"].startswith("tuned-")
        assert snap["policy"]["name"] == tuning["in_force"]["name"] == last["candidate"]  # in force at once
        change = tuning["changes"][0]
        assert (change["kind"], change["from"], change["to"]) == ("swap", "starving", last["candidate"])
        assert change["figures"]["scenarios"] == last["scenarios"]  # the later traffic's figures, both tables
        assert tuning["status"]["watch"]["watching"]  # judged next on live outcomes


async def test_a_fixed_policy_is_never_re_solved(redis_url: str, prompts: PromptBuilder, model_spec: ModelSpec) -> None:
    async with make_harness(redis_url, prompts, model_spec.name, policy="tokengate") as h:
        r = await h.admin("POST", "/scheduler/tune")
        assert r.status_code == 409 and r.json()["error"]["code"] == "conflict"
        assert "--policy tokengate" in r.json()["error"]["message"]
        assert not (await scheduler(h))["tuning"]["enabled"]


def ended(tuning: Tuning, n: int, ttft_s: float, inside: bool) -> None:
    accuracy = Accuracy("cpu", inside, 0.1, 0.1, inside, 0.1, 0.1)
    for _ in range(n):
        tuning.outcome(ttft_s, ttft_s + 0.2, 5, accuracy)


async def test_a_swap_that_loses_live_attainment_is_rolled_back(harness: Harness) -> None:
    d = harness.gw.domain().dispatcher
    d.tuning.watch = SwapWatch(baseline=60, after=40)
    packaged = d.tuning.in_force()
    assert packaged is not None and packaged.name == "smdp-code"
    ended(d.tuning, 60, 0.05, True)  # served well under the packaged table: the baseline
    await d.tuning.put(STARVING, "swap", "a test's swap")
    assert d.tuning.in_force() is STARVING and d.tuning.watch.watching
    ended(d.tuning, 40, 5.0, True)  # every first token now misses the 1 s SLO
    deadline = time.monotonic() + 5
    while d.tuning.in_force() is not packaged:
        assert time.monotonic() < deadline, "no rollback"
        await asyncio.sleep(0.02)
    tuning = (await scheduler(harness))["tuning"]
    assert [c["kind"] for c in tuning["changes"]] == ["rollback", "swap"]
    back = tuning["changes"][0]
    assert (back["from"], back["to"]) == ("starving", "smdp-code") and back["why"].startswith("rolled back")
    assert back["figures"]["before"]["slo_attainment"] == 1.0 and back["figures"]["after"]["slo_attainment"] == 0.0
    assert tuning["in_force"]["kind"] == "rollback" and not tuning["status"].get("watch", {}).get("watching")


async def test_a_re_solve_that_fails_costs_a_verdict_and_never_the_serving(
        redis_url: str, prompts: PromptBuilder, model_spec: ModelSpec, monkeypatch: pytest.MonkeyPatch) -> None:
    await seed(redis_url, model_spec.name, 450)
    async with make_harness(redis_url, prompts, model_spec.name, tune_cpu=1.0) as h:
        d = h.gw.domain().dispatcher
        d.tuning.budget = "many"  # type: ignore[assignment]  # the child's own argument check refuses it
        verdict = await d.tuning.solve("a test")
        assert not verdict["swap"] and verdict["why"].startswith("the re-solve failed: ")
        assert "--budget" in verdict["why"]

        def broken(*_: object) -> list[str]:
            raise OSError("no room for the traffic file")

        monkeypatch.setattr(tuning, "deployment_args", broken)
        verdict = await d.tuning.solve("a test")
        assert verdict["why"] == "the re-solve failed: OSError('no room for the traffic file')"
        assert d.failed is None and d.tuning.in_force() is not None and d.tuning.in_force().name == "starving"
        assert (await scheduler(h))["tuning"]["status"]["last"]["why"] == verdict["why"]
        _, key = await h.tenant("acme")
        assert (await h.complete(key)).status_code == 200  # serving goes on
