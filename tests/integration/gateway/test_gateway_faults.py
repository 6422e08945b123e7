"""Faults seen from the gateway (in process, real Redis, echo worker): bad items, lost
batches, a stopped loop, Redis refusing or away, overload, clients that leave. Each fault
ends every accepted request with a result or a clear, retryable error, and the gateway
serves again afterwards."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import httpx
import pytest
import redis.asyncio as aioredis

from common import protocol as p
from gateway.cli.embedded_redis import EmbeddedRedis
from gateway.dispatch.prompts import PromptBuilder
from gateway.dispatch.scheduling import Origin
from gateway.http.lifecycle import refund_if_admitted
from gateway.tenancy.limits import RefusalBucket
from tests.integration.gateway.conftest import Harness, make_harness
from workers.engine import EchoEngine
from workers.model_store import ModelSpec

pytestmark = [pytest.mark.redis, pytest.mark.anyio]


def _used_slots(h: Harness) -> int:
    return sum(int(path["in_flight"]) for path in h.gw.domain().dispatcher.snapshot()["paths"].values())  # type: ignore[index]


async def _wait_for(cond, timeout_s: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


async def test_a_huge_seed_is_a_400_naming_it_and_nothing_stops(harness: Harness) -> None:
    _, key = await harness.tenant("acme")
    for seed in ("99999999999999999999999", 99999999999999999999999, 2**63):
        r = await harness.complete(key, seed=seed)
        assert r.status_code == 400 and r.json()["error"]["param"] == "seed", r.text
    assert (await harness.complete(key, seed=2**63 - 1)).status_code == 200


async def test_a_job_that_cannot_be_encoded_fails_alone_and_gives_its_slot_back(harness: Harness) -> None:
    _, key = await harness.tenant("acme")
    # past validation nothing can build such a job; the dispatcher must still survive one
    bad = p.SeqJob("bad-seed", (1, 2, 3), p.SamplingParams(4, seed=2**70))
    pending = await harness.gw.domain().dispatcher.submit(bad, Origin("t", 1000.0))
    assert not isinstance(pending, type(None))
    ev = await asyncio.wait_for(pending.events.get(), 5)  # type: ignore[union-attr]
    assert isinstance(ev, p.Failed) and ev.code == "unencodable"
    harness.gw.domain().dispatcher.end("bad-seed", None, None, 0)
    r = await harness.complete(key)
    assert r.status_code == 200
    assert _used_slots(harness) == 0


@pytest.fixture
async def restricted(redis_url: str, prompts: PromptBuilder, model_spec: ModelSpec) -> AsyncIterator[Harness]:
    """A gateway logged in as a Redis user whose XADD rights the test takes away."""
    admin = aioredis.Redis.from_url(redis_url)
    await admin.execute_command("ACL", "SETUSER", "gw", "on", ">gw-secret", "~*", "&*", "+@all")
    url = redis_url.replace("redis://", "redis://gw:gw-secret@")
    async with make_harness(redis_url, prompts, model_spec.name, client_url=url) as h:
        h.redis_admin = admin  # type: ignore[attr-defined]
        yield h
    await admin.execute_command("ACL", "DELUSER", "gw")
    await admin.aclose()


async def test_batches_that_cannot_be_queued_fail_with_a_503_and_free_their_slots(restricted: Harness) -> None:
    h = restricted
    admin: aioredis.Redis = h.redis_admin  # type: ignore[attr-defined]
    _, key = await h.tenant("acme")
    await admin.execute_command("ACL", "SETUSER", "gw", "-xadd")
    replies = await asyncio.gather(*(h.complete(key) for _ in range(20)))
    for r in replies:
        assert r.status_code == 503 and r.json()["error"]["code"] == "redis", r.text
        assert r.headers["retry-after"]
    assert _used_slots(h) == 0 and h.gw.domain().dispatcher.shell.leases == 0
    await admin.execute_command("ACL", "SETUSER", "gw", "+xadd")
    replies = await asyncio.gather(*(h.complete(key) for _ in range(20)))
    assert [r.status_code for r in replies] == [200] * 20


async def test_a_loop_that_stops_makes_the_gateway_unready_and_asks_to_exit(harness: Harness) -> None:
    _, key = await harness.tenant("acme")
    fatal: list[str] = []
    harness.gw.domain().dispatcher.on_fatal = fatal.append

    def broken(now: float) -> None:
        raise RuntimeError("scheduler bug")

    harness.gw.domain().dispatcher.shell.tick = broken  # type: ignore[method-assign,assignment]
    r = await harness.complete(key)
    assert r.status_code == 503 and r.json()["error"]["code"] == "gateway_error", r.text
    ready = await harness.http.get("/readyz")
    assert ready.status_code == 503 and "send loop stopped" in ready.json()["reason"]
    assert fatal and "scheduler bug" in fatal[0]


async def test_overload_is_a_fast_503_with_retry_after(
    redis_url: str, prompts: PromptBuilder, model_spec: ModelSpec
) -> None:
    slow = EchoEngine(tokens=4, step_s=0.1)
    async with make_harness(redis_url, prompts, model_spec.name, engine=slow, max_in_flight=3) as h:
        _, key = await h.tenant("acme")
        started = time.monotonic()
        replies = await asyncio.gather(*(h.complete(key) for _ in range(10)))
        codes = sorted(r.status_code for r in replies)
        assert codes.count(200) >= 3 and set(codes) <= {200, 503}, codes
        refused = [r for r in replies if r.status_code == 503]
        assert refused and all(r.json()["error"]["code"] == "overloaded" for r in refused)
        assert all(r.headers["retry-after"] == "1" for r in refused)
        assert time.monotonic() - started < 5
        assert h.gw.in_flight == 0
        assert (await h.complete(key)).status_code == 200


async def test_a_request_without_an_slo_is_refused_at_once_rather_than_queued_past_the_bound(
    redis_url: str, prompts: PromptBuilder, model_spec: ModelSpec
) -> None:
    slow = EchoEngine(tokens=8, slots=2, step_s=0.02)  # two at a time, ~0.16 s each: 40 make a 3 s queue
    async with make_harness(redis_url, prompts, model_spec.name, engine=slow, max_queue_wait_ms=1000.0) as h:
        _, key = await h.tenant("acme")
        _, patient = await h.tenant("patient", max_queue_wait_ms=600_000)

        async def timed(k: str) -> tuple[httpx.Response, float]:
            started = time.monotonic()
            r = await h.complete(k)
            return r, time.monotonic() - started

        # before outcomes at a load level, nobody is refused: a queue as deep teaches its level
        warm = await asyncio.gather(*(h.complete(key) for _ in range(40)))
        assert [r.status_code for r in warm] == [200] * 40
        replies = await asyncio.gather(*(timed(key) for _ in range(40)))  # now first tokens are predicted well
        codes = [r.status_code for r, _ in replies]
        assert set(codes) <= {200, 503} and 2 <= codes.count(200) < 40, codes
        for r, took in replies:
            if r.status_code == 503:
                err = r.json()["error"]
                assert err["code"] == "overloaded" and "wait" in err["message"], err
                # refused at admission, not after waiting out its bound in the queue (the time is
                # the admission of 40 requests at once on one event loop: ~0.2-0.6 s here)
                assert int(r.headers["retry-after"]) >= 1 and took < 1.0, (r.headers, took)
        assert max(took for r, took in replies if r.status_code == 200) < 1.0 + 2.5  # the bound, its prefill, a step
        replies = await asyncio.gather(*(timed(patient) for _ in range(12)))  # its own bound: nobody refused
        assert [r.status_code for r, _ in replies] == [200] * 12


async def test_redis_away_is_a_503_with_retry_after_within_the_redis_timeout(
    prompts: PromptBuilder, model_spec: ModelSpec
) -> None:
    server = EmbeddedRedis().start()
    try:
        async with make_harness(server.url, prompts, model_spec.name, redis_timeout_s=2.0) as h:
            _, key = await h.tenant("acme")
            assert (await h.complete(key)).status_code == 200
            assert server._proc is not None
            server._proc.send_signal(19)  # SIGSTOP: Redis stalls, connections stay open
            try:
                started = time.monotonic()
                r = await h.complete(key)
                assert time.monotonic() - started < 2.0 + 1.5
                assert r.status_code == 503 and r.headers["retry-after"], r.text
                assert r.json()["error"]["code"] in ("redis_unavailable", "redis"), r.text
                started = time.monotonic()
                ready = await h.http.get("/readyz")  # a 1 s probe must see the answer, not a time-out
                assert time.monotonic() - started < 1.0 and ready.status_code == 503, ready.text
                assert ready.json()["reason"].startswith("redis"), ready.text
            finally:
                server._proc.send_signal(18)  # SIGCONT
            await _wait_for(lambda: bool(h.gw.domain().dispatcher.workers), 10)
            deadline = time.monotonic() + 15
            while (r := await h.complete(key)).status_code != 200:
                assert time.monotonic() < deadline, r.text
                await asyncio.sleep(0.2)
    finally:
        server.stop()


async def test_requests_redis_lost_fail_fast_and_free_their_slots(
    redis_url: str, prompts: PromptBuilder, model_spec: ModelSpec
) -> None:
    slow = EchoEngine(tokens=50, step_s=0.2)  # ten seconds per request
    async with make_harness(redis_url, prompts, model_spec.name, engine=slow) as h:
        _, key = await h.tenant("acme")
        calls = [asyncio.ensure_future(h.complete(key)) for _ in range(3)]
        await _wait_for(lambda: _used_slots(h) == 3)
        started = time.monotonic()
        await aioredis.Redis.from_url(redis_url).flushall()  # Redis restarted without its data
        replies = await asyncio.gather(*calls)
        assert time.monotonic() - started < 3.0
        for r in replies:
            assert r.status_code == 503 and r.json()["error"]["code"] == "redis", r.text
        assert _used_slots(h) == 0


async def test_admin_without_a_trailing_slash_needs_the_token_first(harness: Harness) -> None:
    for path in ("/admin", "/admin/", "/admin/nope"):
        r = await harness.http.get(path)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_admin_token", path


async def test_a_client_that_leaves_a_plain_request_is_a_499_not_a_500(
    redis_url: str, prompts: PromptBuilder, model_spec: ModelSpec, caplog: pytest.LogCaptureFixture
) -> None:
    slow = EchoEngine(tokens=20, step_s=0.1)
    async with make_harness(redis_url, prompts, model_spec.name, engine=slow) as h:
        _, key = await h.tenant("acme")
        app = h.http._transport.app  # type: ignore[attr-defined]
        body = b'{"model": "%s", "prompt": [1, 2, 3], "max_tokens": 20}' % h.model.encode()
        sent: list[dict[str, object]] = []
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive() -> dict[str, object]:
            if messages:
                return messages.pop()
            await asyncio.sleep(0.3)  # the client hangs up while the request runs
            return {"type": "http.disconnect"}

        async def send(message: dict[str, object]) -> None:
            sent.append(message)

        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
            "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"",
            "root_path": "", "server": ("gateway", 80), "client": ("127.0.0.1", 1),
            "headers": [(b"content-type", b"application/json"), (b"authorization", f"Bearer {key}".encode())],
        }
        await app(scope, receive, send)
        assert sent[0]["status"] == 499
        await _wait_for(lambda: h.gw.in_flight == 0 and _used_slots(h) == 0, 10)
        metrics = (await h.http.get("/metrics")).text
        assert f'tokengate_requests_total{{model="{h.model}",route="completions",status="499"}} 1.0' in metrics
        assert 'status="500"' not in metrics
        assert "InvalidStateError" not in caplog.text and "Traceback" not in caplog.text


async def test_a_long_prompt_from_one_tenant_does_not_hold_up_another(harness: Harness) -> None:
    _, big = await harness.tenant("big")
    _, small = await harness.tenant("small")
    huge = "word " * 200_000  # ~1 MB: refused before it is tokenized
    r = await harness.http.post(
        "/v1/completions",
        json={"model": harness.model, "prompt": huge, "max_tokens": 4},
        headers={"authorization": f"Bearer {big}"},
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    # several long ones at once: at most two per tenant are tokenized, the rest get 429 at once
    long = "word " * 30_000
    calls = [
        harness.http.post(
            "/v1/completions",
            json={"model": harness.model, "prompt": long, "max_tokens": 4},
            headers={"authorization": f"Bearer {big}"},
        )
        for _ in range(6)
    ]
    results = await asyncio.gather(*calls, harness.complete(small))
    codes = [r.status_code for r in results[:-1]]
    assert set(codes) <= {400, 429} and 429 in codes, codes
    assert results[-1].status_code == 200


async def test_unknown_fields_pass_and_bounded_ones_are_checked_on_every_route(harness: Harness) -> None:
    _, key = await harness.tenant("acme")
    auth = {"authorization": f"Bearer {key}"}
    chat = {"model": harness.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for extra, param in (
        ({"temperature": "1"}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 2}, "n"),
        ({"max_tokens": 2**40}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "x"}] * 5000}, "messages"),
        ({"user": "u" * 1000}, "user"),
        ({"stop": ["s"] * 5}, "stop"),
        ({"presence_penalty": 3}, "presence_penalty"),
    ):
        r = await harness.http.post("/v1/chat/completions", json={**chat, **extra}, headers=auth)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)
    r = await harness.http.post("/v1/chat/completions", json={**chat, "some_new_field": 1}, headers=auth)
    assert r.status_code == 200, r.text


async def test_httpx_client_sees_every_error_as_openai_json(harness: Harness) -> None:
    r = await harness.http.post("/v1/completions", content=b"{not json", headers={"authorization": "Bearer x"})
    assert r.status_code == 401  # the key is checked before the body is read
    _, key = await harness.tenant("acme")
    r = await harness.http.post("/v1/completions", content=b"{not json", headers={"authorization": f"Bearer {key}"})
    assert r.status_code == 400 and set(r.json()["error"]) >= {"message", "type", "param", "code"}
    assert isinstance(r, httpx.Response)


async def test_an_admission_whose_reply_was_lost_is_refunded_exactly_once(harness: Harness) -> None:
    """Redis failing mid-call leaves the gateway unsure whether the admission script ran; the
    compensating settlement refunds it if it did and changes nothing if it did not."""
    tenant_doc, _ = await harness.tenant("acme", rate=0.001, burst=10_000)
    tenant = await harness.gw.tenants.get(tenant_doc["id"])
    budget = harness.gw.domain().budget
    full = (await budget.state(tenant))["remaining_tokens"]
    await budget.admit(tenant, "ran", 40, 60)  # the script ran; say its reply was lost
    assert (await budget.state(tenant))["remaining_tokens"] == full - 100
    refund_if_admitted(harness.gw, harness.gw.domain(), tenant, "ran", 100)
    refund_if_admitted(harness.gw, harness.gw.domain(), tenant, "never-ran", 100)
    await harness.gw.drain()
    state = await budget.state(tenant)
    assert state["remaining_tokens"] == full and state["in_flight"] == 0


async def test_one_oversized_request_costs_its_tenant_nothing_more(harness: Harness) -> None:
    _, key = await harness.tenant("big")
    auth = {"authorization": f"Bearer {key}"}
    huge = {"model": harness.model, "prompt": "word " * 200_000, "max_tokens": 4}
    r = await harness.http.post("/v1/completions", json=huge, headers=auth)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    declared = {**auth, "content-type": "application/json", "content-length": str(10**12)}
    r = await harness.http.post("/v1/completions", content=b"{}", headers=declared)  # says 10**12, sends 2
    assert r.status_code == 413, r.text
    assert (await harness.complete(key)).status_code == 200  # the next request is served at once


async def test_a_tenant_that_keeps_sending_oversized_requests_is_held_and_no_other_is(harness: Harness) -> None:
    harness.gw.refusals = RefusalBucket(burst=2_900_000, bytes_per_s=2e5)  # three 1 MB refusals overflow it
    _, big = await harness.tenant("big")
    _, small = await harness.tenant("small")
    auth = {"authorization": f"Bearer {big}"}
    huge = {"model": harness.model, "prompt": "word " * 200_000, "max_tokens": 4}  # a megabyte, read
    statuses = [(await harness.http.post("/v1/completions", json=huge, headers=auth)).status_code for _ in range(5)]
    assert statuses == [400, 400, 400, 429, 429], statuses  # the burst, then held
    held = await harness.complete(big)  # refused before its body is read
    assert held.status_code == 429 and held.json()["error"]["code"] == "oversize_held", held.text
    wait = int(held.headers["retry-after"])
    assert 1 <= wait <= 2 and f"retry after {wait} s" in held.json()["error"]["message"], held.text
    bad = await harness.http.post("/v1/completions", content=b"{not json", headers=auth)
    assert bad.status_code == 400, bad.text  # a small malformed body gets its own 400 first
    assert (await harness.complete(small)).status_code == 200
    await asyncio.sleep(wait)
    assert (await harness.complete(big)).status_code == 200


async def test_close_stops_a_loop_whose_cancel_was_reported_as_a_redis_timeout(
    redis_url: str, prompts: PromptBuilder, model_spec: ModelSpec
) -> None:
    """A cancel that lands as a Redis call's own timeout fires comes out as that timeout
    (asyncio.timeout in 3.11, then redis-py's TimeoutError), which the loop would retry:
    the gateway must stop anyway."""
    from redis.exceptions import TimeoutError as RedisTimeout

    async with make_harness(redis_url, prompts, model_spec.name) as h:
        dispatcher = h.gw.domain().dispatcher

        async def renew_swallowing_cancel(replies: str, now: float | None = None) -> None:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                raise RedisTimeout("Timeout reading from socket") from None

        dispatcher.liveness.renew = renew_swallowing_cancel  # type: ignore[method-assign,assignment]
        await asyncio.sleep(1.0)  # the watch loop is now inside the patched call
        started = time.monotonic()
        await dispatcher.close()
        assert time.monotonic() - started < 2.0
        assert all(task.done() for task in dispatcher._tasks)


async def test_a_saturated_gateway_refuses_new_generations_at_once_and_recovers(harness: Harness) -> None:
    _, key = await harness.tenant("acme")
    assert (await harness.complete(key)).status_code == 200
    loop = asyncio.get_running_loop()
    hogging = True

    def hog() -> None:  # every turn of the loop now takes 40 ms of this process's CPU
        time.sleep(0.04)
        if hogging:
            loop.call_later(0.001, hog)

    sampler = asyncio.create_task(harness.gw.lag.run())  # as the app's lifespan starts it
    hog()
    await asyncio.sleep(0.4)
    r = await harness.complete(key)
    assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded", r.text
    assert "saturated" in r.json()["error"]["message"] and r.headers["retry-after"] == "1"
    assert (await harness.http.get("/healthz")).status_code == 200  # only new generations are shed
    hogging = False
    await asyncio.sleep(0.4)
    assert (await harness.complete(key)).status_code == 200
    sampler.cancel()
