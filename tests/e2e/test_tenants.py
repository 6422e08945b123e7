"""Tenants across replicas: three `tokengate gateway` processes on one real Redis with an
echo worker. Isolation, the openai client on 429, the CLI, and one budget shared by all."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import pytest

from gateway.cli.embedded_redis import EmbeddedRedis
from tests.e2e.conftest import ADMIN_TOKEN, Served, launch, wait_ready
from workers.model_store import ModelSpec

pytestmark = [pytest.mark.e2e, pytest.mark.redis]

ECHO_TOKENS = 16


@dataclass
class Cluster:
    redis_url: str
    gateways: list[Served]
    model: str
    keys: dict[str, str] = field(default_factory=dict)

    def admin(self, method: str, path: str, body: Any = None, gw: int = 0) -> httpx.Response:
        return httpx.request(
            method,
            self.gateways[gw].base_url + "/admin" + path,
            json=body,
            headers={"authorization": f"Bearer {ADMIN_TOKEN}"},
            timeout=30,
        )

    def tenant(self, name: str, **fields: Any) -> tuple[dict[str, Any], str]:
        r = self.admin("POST", "/tenants", {"name": name, **fields})
        assert r.status_code == 201, r.text
        k = self.admin("POST", f"/tenants/{name}/keys", {"name": "e2e"})
        assert k.status_code == 201, k.text
        return r.json(), k.json()["key"]

    def completion(self, key: str | None, gw: int = 0, **body: Any) -> httpx.Response:
        doc = {"model": self.model, "prompt": list(range(1, 25)), "max_tokens": ECHO_TOKENS, **body}
        headers = {"authorization": f"Bearer {key}"} if key else {}
        return httpx.post(
            self.gateways[gw].base_url + "/v1/completions", json=doc, headers=headers, timeout=30
        )


@pytest.fixture(scope="module")
def cluster(model_spec: ModelSpec, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("cluster")
    with EmbeddedRedis() as redis, open(tmp / "worker.log", "w") as worker_log:
        worker = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "workers",
                "--redis-url",
                redis.url,
                "--engine",
                "echo",
                "--echo-tokens",
                str(ECHO_TOKENS),
                "--slots",
                "256",
            ],
            stdout=worker_log,
            stderr=subprocess.STDOUT,
        )
        gateways = [
            launch(["gateway", "--redis-url", redis.url, "--admin-token", ADMIN_TOKEN], tmp)
            for _ in range(3)
        ]
        try:
            for g in gateways:
                wait_ready(g)
            yield Cluster(redis.url, gateways, model_spec.name)
        finally:
            _stop_all(gateways, worker)


def _stop_all(gateways: list[Served], worker: subprocess.Popen[bytes]) -> None:
    """Ctrl-C to every gateway at once, then the worker; a process that hangs is killed and
    reported with its log."""
    for g in gateways:
        if g.proc.poll() is None:
            g.proc.send_signal(signal.SIGINT)
    worker.terminate()
    hung = []
    for proc, log in [(g.proc, g.log) for g in gateways] + [(worker, None)]:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)  # faulthandler writes every thread's stack to the log
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            hung.append(log.read_text()[-3000:] if log else "the worker")
    assert not hung, "did not stop within 30 s:\n" + "\n---\n".join(hung)


# -- isolation -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def world(cluster: Cluster) -> dict[str, str]:
    """Tenants a and b with a key each, a request of a's, and the kinds of bad credentials."""
    _, a = cluster.tenant("iso-a", rate=1000)
    _, b = cluster.tenant("iso-b", rate=1000)
    _, revoked = cluster.tenant("iso-c", rate=1000)
    assert cluster.completion(revoked).status_code == 200
    assert cluster.admin("DELETE", f"/keys/{revoked[3:11]}", gw=2).status_code == 200
    r = cluster.completion(a, gw=1)
    assert r.status_code == 200
    return {
        "a": a,
        "b": b,
        "revoked": revoked,
        "rid_a": r.headers["x-request-id"],
        "response_a": r.json()["id"],
        "unknown": "tg-0123abcd-" + "A" * 43,
        "malformed": "sk-not-ours",
        "admin": ADMIN_TOKEN,
    }


def _call(cluster: Cluster, gw: int, method: str, path: str, token: str | None) -> httpx.Response:
    body = {
        "model": cluster.model,
        "prompt": [1, 2, 3],
        "max_tokens": 2,
        "name": "x",
        "rate": 1,
        "messages": [{"role": "user", "content": "hi"}],
    }
    headers = {"authorization": f"Bearer {token}"} if token is not None else {}
    return httpx.request(
        method,
        cluster.gateways[gw].base_url + path,
        json=body if method in ("POST", "PATCH") else None,
        headers=headers,
        timeout=30,
    )


KEYED = [
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("GET", "/v1/models"),
    ("GET", "/v1/requests/{rid_a}"),
]
ADMIN = [
    ("POST", "/admin/tenants"),
    ("GET", "/admin/tenants"),
    ("GET", "/admin/tenants/iso-a"),
    ("PATCH", "/admin/tenants/iso-a"),
    ("DELETE", "/admin/tenants/iso-a"),
    ("GET", "/admin/tenants/iso-a/usage"),
    ("POST", "/admin/tenants/iso-a/keys"),
    ("GET", "/admin/tenants/iso-a/keys"),
    ("DELETE", "/admin/keys/{prefix_a}"),
    ("GET", "/admin/workers"),
    ("GET", "/admin/scheduler"),
]


@pytest.mark.parametrize(("method", "path"), KEYED)
@pytest.mark.parametrize("cred", [None, "malformed", "unknown", "revoked", "admin"])
def test_openai_routes_refuse_bad_keys_on_every_replica(
    cluster: Cluster, world: dict[str, str], method: str, path: str, cred: str | None
) -> None:
    for gw in range(3):
        r = _call(cluster, gw, method, path.format(**world), None if cred is None else world[cred])
        assert r.status_code == 401, (gw, r.text)
        assert r.json()["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize("ref", ["rid_a", "response_a"])
def test_a_request_is_visible_to_its_tenant_only(
    cluster: Cluster, world: dict[str, str], ref: str
) -> None:
    for gw in range(3):
        own = _call(cluster, gw, "GET", f"/v1/requests/{world[ref]}", world["a"])
        assert own.status_code == 200 and own.json()["state"] == "done"
        other = _call(cluster, gw, "GET", f"/v1/requests/{world[ref]}", world["b"])
        assert other.status_code == 404 and other.json()["error"]["code"] == "not_found"
        assert world["rid_a"] not in json.dumps(other.json()).replace(world[ref], "")


@pytest.mark.parametrize(("method", "path"), ADMIN)
@pytest.mark.parametrize("cred", [None, "malformed", "a", "b"])
def test_admin_routes_refuse_anything_but_the_admin_token(
    cluster: Cluster, world: dict[str, str], method: str, path: str, cred: str | None
) -> None:
    path = path.format(prefix_a=world["a"][3:11])
    for gw in range(3):
        r = _call(cluster, gw, method, path, None if cred is None else world[cred])
        assert r.status_code == 401, (gw, r.text)
    assert cluster.admin("GET", "/tenants/iso-a").status_code == 200  # nothing was changed
    assert cluster.completion(world["a"]).status_code == 200


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/tenants/{t}"),
        ("PATCH", "/tenants/{t}"),
        ("DELETE", "/tenants/{t}"),
        ("GET", "/tenants/{t}/usage"),
        ("POST", "/tenants/{t}/keys"),
        ("GET", "/tenants/{t}/keys"),
        ("DELETE", "/keys/{p}"),
    ],
)
def test_admin_routes_answer_404_for_unknown_ids(cluster: Cluster, method: str, path: str) -> None:
    for t, p in (
        ("nobody", "0123abcd"),
        ("tn_0123456789abcdef", "zz"),
        ("x%2Fy" + "a" * 300, "0123abcd0"),
    ):
        r = cluster.admin(method, path.format(t=t, p=p), {"rate": 5} if method == "PATCH" else None)
        assert r.status_code == 404, (path, t, r.text)


def test_a_revocation_on_one_replica_holds_on_all_at_once(cluster: Cluster) -> None:
    _, key = cluster.tenant("revoke-me", rate=1000)
    assert all(cluster.completion(key, gw=i).status_code == 200 for i in range(3))
    assert cluster.admin("DELETE", f"/keys/{key[3:11]}", gw=1).status_code == 200
    assert [cluster.completion(key, gw=i).status_code for i in range(3)] == [401, 401, 401]


# -- the official client -------------------------------------------------------------------


def test_openai_client_reads_headers_and_raises_rate_limit_error(cluster: Cluster) -> None:
    _, key = cluster.tenant("oai", rate=1, burst=60, max_queue_delay_s=0,
                            limits={"max_prompt_tokens": 30, "max_output_tokens": 30})
    client = openai.OpenAI(
        base_url=cluster.gateways[0].base_url + "/v1", api_key=key, max_retries=0
    )
    prompt = list(range(1, 31))  # 30 tokens + 16 generated: each request uses 46 of the 60
    raw = client.completions.with_raw_response.create(
        model=cluster.model, prompt=prompt, max_tokens=16
    )
    assert raw.headers["x-ratelimit-limit-tokens"] == "60"
    assert raw.headers["x-ratelimit-remaining-tokens"] == "14"
    assert raw.headers["x-ratelimit-reset-tokens"].endswith("s")
    assert raw.parse().usage.completion_tokens == ECHO_TOKENS  # type: ignore[union-attr]
    with pytest.raises(openai.RateLimitError) as info:
        client.completions.create(model=cluster.model, prompt=prompt, max_tokens=16)
    err = info.value
    assert err.status_code == 429 and err.code == "rate_limit_exceeded"
    assert int(err.response.headers["retry-after"]) >= 1
    assert "x-ratelimit-remaining-tokens" in err.response.headers


# -- the command line ----------------------------------------------------------------------


def _usage_totals(cluster: Cluster, tenant: str, done: Callable[[dict[str, int]], bool],
                  gw: int = 1) -> dict[str, int]:
    """The tenant's usage totals as gateway ``gw`` reads them, once ``done`` holds or after 5 s:
    every gateway writes its counts once a second (``gateway.tenancy.usage.UsageBook``)."""
    deadline = time.monotonic() + 5
    while True:
        r = cluster.admin("GET", f"/tenants/{tenant}/usage", gw=gw)
        assert r.status_code == 200, r.text
        totals: dict[str, int] = r.json()["totals"]
        if done(totals) or time.monotonic() > deadline:
            return totals
        time.sleep(0.2)


def _cli(cluster: Cluster, *argv: str, token: str = ADMIN_TOKEN) -> tuple[int, Any, str]:
    env = {
        **os.environ,
        "TOKENGATE_URL": cluster.gateways[2].base_url,
        "TOKENGATE_ADMIN_TOKEN": token,
    }
    done = subprocess.run(
        [sys.executable, "-m", "gateway.cli", *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    return done.returncode, json.loads(done.stdout) if done.returncode == 0 else None, done.stderr


def test_cli_drives_the_admin_api(cluster: Cluster) -> None:
    rc, t, _ = _cli(cluster, "tenants", "create", "cli-co", "--rate", "50", "--max-concurrent", "4")
    assert rc == 0 and t["name"] == "cli-co" and t["limits"]["max_concurrent"] == 4
    assert t["burst"] == 8192  # 10 s of its rate is 500: the default holds one request of the whole context
    rc, _, err = _cli(cluster, "tenants", "update", "cli-co", "--burst", "900")  # then every longer one is refused
    assert rc == 1 and "burst 900 cannot hold one request of up to 8192 tokens" in err and "(HTTP 400)" in err
    assert "raise burst (--burst) to at least 8192" in err and "--max-prompt-tokens" in err
    rc, t, _ = _cli(
        cluster, "tenants", "update", "cli-co", "--burst", "900", "--max-concurrent", "none",
        "--max-prompt-tokens", "700", "--max-output-tokens", "200",
    )
    assert rc == 0 and t["burst"] == 900 and t["limits"]["max_concurrent"] is None
    rc, issued, _ = _cli(cluster, "keys", "issue", "cli-co", "--name", "laptop")
    assert rc == 0 and issued["key"].startswith("tg-")
    assert cluster.completion(issued["key"]).status_code == 200
    rc, listed, _ = _cli(cluster, "keys", "list", "cli-co")
    assert [k["prefix"] for k in listed["data"]] == [issued["prefix"]] and "key" not in listed[
        "data"
    ][0]
    # the request went through gateway 0, the CLI asks gateway 2 (which writes its own counts
    # first): gateway 0 writes its usage counts within a second
    _usage_totals(cluster, "cli-co", lambda t: t["requests"] == 1)
    rc, usage, _ = _cli(cluster, "tenants", "usage", "cli-co", "--json")
    assert rc == 0 and usage["totals"]["requests"] == 1
    env = {**os.environ, "TOKENGATE_URL": cluster.gateways[2].base_url, "TOKENGATE_ADMIN_TOKEN": ADMIN_TOKEN}
    table = subprocess.run([sys.executable, "-m", "gateway.cli", "tenants", "usage", "cli-co"],
                           capture_output=True, text=True, env=env, timeout=60)
    assert table.returncode == 0 and "minute (UTC)" in table.stdout and "total" in table.stdout, table.stdout
    rc, _, _ = _cli(cluster, "keys", "revoke", issued["prefix"])
    assert rc == 0 and cluster.completion(issued["key"]).status_code == 401
    rc, _, err = _cli(cluster, "tenants", "get", "no-such-tenant")
    assert rc == 1 and "No tenant 'no-such-tenant'" in err and "404" in err
    rc, _, err = _cli(cluster, "tenants", "list", token="not-the-admin-token")
    assert rc == 1 and "401" in err
    rc, gone, _ = _cli(cluster, "tenants", "delete", "cli-co")
    assert rc == 0 and gone["deleted"] is True


# -- one budget, three replicas ------------------------------------------------------------


async def _drive(
    cluster: Cluster, key: str, interval_s: float, duration_s: float
) -> list[tuple[float, int, int]]:
    """Open-loop load: a request every ``interval_s`` for ``duration_s``, round-robin over the
    replicas; (answered at, status, total tokens) per request."""
    results: list[tuple[float, int, int]] = []
    loop = asyncio.get_running_loop()
    body = {"model": cluster.model, "prompt": list(range(1, 25)), "max_tokens": ECHO_TOKENS}

    async def one(http: httpx.AsyncClient, gw: Served) -> None:
        r = await http.post(
            gw.base_url + "/v1/completions", json=body, headers={"authorization": f"Bearer {key}"}
        )
        tokens = r.json()["usage"]["total_tokens"] if r.status_code == 200 else 0
        results.append((loop.time(), r.status_code, tokens))

    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=200)) as http:
        start = loop.time()
        tasks = []
        i = 0
        while (t := start + i * interval_s) < start + duration_s:
            await asyncio.sleep(max(0.0, t - loop.time()))
            tasks.append(asyncio.create_task(one(http, cluster.gateways[i % 3])))
            i += 1
        await asyncio.gather(*tasks)
    return results


@pytest.mark.slow
def test_one_budget_is_shared_by_three_replicas(cluster: Cluster) -> None:
    rate, burst, cost = 150.0, 300, 24 + ECHO_TOKENS  # every request reserves and uses 40 tokens
    small = {"max_prompt_tokens": 100, "max_output_tokens": 100}  # a burst of 300 holds the largest request
    hot, hot_key = cluster.tenant("hot", rate=rate, burst=burst, max_queue_delay_s=0.5, limits=small)
    _, calm_key = cluster.tenant("calm", rate=400, burst=800, max_queue_delay_s=0, limits=small)

    async def both() -> tuple[list[tuple[float, int, int]], list[tuple[float, int, int]], float]:
        start = asyncio.get_running_loop().time()
        hot_run, calm_run = await asyncio.gather(
            _drive(cluster, hot_key, cost / (3 * rate), 20.0),  # three times the budget
            _drive(cluster, calm_key, 0.2, 20.0),  # half the budget
        )
        return hot_run, calm_run, start

    hot_run, calm_run, start = asyncio.run(both())
    admitted = sum(tokens for _, status, tokens in hot_run if status == 200)
    last = max(t for t, status, _ in hot_run if status == 200)
    statuses = {status for _, status, _ in hot_run}
    bound = rate * (last - start) + burst + cost
    summary = f"admitted {admitted} tokens in {last - start:.2f} s, bound {bound:.0f}, {statuses}"
    print(summary)
    assert statuses == {200, 429}, summary
    assert burst <= admitted <= bound, summary
    assert [s for _, s, _ in calm_run if s != 200] == []
    refused = sum(1 for _, s, _ in hot_run if s == 429)
    totals = _usage_totals(cluster, hot["id"], lambda t: t["total_tokens"] == admitted and t["rate_limited"] == refused)
    assert totals["total_tokens"] == admitted
    assert totals["rate_limited"] == refused
