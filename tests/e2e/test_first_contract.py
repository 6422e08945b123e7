"""The first requests after `make run` are promised latencies they keep: the contracts of a
fresh `tokengate serve` (its worker's profile measured at start, no outcome seen yet) against
what the requests take."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import banner_key, start

pytestmark = [pytest.mark.e2e, pytest.mark.model, pytest.mark.slow]


def test_the_first_request_after_serve_is_promised_within_twice_what_it_takes(tmp_path: Path) -> None:
    # what `make run` runs on a fresh machine: no profile stored by another test (measured under
    # whatever ran beside it) to re-check; the worker measures its engine at start
    served = start(["serve", "--profile-dir", str(tmp_path / "profiles")], tmp_path)
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
        # a long prompt, one token out: its first token priced by the measured prefill, attention's growth in
        words = " ".join(["the river moves slowly past old stone houses and green fields"] * 200)
        body = {"model": served.model, "prompt": words, "max_tokens": 1, "temperature": 0}
        t0 = time.perf_counter()
        r = httpx.post(served.base_url + "/v1/completions", json=body, headers={"authorization": f"Bearer {key}"},
                       timeout=120)
        took = time.perf_counter() - t0
        assert r.status_code == 200, r.text
        promised = float(r.headers["x-tokengate-ttft-ms"]) / 1000
        print(f"{r.json()['usage']['prompt_tokens']}-token prompt: first token promised {promised * 1000:.0f} ms "
              f"(p99 {r.headers['x-tokengate-ttft-p99-ms']} ms), took {took * 1000:.0f} ms")
        # within 2x, as the first request: the 1.5x target is bench.first_request's, over ten
        # starts; here the worker measured itself while this test's gateway was starting on
        # the same two cores, which once read 1.5x slow (promised 3.0 s, took 2.0 s)
        assert promised / 2 <= took <= promised * 2
        assert took <= float(r.headers["x-tokengate-ttft-p99-ms"]) / 1000
    finally:
        served.stop()
