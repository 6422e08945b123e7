"""Process behaviour: no worker means 503; Ctrl-C leaves no processes and no files."""

from __future__ import annotations

import os
import time
from pathlib import Path

import openai
import psutil
import pytest

from gateway.embedded_redis import EmbeddedRedis
from tests.e2e.conftest import ADMIN_TOKEN, start

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


def test_ctrl_c_stops_everything_and_leaves_no_files(tmp_path: Path) -> None:
    before = set(os.listdir("/tmp"))
    served = start(["serve", "--engine", "echo"], tmp_path)
    children = psutil.Process(served.proc.pid).children(recursive=True)
    assert any("redis-server" in " ".join(c.cmdline()) for c in children)
    assert any("workers" in " ".join(c.cmdline()) for c in children)
    assert served.stop() in (0, 130)  # 130: ended by Ctrl-C, by convention
    time.sleep(0.5)
    assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    leftovers = {f for f in set(os.listdir("/tmp")) - before if f.startswith("tokengate")}
    assert not leftovers
