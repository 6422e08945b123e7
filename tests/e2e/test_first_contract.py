"""The first request after `make run` is promised a latency it keeps: the contract of a fresh
`tokengate serve` (packaged profile, no outcome seen yet) against what the request takes."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import banner_key, start

pytestmark = [pytest.mark.e2e, pytest.mark.model, pytest.mark.slow]


def test_the_first_request_after_serve_is_promised_within_twice_what_it_takes(tmp_path: Path) -> None:
    served = start(["serve"], tmp_path)  # what `make run` runs
    try:
        key = banner_key(served)
        # the README's request; greedy, so that its length (and this test) does not vary run to run
        body = {"model": served.model, "messages": [{"role": "user", "content": "Say hello in five words."}],
                "temperature": 0}
        t0 = time.perf_counter()
        r = httpx.post(served.base_url + "/v1/chat/completions", json=body,
                       headers={"authorization": f"Bearer {key}"}, timeout=120)
        took = time.perf_counter() - t0
        assert r.status_code == 200, r.text
        promised = float(r.headers["x-tokengate-latency-ms"]) / 1000
        bound = float(r.headers["x-tokengate-p99-ms"]) / 1000
        print(f"first request: promised {promised * 1000:.0f} ms (p99 {bound * 1000:.0f} ms), took "
              f"{took * 1000:.0f} ms, {r.json()['usage']['completion_tokens']} tokens "
              f"(assumed {r.headers['x-tokengate-output-tokens']})")
        assert promised / 2 <= took <= promised * 2
        assert took <= bound
    finally:
        served.stop()
