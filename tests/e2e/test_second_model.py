"""A second real model built at test time (``bench.second_model``: a small random-weights Llama
beside SmolLM2's tokenizer) served by a real worker, through a gateway that has no model files
(``--model-from-workers``): it serves the worker's model name and counts tokens as SmolLM2's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from bench import second_model
from gateway.dispatch.prompts import PromptBuilder
from tests.e2e.conftest import ADMIN_TOKEN, launch, wait_ready
from workers.model_store import ModelSpec

pytestmark = [pytest.mark.e2e, pytest.mark.redis, pytest.mark.model]


def test_a_random_llama_built_here_is_served_by_a_real_worker(redis_url: str, model_spec: ModelSpec,
                                                             tmp_path: Path) -> None:
    spec = second_model.build(tmp_path / "second", model_spec.path, layers=2, hidden=128)
    config, packaged = (json.loads((d / "config.json").read_text()) for d in (spec.path, model_spec.path))
    assert config["num_hidden_layers"] == 2 < packaged["num_hidden_layers"]  # another shape, the same vocabulary
    assert config["hidden_size"] == 128 < packaged["hidden_size"] and config["vocab_size"] == packaged["vocab_size"]
    with open(tmp_path / "worker.log", "wb") as log:
        worker = subprocess.Popen(
            [sys.executable, "-m", "workers", "--redis-url", redis_url, "--model", str(spec.path),
             "--model-name", spec.name, "--slots", "2", "--profile-s", "3"], stdout=log, stderr=subprocess.STDOUT)
    served = launch(["gateway", "--model-from-workers", "--redis-url", redis_url, "--admin-token", ADMIN_TOKEN,
                     "--cache-dir", str(tmp_path / "gateway-cache")], tmp_path)
    try:
        wait_ready(served, timeout_s=180)
        admin = served.auth(ADMIN_TOKEN)
        assert httpx.post(served.base_url + "/admin/tenants", json={"name": "t", "rate": 1e6, "burst": 10**8},
                          headers=admin).status_code == 201
        key = httpx.post(served.base_url + "/admin/tenants/t/keys", headers=admin).json()["key"]
        chat = [{"role": "user", "content": "Say hello."}]
        r = httpx.post(served.base_url + "/v1/chat/completions", headers=served.auth(key), timeout=120,
                       json={"model": spec.name, "messages": chat, "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["model"] == spec.name and 0 < body["usage"]["completion_tokens"] <= 8
        local = PromptBuilder.load(model_spec.path)
        assert body["usage"]["prompt_tokens"] == len(local._ids((("user", "Say hello."),)))
        workers = httpx.get(served.base_url + "/admin/workers", headers=admin).json()
        assert {w["model"] for w in workers["data"]} == {spec.name}, workers
    finally:
        worker.terminate()
        worker.wait(timeout=60)
        served.proc.terminate()
        served.proc.wait(timeout=60)
