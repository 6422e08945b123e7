"""`serve` under faults: a killed redis-server or worker is started again, and tenants and keys
live in the data directory (they survive a Redis crash and a restart of `serve`), as do the
admin token and the demo key it prints."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import psutil
import pytest

from gateway.cli import serve_state
from gateway.cli.embedded_redis import EmbeddedRedis
from tests.e2e.conftest import ADMIN_TOKEN, Served, banner_admin_token, banner_key, start

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _child(served: Served, marker: str) -> psutil.Process:
    found = [c for c in psutil.Process(served.proc.pid).children(recursive=True) if marker in " ".join(c.cmdline())]
    assert len(found) == 1, found
    return found[0]


def _listens_on(redis_server: psutil.Process) -> str:
    """redis-server's process title: "<binary> <host>:<port>"; "" until redis-server has set
    it (a process just started still shows the command line it was started with)."""
    return next((word for word in " ".join(redis_server.cmdline()).split() if word.startswith("127.0.0.1:")), "")


def _eventually(check: Callable[[], bool], what: str, served: Served, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except (httpx.HTTPError, psutil.Error, AssertionError):
            pass
        time.sleep(0.1)
    raise AssertionError(f"{what} within {timeout_s} s:\n{served.log.read_text()[-4000:]}")


def _completes(served: Served, key: str) -> bool:
    body = {"model": served.model, "prompt": "hi", "max_tokens": 4}
    r = httpx.post(served.base_url + "/v1/completions", json=body, headers=served.auth(key), timeout=10)
    return r.status_code == 200


def _authenticates(served: Served, key: str) -> bool:
    return httpx.get(served.base_url + "/v1/models", headers=served.auth(key), timeout=5).status_code == 200


def test_a_killed_redis_server_comes_back_with_its_tenants_and_keys(tmp_path: Path) -> None:
    data = tmp_path / "data"
    args = ["serve", "--engine", "echo", "--admin-token", ADMIN_TOKEN, "--data-dir", str(data)]
    served = start(args, tmp_path)
    try:
        admin = served.auth(ADMIN_TOKEN)
        made = httpx.post(served.base_url + "/admin/tenants", json={"name": "acme", "rate": 1000}, headers=admin)
        assert made.status_code == 201, made.text
        key = httpx.post(served.base_url + "/admin/tenants/acme/keys", headers=admin).json()["key"]
        assert _completes(served, key)

        redis_server = _child(served, "redis-server")
        address = _listens_on(redis_server)
        assert address, redis_server.cmdline()  # serve is ready: its redis-server has set its title
        redis_server.send_signal(signal.SIGKILL)
        redis_server.wait(5)

        def back() -> bool:
            again = _child(served, "redis-server")
            return again.pid != redis_server.pid and _listens_on(again) == address

        _eventually(back, "redis-server started again on the same port", served)
        _eventually(lambda: _authenticates(served, key), "the key authenticates after the Redis restart", served)
        _eventually(lambda: _completes(served, key), "a completion after the Redis restart", served)
        assert "redis-server (port" in served.log.read_text() and "exited with signal 9" in served.log.read_text()
    finally:
        assert served.stop() == 0

    again = start(args, tmp_path)  # a new `serve` on the same data directory
    try:
        assert _authenticates(again, key)
        assert _completes(again, key)
    finally:
        assert again.stop() == 0


def test_a_killed_worker_is_started_again(tmp_path: Path) -> None:
    served = start(["serve", "--engine", "echo", "--heartbeat-ttl", "2", "--admin-token", ADMIN_TOKEN], tmp_path)
    served.key = banner_key(served)
    try:
        worker = _child(served, "-m workers")
        worker.send_signal(signal.SIGKILL)
        worker.wait(5)

        def only_the_new_worker_beats() -> bool:
            new = _child(served, "-m workers")
            beats = httpx.get(served.base_url + "/admin/workers", headers=served.auth(ADMIN_TOKEN)).json()["data"]
            return new.pid != worker.pid and [b["worker"].rsplit("-", 1)[-1] for b in beats] == [str(new.pid)]

        _eventually(only_the_new_worker_beats, "a new worker, and the dead one's heartbeat gone", served)
        assert httpx.get(served.base_url + "/readyz").status_code == 200
        _eventually(lambda: _completes(served, served.key), "a completion on the new worker", served)
        assert "worker (pool cpu) exited with signal 9" in served.log.read_text()
    finally:
        assert served.stop() == 0


def _admin_ok(served: Served, token: str) -> bool:
    return httpx.get(served.base_url + "/admin/tenants", headers=served.auth(token), timeout=5).status_code == 200


def _secrets(args: list[str], tmp_path: Path) -> tuple[str, str]:
    """(admin token, demo key) a `serve` prints, checked against it, then stopped."""
    served = start(args, tmp_path)
    try:
        token, key = banner_admin_token(served), banner_key(served)
        assert _admin_ok(served, token) and _authenticates(served, key)
    finally:
        assert served.stop() == 0
    return token, key


def test_a_restart_prints_the_same_admin_token_and_demo_key(tmp_path: Path) -> None:
    """Issue 23: each start printed a new admin token (the exported one got 401) and issued one
    more demo key. Both are kept in the data directory (0600) and printed again."""
    data = tmp_path / "data"
    args = ["serve", "--engine", "echo", "--data-dir", str(data)]
    token, key = _secrets(args, tmp_path)
    for name in (serve_state.ADMIN_TOKEN_FILE, serve_state.DEMO_KEY_FILE):
        assert (data / name).stat().st_mode & 0o777 == 0o600, name
    assert serve_state.read_secret(data / serve_state.ADMIN_TOKEN_FILE) == token
    assert serve_state.read_secret(data / serve_state.DEMO_KEY_FILE) == key

    served = start(args, tmp_path)  # the same two secrets; the old token still opens /admin
    try:
        assert (banner_admin_token(served), banner_key(served)) == (token, key)
        keys = httpx.get(served.base_url + "/admin/tenants/demo/keys", headers=served.auth(token)).json()["data"]
        assert [k["prefix"] for k in keys] == [key.split("-")[1]]  # the demo tenant collects no keys
        revoked = httpx.delete(f"{served.base_url}/admin/keys/{key.split('-')[1]}", headers=served.auth(token))
        assert revoked.status_code == 200
    finally:
        assert served.stop() == 0

    again_token, new_key = _secrets(args, tmp_path)  # a revoked demo key is replaced, once
    assert again_token == token and new_key != key
    assert serve_state.read_secret(data / serve_state.DEMO_KEY_FILE) == new_key

    explicit, same_key = _secrets([*args, "--admin-token", ADMIN_TOKEN], tmp_path)  # the flag wins
    assert (explicit, same_key) == (ADMIN_TOKEN, new_key)
    assert serve_state.read_secret(data / serve_state.ADMIN_TOKEN_FILE) == token  # and the kept one stays


def test_with_an_external_redis_the_secrets_are_kept_too_and_the_key_per_redis(tmp_path: Path) -> None:
    data = tmp_path / "data"
    with EmbeddedRedis() as redis:
        args = ["serve", "--engine", "echo", "--redis-url", redis.url, "--data-dir", str(data)]
        first = _secrets(args, tmp_path)
        assert _secrets(args, tmp_path) == first
        assert serve_state.read_secret(serve_state.demo_key_file(data, redis.url)) == first[1]
        assert not serve_state.demo_key_file(data).exists()  # the private Redis's key is another file
