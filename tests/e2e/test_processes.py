"""Process behaviour: no worker means 503; Ctrl-C leaves no processes and no files."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import openai
import psutil
import pytest

from gateway.cli.embedded_redis import EmbeddedRedis
from tests.e2e.conftest import ADMIN_TOKEN, banner_key, start

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_gateway_without_workers_answers_503(tmp_path: Path) -> None:
    with EmbeddedRedis() as redis:
        served = start(
            ["gateway", "--redis-url", redis.url, "--admin-token", ADMIN_TOKEN],
            tmp_path,
            ready_path="/healthz",
        )
        try:
            import httpx

            assert httpx.get(served.base_url + "/readyz").status_code == 503
            admin = served.auth(ADMIN_TOKEN)
            base = served.base_url
            body = {"name": "t", "rate": 100}
            tenant = httpx.post(base + "/admin/tenants", json=body, headers=admin)
            key = httpx.post(base + "/admin/tenants/t/keys", headers=admin).json()["key"]
            client = openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0)
            assert tenant.status_code == 201
            with pytest.raises(openai.InternalServerError) as info:
                client.chat.completions.create(model=served.model, messages=[{"role": "user", "content": "hi"}])
            assert info.value.status_code == 503
        finally:
            assert served.stop() in (0, 130)  # 130: ended by Ctrl-C, by convention


def test_ctrl_c_stops_everything_and_leaves_no_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    private_tmp = tmp_path / "tmpdir"  # its TMPDIR: other test runs on this machine share /tmp
    private_tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(private_tmp))
    served = start(["serve", "--engine", "echo"], tmp_path)
    children = psutil.Process(served.proc.pid).children(recursive=True)
    assert any("redis-server" in " ".join(c.cmdline()) for c in children)
    assert any("workers" in " ".join(c.cmdline()) for c in children)
    assert served.stop() == 0
    time.sleep(0.5)
    assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    assert not list(private_tmp.iterdir())


def test_ctrl_c_with_a_request_in_flight_ends_within_the_grace_time(tmp_path: Path) -> None:
    """A request that would run for 20 s does not hold the process past --shutdown-grace:
    the stream ends with an error event, the workers drain, and nothing is left running."""
    import httpx
    import orjson

    served = start(
        ["serve", "--engine", "echo", "--echo-step-ms", "20", "--echo-tokens", "1000",
         "--shutdown-grace", "1"],
        tmp_path,
    )
    served.key = banner_key(served)
    children = psutil.Process(served.proc.pid).children(recursive=True)
    body = {"model": served.model, "prompt": "count", "max_tokens": 1000, "stream": True}
    with httpx.stream("POST", served.base_url + "/v1/completions", json=body,
                      headers=served.auth(), timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        stopped_at = time.monotonic()
        served.proc.send_signal(signal.SIGINT)
        events = [line for line in lines if line.startswith("data:")]
        assert events and events[-1] != "data: [DONE]", "the 20 s stream was not cut at shutdown"
        assert orjson.loads(events[-1].removeprefix("data: "))["error"]["code"] == "shutting_down"
        assert served.proc.wait(timeout=40) == 0
    assert time.monotonic() - stopped_at < 30
    time.sleep(0.5)
    assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
