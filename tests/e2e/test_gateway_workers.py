"""`tokengate gateway --workers 2` as a real process with an echo worker: two gateway processes
on one port, both serving and sharing the worker's capacity, the admin token kept off their
command lines, one killed and started again while requests keep succeeding, and SIGTERM
ending the parent and both processes within the shutdown grace."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import psutil
import pytest

from gateway.cli.server import SHUTDOWN_SLACK_S
from tests.e2e.conftest import ADMIN_TOKEN, Served, launch, wait_ready
from workers.model_store import ModelSpec

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.redis]

PROCESSES = 2
GRACE_S = 2
DEAD_AFTER_S = 5  # a killed process's registration goes this long after it stopped renewing
REQUESTS = 20

T = TypeVar("T")


@pytest.fixture
def echo_worker(redis_url: str, tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    with open(tmp_path / "worker.log", "wb") as log:
        worker = subprocess.Popen(
            [sys.executable, "-m", "workers", "--redis-url", redis_url, "--engine", "echo", "--echo-tokens", "4"],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    yield worker
    worker.terminate()
    try:
        worker.wait(timeout=30)
    except subprocess.TimeoutExpired:
        worker.kill()
        worker.wait()


@dataclass
class Group:
    served: Served
    seen: dict[int, psutil.Process] = field(default_factory=dict)  # every gateway process, for the clean-up

    def processes(self) -> list[psutil.Process]:
        """The parent's live descendants (however deep)."""
        try:
            found = psutil.Process(self.served.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        self.seen.update((p.pid, p) for p in found)
        return [p for p in found if _alive(p)]


@pytest.fixture
def group(
    redis_url: str, echo_worker: subprocess.Popen[bytes], model_spec: ModelSpec, tmp_path: Path
) -> Iterator[Group]:
    """The parent, ready (one of its processes sees the worker); whatever of it a failed test
    left running is killed."""
    served = launch(
        ["gateway", "--workers", str(PROCESSES), "--redis-url", redis_url, "--admin-token", ADMIN_TOKEN,
         "--shutdown-grace", str(GRACE_S), "--gateway-dead-after", str(DEAD_AFTER_S)],
        tmp_path,
    )
    served.model = model_spec.name
    g = Group(served)
    try:
        wait_ready(served)
        g.processes()
        yield g
    finally:
        if served.proc.poll() is None:
            served.proc.kill()
            served.proc.wait()
        g.processes()
        leftovers = [p for p in g.seen.values() if _alive(p)]
        for proc in leftovers:
            proc.kill()
        psutil.wait_procs(leftovers, timeout=10)


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _until(check: Callable[[], T | None], what: str, served: Served, timeout_s: float) -> T:
    """Polls ``check`` until it returns something other than None (or False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            found = check()
        except (httpx.HTTPError, psutil.Error):
            found = None
        if found:
            return found
        time.sleep(0.1)
    raise AssertionError(f"{what}: not within {timeout_s} s\n{served.log.read_text()[-4000:]}")


def _pid(gateway_id: str) -> int:
    """A gateway's id is "<host>-<pid>-<random>"."""
    return int(gateway_id.rsplit("-", 2)[1])


def _both_share(served: Served, pids: set[int], timeout_s: float = 60) -> None:
    """Every one of ``pids`` answers /admin/scheduler (a fresh connection each time: the kernel
    picks the process) with a worker in view and gateways == 2."""
    seen: set[int] = set()

    def check() -> bool:
        r = httpx.get(served.base_url + "/admin/scheduler", headers=served.auth(ADMIN_TOKEN), timeout=5)
        assert r.status_code == 200, r.text
        snap: dict[str, Any] = r.json()
        if snap["gateways"] == PROCESSES and snap["paths"]["cpu"]["workers"] >= 1:
            seen.add(_pid(snap["gateway"]))
        return seen == pids

    _until(check, f"each of {sorted(pids)} reporting {PROCESSES} live gateways (seen {seen})",
           served, timeout_s)


def _complete(served: Served, key: str) -> httpx.Response:
    body = {"model": served.model, "prompt": "hi", "max_tokens": 4}
    return httpx.post(served.base_url + "/v1/completions", json=body, headers=served.auth(key), timeout=30)


def _all_succeed(served: Served, key: str, n: int, when: str) -> None:
    codes = [_complete(served, key).status_code for _ in range(n)]  # each on a new connection
    assert codes == [200] * n, f"{when}: {codes}\n{served.log.read_text()[-4000:]}"


def test_two_gateway_processes_serve_one_port_are_restarted_and_stop_together(group: Group) -> None:
    served = group.served
    port = int(served.base_url.rsplit(":", 1)[1])

    def group_of(excluding: int = 0) -> list[psutil.Process] | None:
        procs = group.processes()
        return procs if len(procs) == PROCESSES and excluding not in {p.pid for p in procs} else None

    # exactly two processes, children of the parent, and nothing below them
    procs = _until(group_of, f"{PROCESSES} gateway processes", served, 30)
    assert {p.ppid() for p in procs} == {served.proc.pid}, "a gateway process started processes of its own"
    for proc in procs:
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        assert b"gateway.cli" in cmdline and b"--reuse-port" in cmdline
        assert ADMIN_TOKEN.encode() not in cmdline, "the admin token is on a gateway process's command line"
        assert proc.environ().get("TOKENGATE_ADMIN_TOKEN") == ADMIN_TOKEN
    pids = {p.pid for p in procs}

    # both serve, admin included, and each counts the other
    _both_share(served, pids)
    admin = served.auth(ADMIN_TOKEN)
    body = {"name": "many", "rate": 1e8, "burst": 10**10, "max_queue_delay_s": 0}
    assert httpx.post(served.base_url + "/admin/tenants", json=body, headers=admin).status_code == 201
    issued = httpx.post(served.base_url + "/admin/tenants/many/keys", headers=admin)
    assert issued.status_code == 201, issued.text
    key = issued.json()["key"]
    _all_succeed(served, key, REQUESTS, "two processes")

    # one killed: the other serves meanwhile, the parent starts a new one
    victim = next(p for p in procs if p.pid == min(pids))
    victim.send_signal(signal.SIGKILL)
    victim.wait(5)
    _all_succeed(served, key, REQUESTS // 2, "right after a process was killed")
    restarted = _until(lambda: group_of(excluding=victim.pid), "the killed gateway process started again", served, 10)
    new_pids = {p.pid for p in restarted}
    assert len(new_pids - pids) == 1
    assert "exited with signal 9" in served.log.read_text()
    _all_succeed(served, key, REQUESTS // 2, "while the new process starts")
    _both_share(served, new_pids, timeout_s=DEAD_AFTER_S + 60)  # the dead one's share comes back
    _all_succeed(served, key, REQUESTS, "after the restart")

    # SIGTERM to the parent ends everything within the grace time (and the documented slack)
    stopped_at = time.monotonic()
    served.proc.send_signal(signal.SIGTERM)
    assert served.proc.wait(timeout=GRACE_S + SHUTDOWN_SLACK_S + 20) == 0
    assert time.monotonic() - stopped_at < GRACE_S + SHUTDOWN_SLACK_S
    _, alive = psutil.wait_procs(restarted, timeout=5)
    assert not [p for p in alive if _alive(p)], "gateway processes outlived the parent"
    listening = [c for c in psutil.net_connections("tcp") if c.laddr and c.laddr.port == port
                 and c.status == psutil.CONN_LISTEN]
    assert not listening, listening
    with pytest.raises(httpx.ConnectError):
        httpx.get(served.base_url + "/healthz", timeout=2)
    assert "Traceback" not in served.log.read_text(), served.log.read_text()[-4000:]
