"""`tokengate gateway --model-from-workers` on a host without the model's files (issue 39): it
waits for a worker to publish its model's tokenizer in Redis, takes that worker's model name,
and counts tokens as a gateway with the model's directory does."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from common import tokenizer_bundle
from gateway.dispatch.prompts import PromptBuilder
from tests.e2e.conftest import ADMIN_TOKEN, launch, wait_ready
from workers.model_store import ModelSpec

pytestmark = [pytest.mark.e2e, pytest.mark.redis, pytest.mark.model]

NAME = "smol-from-the-workers"


def test_a_gateway_without_model_files_counts_tokens_with_the_tokenizer_a_worker_published(
        redis_url: str, model_spec: ModelSpec, tmp_path: Path) -> None:
    cache = tmp_path / "gateway-cache"  # nothing of the model's in it: the gateway gets it from Redis
    served = launch(["gateway", "--model-from-workers", "--redis-url", redis_url, "--admin-token", ADMIN_TOKEN,
                     "--cache-dir", str(cache)], tmp_path)
    worker = None
    try:
        time.sleep(1.0)  # the gateway waits for a worker, saying so, not serving
        assert served.proc.poll() is None, served.log.read_text()
        with open(tmp_path / "worker.log", "wb") as log:
            worker = subprocess.Popen(
                [sys.executable, "-m", "workers", "--redis-url", redis_url, "--engine", "echo", "--echo-tokens", "4",
                 "--model", str(model_spec.path), "--model-name", NAME], stdout=log, stderr=subprocess.STDOUT)
        wait_ready(served, timeout_s=120)
        packed = tokenizer_bundle.pack(model_spec.path)
        assert packed is not None
        assert (cache / "tokenizers" / packed[0] / "tokenizer.json").is_file(), served.log.read_text()
        assert f"model {NAME}: its tokenizer as worker" in served.log.read_text()

        admin = served.auth(ADMIN_TOKEN)
        body = {"name": "t", "rate": 1e6, "burst": 10**8}
        assert httpx.post(served.base_url + "/admin/tenants", json=body, headers=admin).status_code == 201
        key = httpx.post(served.base_url + "/admin/tenants/t/keys", headers=admin).json()["key"]
        models = httpx.get(served.base_url + "/v1/models", headers=served.auth(key)).json()
        assert [m["id"] for m in models["data"]] == [NAME]
        chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three colours."}]
        r = httpx.post(served.base_url + "/v1/chat/completions", headers=served.auth(key), timeout=60,
                       json={"model": NAME, "messages": chat, "max_tokens": 4})
        assert r.status_code == 200, r.text
        local = PromptBuilder.load(model_spec.path)
        assert r.json()["usage"]["prompt_tokens"] == len(local._ids(tuple((m["role"], m["content"]) for m in chat)))
    finally:
        if worker is not None:
            worker.terminate()
            worker.wait(timeout=30)
        served.proc.terminate()
        served.proc.wait(timeout=60)


def test_model_from_workers_with_a_local_model_is_refused(redis_url: str, tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "gateway.cli", "gateway", "--model-from-workers", "--model",
                           str(tmp_path), "--redis-url", redis_url], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "not with --model" in done.stderr + done.stdout
