"""The admin API over HTTP (in process, real Redis): auth, validation, every route."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from gateway.dispatch import traffic_log
from gateway.http import console as console_status
from sched_core.simulate.workload import parse_trace
from sched_core.smdp import STATE_NAMES
from tests.integration.gateway.conftest import ADMIN, ECHO_TOKENS, Harness, make_harness
from workers.engine import EchoEngine

pytestmark = [pytest.mark.redis, pytest.mark.anyio]

#: limits whose largest request (5 prompt + 35 output tokens) a burst of 40 holds
SMALL = {"max_prompt_tokens": 5, "max_output_tokens": 35}

ROUTES = [
    ("POST", "/tenants"),
    ("GET", "/tenants"),
    ("GET", "/tenants/acme"),
    ("PATCH", "/tenants/acme"),
    ("DELETE", "/tenants/acme"),
    ("GET", "/tenants/acme/usage"),
    ("POST", "/tenants/acme/keys"),
    ("GET", "/tenants/acme/keys"),
    ("DELETE", "/keys/0123abcd"),
    ("GET", "/workers"),
    ("GET", "/scheduler"),
    ("POST", "/scheduler/tune"),
    ("GET", "/traffic"),
    ("GET", "/usage"),
    ("GET", "/cluster"),
    ("GET", "/requests/0123abcd"),
    ("GET", "/no-such-route"),
]


@pytest.mark.parametrize(("method", "path"), ROUTES)
async def test_every_admin_route_needs_the_admin_token(
    harness: Harness, method: str, path: str
) -> None:
    _, key = await harness.tenant("acme")
    for token in (None, "wrong-token-wrong-token", ADMIN + "x", key):
        r = await harness.admin(method, path, {"name": "x", "rate": 1}, token=token)
        assert r.status_code == 401, (token, r.text)
        assert r.json()["error"]["code"] in ("invalid_admin_token",)
        message = r.json()["error"]["message"]  # a missing token and a wrong one are told apart
        assert ("Bearer <admin token>" in message) if token is None else ("not the admin token" in message)
    assert (await harness.admin("GET", "/tenants/acme")).json()["name"] == "acme"  # unchanged


async def test_tenant_lifecycle(harness: Harness) -> None:
    r = await harness.admin(
        "POST", "/tenants", {"name": "acme", "rate": 1000, "limits": {"max_concurrent": 2}}
    )
    assert r.status_code == 201
    t = r.json()  # ten seconds of the rate: more than the model's context, so that is the default
    assert t["object"] == "tenant" and t["burst"] == 10_000 and t["limits"]["max_concurrent"] == 2
    got = (await harness.admin("GET", "/tenants/acme")).json()
    assert got["id"] == t["id"] and got["state"] == {
        "remaining_tokens": 10_000,
        "reset_s": 0.0,
        "in_flight": 0,
    }
    assert [x["name"] for x in (await harness.admin("GET", "/tenants")).json()["data"]] == ["acme"]
    r = await harness.admin(
        "PATCH", f"/tenants/{t['id']}", {"rate": 5, "limits": {"max_concurrent": None}}
    )
    assert (
        r.status_code == 200
        and r.json()["rate"] == 5.0
        and r.json()["limits"]["max_concurrent"] is None
    )
    assert r.json()["slo_ttft_ms"] is None and r.json()["slo_tpot_ms"] is None
    r = await harness.admin("DELETE", "/tenants/acme")
    assert r.json() == {"id": t["id"], "object": "tenant", "name": "acme", "deleted": True}
    assert (await harness.admin("GET", f"/tenants/{t['id']}")).status_code == 404


async def test_a_tenant_default_slo_is_set_kept_and_removed(harness: Harness) -> None:
    r = await harness.admin("POST", "/tenants", {"name": "acme", "rate": 50, "slo_ttft_ms": 800})
    assert r.status_code == 201 and (r.json()["slo_ttft_ms"], r.json()["slo_tpot_ms"]) == (800.0, None)
    r = await harness.admin("PATCH", "/tenants/acme", {"slo_tpot_ms": 40})
    assert (r.json()["slo_ttft_ms"], r.json()["slo_tpot_ms"]) == (800.0, 40.0)
    r = await harness.admin("PATCH", "/tenants/acme", {"rate": 60})  # absent: kept
    assert (r.json()["slo_ttft_ms"], r.json()["slo_tpot_ms"]) == (800.0, 40.0)
    r = await harness.admin("PATCH", "/tenants/acme", {"slo_ttft_ms": None})  # null: removed
    assert r.status_code == 200 and (r.json()["slo_ttft_ms"], r.json()["slo_tpot_ms"]) == (None, 40.0)
    got = (await harness.admin("GET", "/tenants/acme")).json()
    assert (got["slo_ttft_ms"], got["slo_tpot_ms"]) == (None, 40.0)
    listed = (await harness.admin("GET", "/tenants")).json()["data"][0]
    assert (listed["slo_ttft_ms"], listed["slo_tpot_ms"]) == (None, 40.0)


async def test_validation_conflicts_and_unknowns(harness: Harness) -> None:
    await harness.tenant("acme")
    await harness.tenant("beta")
    cases = [
        ("POST", "/tenants", {"name": "acme", "rate": 1}, 409, "name"),
        ("POST", "/tenants", {"name": "new", "rate": -1}, 400, "rate"),
        ("POST", "/tenants", {"name": "new", "rate": 1, "limits": {"x": 1}}, 400, "limits.x"),
        ("POST", "/tenants", [1, 2], 400, None),
        ("POST", "/tenants", {"name": "new", "rate": 1, "slo_ttft_ms": 0}, 400, "slo_ttft_ms"),
        ("POST", "/tenants", {"name": "new", "rate": 1, "slo_ttft_ms": 600_001}, 400, "slo_ttft_ms"),
        ("POST", "/tenants", {"name": "new", "rate": 1, "slo_tpot_ms": "40"}, 400, "slo_tpot_ms"),
        ("PATCH", "/tenants/beta", {"slo_tpot_ms": 60_001}, 400, "slo_tpot_ms"),
        ("PATCH", "/tenants/beta", {"slo_ttft_ms": -1}, 400, "slo_ttft_ms"),
        ("PATCH", "/tenants/beta", {"name": "acme"}, 409, "name"),
        ("PATCH", "/tenants/beta", {"burst": None}, 400, "burst"),
        ("PATCH", "/tenants/nobody", {"rate": 1}, 404, "tenant"),
        ("GET", "/tenants/nobody", None, 404, "tenant"),
        ("GET", "/tenants/tn_0000000000000000", None, 404, "tenant"),
        ("DELETE", "/tenants/nobody", None, 404, "tenant"),
        ("GET", "/tenants/nobody/usage", None, 404, "tenant"),
        ("GET", "/tenants/acme/usage?since=yesterday", None, 400, "since"),
        ("POST", "/tenants/nobody/keys", None, 404, "tenant"),
        ("POST", "/tenants/acme/keys", {"label": "x"}, 400, "label"),
        ("GET", "/tenants/nobody/keys", None, 404, "tenant"),
        ("DELETE", "/keys/0123abcd", None, 404, "prefix"),
        ("DELETE", "/keys/not-a-prefix", None, 404, "prefix"),
    ]
    for method, path, body, status, param in cases:
        r = await harness.admin(method, path, body)
        assert r.status_code == status, (method, path, r.text)
        err = r.json()["error"]
        assert set(err) >= {"message", "type", "param", "code"} and err["param"] == param, (
            path,
            err,
        )
    bad_json = await harness.http.post(
        "/admin/tenants",
        content=b"{",
        headers={"authorization": f"Bearer {ADMIN}", "content-type": "application/json"},
    )
    assert bad_json.status_code == 400


async def test_keys_are_shown_once_listed_by_prefix_and_revocable(harness: Harness) -> None:
    t, key = await harness.tenant("acme")
    listed = (await harness.admin("GET", "/tenants/acme/keys")).json()["data"]
    assert len(listed) == 1 and listed[0]["prefix"] == key[3:11] and "key" not in listed[0]
    assert key not in str(listed)
    assert (await harness.complete(key)).status_code == 200
    r = await harness.admin("DELETE", f"/keys/{listed[0]['prefix']}")
    assert r.status_code == 200 and r.json()["deleted"] is True
    assert (await harness.complete(key)).status_code == 401
    assert (await harness.admin("GET", "/tenants/acme/keys")).json()["data"] == []


async def test_usage_per_minute(harness: Harness) -> None:
    t, key = await harness.tenant("acme", rate=1, burst=40, max_queue_delay_s=0, limits=SMALL)
    assert (await harness.complete(key, max_tokens=20)).status_code == 200
    assert (await harness.complete(key, max_tokens=30)).status_code == 429
    r = await harness.admin("GET", "/tenants/acme/usage")
    body = r.json()
    assert body["tenant"] == t["id"] and body["object"] == "list"
    assert body["totals"] == {
        "requests": 1,
        "rate_limited": 1,
        "prompt_tokens": 5,
        "completion_tokens": 8,
        "slo_met": 0,
        "slo_missed": 0,
        "total_tokens": 13,
        "charged_tokens": 13,
    }
    assert sum(row["requests"] for row in body["data"]) == 1


async def test_workers_and_scheduler(harness: Harness) -> None:
    workers = (await harness.admin("GET", "/workers")).json()["data"]
    assert len(workers) == 1 and workers[0]["engine"] == "echo" and workers[0]["pool"] == "cpu"
    snap = (await harness.admin("GET", "/scheduler")).json()
    assert snap["gateway"] and snap["role"] == "scheduler" and snap["gateways"] == 1
    assert len(snap["buckets"]) == 8 and {"b1", "b2", "queued"} <= set(snap["buckets"][0])
    assert snap["paths"]["cpu"]["capacity"] == workers[0]["slots"]  # fed from the heartbeat
    assert {"step_model", "step_s", "workers", "step_tokens"} <= set(snap["paths"]["gpu"])


async def test_worker_step_telemetry_refits_the_scheduler_and_slots_come_back(harness: Harness) -> None:
    """The worker's step records reach the gateway's step-time model (its model's telemetry stream), and each
    answered request's slot is back before the next one is sent."""
    _, key = await harness.tenant("acme", rate=10**6, burst=10**7)
    before = (await harness.admin("GET", "/scheduler")).json()["paths"]["cpu"]["fitted_steps"]
    for _ in range(5):
        assert (await harness.complete(key)).status_code == 200
        assert (await harness.admin("GET", "/scheduler")).json()["paths"]["cpu"]["in_flight"] == 0
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        snap = (await harness.admin("GET", "/scheduler")).json()
        if snap["paths"]["cpu"]["fitted_steps"] > before:
            break
        await asyncio.sleep(0.05)
    assert snap["paths"]["cpu"]["fitted_steps"] > before and snap["policy"]["spec"] == "smdp"
    assert snap["policy"]["name"] == "smdp-code" and snap["policy"]["state"] in STATE_NAMES


async def test_the_traffic_the_scheduler_saw_is_a_trace_to_tune_on(harness: Harness) -> None:
    tenant, key = await harness.tenant("acme", rate=10**6, burst=10**7)
    for n in (3, 5, 7):
        assert (await harness.complete(key, prompt=list(range(1, n + 1)), max_tokens=10)).status_code == 200
    traffic = harness.gw.domain(None).dispatcher.shell.driver.traffic
    deadline = time.monotonic() + 5
    while True:  # the watch loop flushes every 10 s; a test does not wait for it
        await traffic_log.flush(harness.gw.client, harness.model, traffic)
        r = await harness.admin("GET", "/traffic")
        lines = r.text.splitlines()
        if len(lines) == 4 or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.05)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/csv")
    assert lines[0] == "TIMESTAMP,ContextTokens,GeneratedTokens,Finished,Tenant"
    rows = [line.split(",") for line in lines[1:]]
    expected = [(n, ECHO_TOKENS, "1", tenant["id"]) for n in (3, 5, 7)]
    assert [(int(r[1]), int(r[2]), r[3], r[4]) for r in rows] == expected
    assert abs(float(rows[-1][0]) - time.time()) < 30  # wall time
    trace = parse_trace(lines)  # the simulator's and the solver's reader takes it as it is
    assert [t.prompt_tokens for t in trace] == [3, 5, 7] and trace[0].time_s == 0.0
    latest = (await traffic_log.read_csv(harness.gw.client, harness.model, last=2)).splitlines()  # a re-solve's window
    assert latest[0] == lines[0] and latest[1:] == lines[2:]
    assert (await harness.admin("GET", "/traffic?model=nope")).status_code == 404


async def test_every_tenant_s_usage_in_the_minute_and_the_hour_with_its_slo_attainment(harness: Harness) -> None:
    _, key = await harness.tenant("acme", rate=1, burst=40, max_queue_delay_s=0, limits=SMALL, slo_ttft_ms=60_000)
    await harness.tenant("idle")
    assert (await harness.complete(key, max_tokens=20)).status_code == 200  # met its (generous) SLO
    assert (await harness.complete(key, max_tokens=30)).status_code == 429
    r = await harness.admin("GET", "/usage")
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "list" and body["until"] - body["since"] == 3599
    by_name = {u["name"]: u for u in body["data"]}
    acme = by_name["acme"]
    for window in (acme["minute"], acme["hour"]):  # both made this minute
        assert window == {"requests": 1, "rate_limited": 1, "prompt_tokens": 5, "completion_tokens": 8,
                          "slo_met": 1, "slo_missed": 0, "total_tokens": 13, "charged_tokens": 13}
    assert by_name["idle"]["hour"]["requests"] == 0
    # (a missed SLO is counted by the same script: tests/unit/gateway/test_usage.py judges the verdicts)


async def test_the_cluster_view_counts_admissions_refusals_and_contracts(harness: Harness) -> None:
    _, key = await harness.tenant("acme", rate=1, burst=40, max_queue_delay_s=0, limits=SMALL)
    await console_status.publish(harness.gw)
    before = (await harness.admin("GET", "/cluster")).json()
    assert before["object"] == "cluster" and before["gateway"] == harness.gw.settings.gateway_id
    assert [g["role"] for g in before["gateways"]] == ["scheduler"]
    assert before["scheduler"]["gateway"] == harness.gw.settings.gateway_id
    assert before["scheduler"]["policy"]["spec"] == "smdp"
    assert before["scheduler"]["policy"]["state"] in STATE_NAMES
    assert {b["bucket"] for b in before["scheduler"]["buckets"]} == set(range(8))
    assert set(before["scheduler"]["backlog"]) == {"cpu", "gpu"}
    [worker] = before["workers"]
    assert worker["engine"] == "echo" and worker["slots"] > 0 and 0 <= worker["heartbeat_age_s"] < 5
    assert (await harness.complete(key, max_tokens=20)).status_code == 200
    assert (await harness.complete(key, max_tokens=30)).status_code == 429
    deadline = time.monotonic() + 5.0
    while True:  # the promise is judged as the request settles, just after its answer
        await console_status.publish(harness.gw)
        after = (await harness.admin("GET", "/cluster")).json()["counters"]
        if "cpu" in after["contracts"] or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.05)
    was = before["counters"]
    assert after["admitted"] - was["admitted"] == 1 and after["refused"] - was["refused"] == 1
    assert after["responses"]["429"] - was["responses"].get("429", 0) == 1
    cpu = after["contracts"]["cpu"]["total"]
    assert cpu["inside"] + cpu["outside"] == 1 and cpu["errors"] == 1  # the admitted one's promise, judged


async def test_any_request_is_explained_while_queued_and_its_record_after(
    redis_url: str, prompts: Any, model_spec: Any
) -> None:
    slow = EchoEngine(tokens=4, slots=1, step_s=0.3)  # one at a time: the last queued ~2.4 s (a slow CPU's GET)
    async with make_harness(redis_url, prompts, model_spec.name, engine=slow) as h:
        _, key = await h.tenant("acme", rate=10**6, burst=10**7)
        sent = [asyncio.create_task(h.complete(key, max_tokens=4)) for _ in range(3)]
        shell = h.gw.domain().dispatcher.shell
        deadline = time.monotonic() + 5
        while not shell.queued_ids():
            assert time.monotonic() < deadline, "nothing queued"
            await asyncio.sleep(0.01)
        rid = shell.queued_ids()[-1]
        r = await h.admin("GET", f"/requests/{rid}")
        assert r.status_code == 200, r.text
        doc = r.json()
        assert doc["id"] == rid and doc["state"] == "admitted" and doc["prompt_tokens"] == 5
        assert doc["schedule"]["state"] == "queued" and doc["schedule"]["requests_ahead"] >= 0
        promise = doc["schedule"]["contract"]  # the contract it was given, before the record has it
        assert promise["request_id"] == rid and 0 < promise["ttft_s"] <= promise["ttft_p99_s"] <= promise["p99_s"]
        done = await asyncio.gather(*sent)
        assert [x.status_code for x in done] == [200] * 3
        answered = done[0]
        after = (await h.admin("GET", f"/requests/{answered.json()['id']}")).json()  # the response id works too
        assert after["state"] == "done" and "schedule" not in after
        assert after["total_s"] > 0 and after["contract_p99_s"] > 0
        settled = (await h.admin("GET", f"/requests/{rid}")).json()
        assert settled["contract_p99_s"] == pytest.approx(promise["p99_s"])  # the same promise, now on record
        missing = await h.admin("GET", "/requests/0123abcd")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"


async def test_no_tenant_is_locked_out_by_its_own_burst(harness: Harness) -> None:
    """Issue 38: `--rate 63` gave a burst of 630, and every 892-token request was refused, forever.
    Now the default burst holds one request of up to the model's context, and a burst given
    that cannot is refused at create and at update, naming the fix."""
    context = harness.gw.domain().prompts.context_tokens
    r = await harness.admin("POST", "/tenants", {"name": "noisy", "rate": 63, "burst": 630})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"], err["type"]) == ("burst", "burst_too_small", "invalid_request_error")
    assert err["message"].startswith(f"burst 630 cannot hold one request of up to {context} tokens")
    assert f"raise burst (--burst) to at least {context} or leave it out" in err["message"]
    assert (await harness.admin("GET", "/tenants/noisy")).status_code == 404  # nothing stored

    t, key = await harness.tenant("noisy", rate=63)
    assert t["burst"] == context  # not 630: ten seconds of the rate would not hold one request
    prompt = list(range(1, 893))
    r = await harness.complete(key, prompt=prompt, max_tokens=context - len(prompt))  # the largest request
    assert r.status_code == 200, r.text

    r = await harness.admin("PATCH", "/tenants/noisy", {"burst": 630})
    assert r.status_code == 400 and r.json()["error"]["code"] == "burst_too_small"
    assert "at least" in r.json()["error"]["message"] and "leave it out" not in r.json()["error"]["message"]
    assert (await harness.admin("GET", "/tenants/noisy")).json()["burst"] == context  # unchanged
    capped = {"burst": 900, "limits": {"max_prompt_tokens": 700, "max_output_tokens": 200}}
    r = await harness.admin("PATCH", "/tenants/noisy", capped)
    assert r.status_code == 200 and r.json()["burst"] == 900
    r = await harness.admin("PATCH", "/tenants/noisy", {"limits": {"max_output_tokens": None}})
    assert r.status_code == 400 and f"up to {context} tokens" in r.json()["error"]["message"]


async def test_a_request_larger_than_a_stored_burst_is_still_refused_naming_the_burst(harness: Harness) -> None:
    """A tenant stored before the rule (here: written past the admin API) keeps its burst;
    a request larger than it is a 400 that names the burst and the fix."""
    from gateway.tenancy.tenants import Tenant, new_id

    old = await harness.gw.tenants.create(Tenant(new_id(), "legacy", rate=63.0, burst=630))
    issued = (await harness.admin("POST", f"/tenants/{old.id}/keys", {"name": "k"})).json()["key"]
    r = await harness.complete(issued, prompt=list(range(1, 893)), max_tokens=16)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "budget_exceeded" and "burst of 630 tokens" in err["message"]
    assert "tokengate tenants update legacy --burst 908" in err["message"]
    # any update of it asks for the burst to be raised first
    r = await harness.admin("PATCH", "/tenants/legacy", {"priority": 1})
    assert r.status_code == 400 and r.json()["error"]["code"] == "burst_too_small"
