"""A second real model built at test time (``bench.second_model``: a small random-weights Llama
beside SmolLM2's tokenizer) served beside the packaged SmolLM2 by one `tokengate serve` (issue
39): one endpoint, one worker per model, each request answered by its model's worker."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from bench import second_model
from gateway.dispatch.prompts import PromptBuilder
from tests.e2e.conftest import ADMIN_TOKEN, banner_match, start
from workers.model_store import ModelSpec

pytestmark = [pytest.mark.e2e, pytest.mark.model]


def test_serve_runs_two_models_behind_one_endpoint(model_spec: ModelSpec, tmp_path: Path) -> None:
    spec = second_model.build(tmp_path / "second", model_spec.path, layers=2, hidden=128)
    config, packaged = (json.loads((d / "config.json").read_text()) for d in (spec.path, model_spec.path))
    assert config["num_hidden_layers"] == 2 < packaged["num_hidden_layers"]  # another shape, the same vocabulary
    assert config["hidden_size"] == 128 < packaged["hidden_size"] and config["vocab_size"] == packaged["vocab_size"]
    served = start(["serve", "--admin-token", ADMIN_TOKEN, "--slots", "2", "--profile-s", "3",
                    "--model", str(model_spec.path), "--model-name", model_spec.name,
                    "--model", str(spec.path), "--model-name", spec.name], tmp_path, timeout_s=300)
    try:
        banner_match(served, rf"models {model_spec.name}, {spec.name};", timeout_s=120)
        admin = served.auth(ADMIN_TOKEN)
        deadline = time.monotonic() + 180  # /readyz answers once the first worker is up; the other follows
        while {m for m, v in httpx.get(served.base_url + "/readyz").json()["models"].items() if v["workers"]} != {
                model_spec.name, spec.name}:
            assert time.monotonic() < deadline, served.log.read_text()[-4000:]
            time.sleep(0.5)
        workers = httpx.get(served.base_url + "/admin/workers", headers=admin).json()
        assert sorted(w["model"] for w in workers["data"]) == sorted([model_spec.name, spec.name]), workers
        assert httpx.post(served.base_url + "/admin/tenants", json={"name": "t", "rate": 1e6, "burst": 10**8},
                          headers=admin).status_code == 201
        key = httpx.post(served.base_url + "/admin/tenants/t/keys", headers=admin).json()["key"]
        listed = httpx.get(served.base_url + "/v1/models", headers=served.auth(key)).json()
        assert [m["id"] for m in listed["data"]] == [model_spec.name, spec.name]
        chat = [{"role": "user", "content": "Say hello."}]
        local = PromptBuilder.load(model_spec.path)
        for name in (model_spec.name, spec.name):
            r = httpx.post(served.base_url + "/v1/chat/completions", headers=served.auth(key), timeout=120,
                           json={"model": name, "messages": chat, "max_tokens": 8, "temperature": 0})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["model"] == name and 0 < body["usage"]["completion_tokens"] <= 8
            assert body["usage"]["prompt_tokens"] == len(local._ids((("user", "Say hello."),)))
        for name in (model_spec.name, spec.name):  # each model's scheduler sent its job to its own worker
            view = httpx.get(served.base_url + "/admin/scheduler", params={"model": name}, headers=admin).json()
            assert view["model"] == name and view["role"] == "scheduler"
        metrics = httpx.get(served.base_url + "/metrics").text
        for name in (model_spec.name, spec.name):
            assert f'tokengate_admitted_total{{model="{name}"}} 1.0' in metrics
        # the fleet's profiles, per model, and each model's domain simulated on them
        measured = {w["model"]: w["profile"]["name"] for w in workers["data"]}
        fleet = tmp_path / "fleet.json"
        cli = [sys.executable, "-m", "gateway.cli"]
        exported = subprocess.run([*cli, "workers", "profiles", "--url", served.base_url, "--admin-token", ADMIN_TOKEN,
                                   "--out", str(fleet)], capture_output=True, text=True, timeout=120)
        assert exported.returncode == 0, exported.stderr
        assert {m: pools["cpu"]["name"] for m, pools in json.loads(fleet.read_text()).items()} == measured
        sim = subprocess.run([*cli, "simulate", "--fleet", str(fleet), "--fleet-model", "all", "--requests", "60",
                              "--rates", "4", "--policies", "fcfs", "--gpu-workers", "0", "--no-plots", "--json",
                              "--out", str(tmp_path / "sim")], capture_output=True, text=True, timeout=300)
        assert sim.returncode == 0, sim.stderr
        assert {r["model"]: r["profiles"]["cpu"]["name"] for r in map(json.loads, sim.stdout.splitlines())} == measured
    finally:
        served.proc.terminate()
        served.proc.wait(timeout=60)
