"""What a client is told about its budget: headers, 429 bodies, and what it is charged."""

from __future__ import annotations

import math
import re

import orjson
from hypothesis import given
from hypothesis import strategies as st

from common import protocol as p
from gateway.dispatch.meter import Meter
from gateway.errors import GatewayError, InvalidRequest, error_response
from gateway.tenancy.budget import headers, refusal
from gateway.tenancy.gcra import Verdict
from gateway.tenancy.tenants import Limits, Tenant

T = Tenant("tn_0000000000000000", "acme", 10.0, 100, limits=Limits(max_concurrent=4))


def test_rate_limit_headers_follow_openai() -> None:
    h = headers(T, Verdict("ok", 1000.0, 1002.5, 0.0, 3))
    assert h == {
        "x-ratelimit-limit-tokens": "100",
        "x-ratelimit-remaining-tokens": "75",
        "x-ratelimit-reset-tokens": "2.5s",
        "x-ratelimit-limit-requests": "4",
        "x-ratelimit-remaining-requests": "1",
    }
    plain = Tenant("tn_0000000000000000", "b", 10.0, 100)
    assert "x-ratelimit-limit-requests" not in headers(plain, Verdict("ok", 0.0, 0.0, 0.0, 1))


def _body(err: GatewayError) -> dict[str, object]:
    body: dict[str, object] = orjson.loads(error_response(err).body)["error"]
    return body


def test_over_budget_is_429_tokens_with_retry_after() -> None:
    err = refusal(T, Verdict("budget", 1000.0, 1010.0, 3.2, 0), cost=42, max_wait=1.0)
    assert err.status == 429 and err.headers["retry-after"] == "3"
    assert err.headers["x-ratelimit-remaining-tokens"] == "0"
    body = _body(err)
    assert body["code"] == "rate_limit_exceeded" and body["type"] == "tokens"
    assert body["budget_wait_s"] == 3.2 and "acme" in str(body["message"])


def test_over_concurrency_is_429_requests() -> None:
    err = refusal(T, Verdict("concurrency", 1000.0, 1000.0, 0.0, 4), cost=1, max_wait=0.0)
    assert err.status == 429 and _body(err)["type"] == "requests"
    assert err.headers["x-ratelimit-remaining-requests"] == "0"


def _retry_in_message(err: GatewayError) -> tuple[str, list[str]]:
    """The Retry-After header as sent, and every "retry after N s" figure of the message."""
    response = error_response(err)
    message = str(_body(err)["message"])
    return response.headers["retry-after"], re.findall(r"[Rr]etry after (\S+) s\b", message)


def test_the_reported_429_says_what_its_header_says() -> None:
    """Issue 23: "frees in 3.09 s ... Retry after 2 s" read as a contradiction."""
    tenant = Tenant("tn_0000000000000000", "demo", 1000.0, 2000)
    err = refusal(tenant, Verdict("budget", 1000.0, 1005.09, 3.09, 0), cost=5000, max_wait=2.0)
    header, said = _retry_in_message(err)
    assert header == "2" and said == ["2"]
    assert "would hold it 3.09 s, longer than the 2 s it may wait" in err.message
    assert "it would then wait at most the 2 s it may" in err.message


@given(wait=st.floats(0.0, 1e5, allow_nan=False), max_wait=st.floats(0.0, 300.0, allow_nan=False))
def test_every_budget_429_states_its_retry_after_figure(wait: float, max_wait: float) -> None:
    err = refusal(T, Verdict("budget", 1000.0, 1000.0 + wait, wait, 0), cost=42, max_wait=max_wait)
    header, said = _retry_in_message(err)
    assert said == [header] and int(header) == max(1, math.ceil(wait - max_wait))


def test_the_concurrency_429_states_its_retry_after_figure() -> None:
    header, said = _retry_in_message(refusal(T, Verdict("concurrency", 1000.0, 1000.0, 0.0, 4), cost=1, max_wait=0.0))
    assert said == [header] == ["1"]


def test_larger_than_the_burst_is_400() -> None:
    err = refusal(T, Verdict("too_large", 1000.0, 1000.0, 0.0, 0), cost=101, max_wait=0.0)
    assert isinstance(err, InvalidRequest) and err.code == "budget_exceeded"


def test_a_finished_request_is_charged_what_the_worker_reports() -> None:
    m = Meter(prompt_tokens=10, started=True)
    m.observe(p.Delta("r", "a", 1))
    m.observe(p.Finished("r", "", "stop", 12, 5))
    assert m.outcome == "done" and m.charge() == (12, 5)


def test_a_cut_stream_pays_its_prompt_and_what_was_generated() -> None:
    m = Meter(prompt_tokens=10, started=True)
    for i in range(1, 4):
        m.observe(p.Delta("r", "a", i))
    assert m.outcome == "cancelled" and m.charge() == (10, 3)


def test_failures_and_requests_that_never_started_cost_nothing() -> None:
    failed = Meter(prompt_tokens=10, started=True)
    failed.observe(p.Delta("r", "a", 1))
    failed.observe(p.Failed("r", "oom", "x"))
    assert failed.charge() == (0, 0)
    timed_out = Meter(prompt_tokens=10, started=True)
    timed_out.fail()
    assert timed_out.charge() == (0, 0)
    assert Meter(prompt_tokens=10).charge() == (0, 0)
