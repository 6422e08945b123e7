"""A client that hangs up cancels its work: the worker frees the slot, the tenant pays what
was generated. The echo engine generates one token per 20 ms step, so timing is known."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import httpx
import pytest
import redis

from common import wire
from tests.e2e.conftest import ADMIN_TOKEN, Served, banner_key, start

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SLOTS = 4


@pytest.fixture(scope="module")
def echo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    s = start(
        ["serve", "--engine", "echo", "--echo-step-ms", "20", "--echo-tokens", "1000", "--slots", str(SLOTS),
         "--admin-token", ADMIN_TOKEN],
        tmp_path_factory.mktemp("echo"),
    )
    s.key = banner_key(s)
    yield s
    s.stop()


def _record(served: Served, rid: str) -> dict[str, object]:
    deadline = time.monotonic() + 15
    while True:
        record = httpx.get(f"{served.base_url}/v1/requests/{rid}", headers=served.auth()).json()
        if record["state"] != "admitted" or time.monotonic() > deadline:
            return record
        time.sleep(0.05)


def _request_ids(served: Served) -> list[str]:
    url = re.search(r"redis (redis://\S+)\)", served.log.read_text())
    assert url, "no Redis URL in the banner"
    client = redis.Redis.from_url(url.group(1))
    try:
        return [k.decode().rpartition(":req:")[2] for k in client.scan_iter(wire.request("*", "*"))]
    finally:
        client.close()


def _free_slots(served: Served) -> int:
    workers = httpx.get(served.base_url + "/admin/workers", headers=served.auth(ADMIN_TOKEN)).json()["data"]
    return int(workers[0]["free"])


def _all_slots_free(served: Served) -> bool:
    deadline = time.monotonic() + 5  # heartbeats come every second
    while time.monotonic() < deadline:
        if _free_slots(served) == SLOTS:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("stream", [False, True])
def test_hanging_up_stops_the_work_and_charges_what_was_generated(echo: Served, stream: bool) -> None:
    body = {"model": echo.model, "prompt": "count", "max_tokens": 1000, "stream": stream}
    url = echo.base_url + "/v1/completions"
    rid = None
    if stream:
        with httpx.stream("POST", url, json=body, headers=echo.auth()) as r:
            rid = r.headers["x-request-id"]
            for n, _line in enumerate(r.iter_lines()):
                if n > 20:
                    break  # about ten tokens in: hang up
    else:
        before = set(_request_ids(echo))
        try:
            httpx.post(url, json=body, headers=echo.auth(), timeout=0.6)
        except httpx.TimeoutException:
            pass
        # a client that hung up never saw its id: find it in the (private) Redis
        (rid,) = set(_request_ids(echo)) - before
    assert rid is not None
    record = _record(echo, rid)
    assert record["state"] == "cancelled"
    prompt, charged = int(record["prompt_tokens"]), int(record["charged_tokens"])  # type: ignore[call-overload]
    assert prompt < charged < prompt + 200  # some tokens, far from the 1000 asked for
    assert _all_slots_free(echo)
