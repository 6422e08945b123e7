"""`serve` stopped by Ctrl-C or SIGTERM with requests in flight: each request finishes or ends
with an error the client can read, the process exits 0 without a traceback, and no child
process and no temporary directory is left."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import orjson
import psutil
import pytest

from tests.e2e.conftest import Served, banner_key, launch, start

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

STEP_MS = 20  # the echo engine's time per token
GRACE_S = 3


@dataclass
class Outcome:
    status: int | None = None
    content_type: str = ""
    body: str = ""
    events: list[str] = field(default_factory=list)
    error: str | None = None  # a transport error: a reset, a cut without a status
    first: threading.Event = field(default_factory=threading.Event)


def _request(served: Served, tokens: int, stream: bool, out: Outcome) -> None:
    body = {"model": served.model, "prompt": "count", "max_tokens": tokens, "stream": stream}
    try:
        with httpx.stream("POST", served.base_url + "/v1/completions", json=body,
                          headers=served.auth(), timeout=60) as r:
            out.status = r.status_code
            out.content_type = r.headers.get("content-type", "")
            if stream and r.status_code == 200:
                for line in r.iter_lines():
                    if line.startswith("data:"):
                        out.events.append(line)
                        out.first.set()
            else:
                out.body = r.read().decode()
    except httpx.HTTPError as exc:
        out.error = repr(exc)
    finally:
        out.first.set()


@pytest.fixture
def reaper() -> Iterator[list[Served]]:
    """Processes a failed test left running are killed (their children follow: PDEATHSIG)."""
    started: list[Served] = []
    yield started
    for served in started:
        if served.proc.poll() is None:
            served.proc.kill()
            served.proc.wait()


@pytest.fixture
def private_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """TMPDIR of the `serve` under test (and its children), to see what it leaves there."""
    tmp = tmp_path / "tmpdir"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    return tmp


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    return [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_a_signal_with_requests_in_flight_ends_every_request_and_leaves_nothing(
    tmp_path: Path, private_tmp: Path, reaper: list[Served], how: str
) -> None:
    data_dir = tmp_path / "data"
    served = start(
        ["serve", "--engine", "echo", "--echo-step-ms", str(STEP_MS), "--echo-tokens", "1000",
         "--shutdown-grace", str(GRACE_S), "--data-dir", str(data_dir)],
        tmp_path,
        new_session=True,
    )
    reaper.append(served)
    served.key = banner_key(served)
    children = psutil.Process(served.proc.pid).children(recursive=True)
    assert any("redis-server" in " ".join(c.cmdline()) for c in children)
    assert any("workers" in " ".join(c.cmdline()) for c in children)

    short = 40  # 0.8 s: finishes within the grace time
    long = 1000  # 20 s: still running when the grace time is over
    plan = {"short stream": (short, True), "short": (short, False), "long stream": (long, True), "long": (long, False)}
    outcomes = {name: Outcome() for name in plan}
    threads = [
        threading.Thread(target=_request, args=(served, tokens, stream, outcomes[name]))
        for name, (tokens, stream) in plan.items()
    ]
    for t in threads:
        t.start()
    for name in ("short stream", "long stream"):
        assert outcomes[name].first.wait(30), f"{name} did not start"
    time.sleep(0.1)  # the non-streaming ones, sent first, are surely admitted by now

    signalled = time.monotonic()
    if how == "ctrl-c":  # the terminal sends SIGINT to the whole foreground process group
        os.killpg(served.proc.pid, signal.SIGINT)
    else:
        served.proc.send_signal(signal.SIGTERM)

    refused = False  # it stops admitting: new connections are refused soon after the signal
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not refused:
        try:
            httpx.get(served.base_url + "/healthz", timeout=1)
            time.sleep(0.05)
        except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError):
            # refused; or closed unanswered, or reset (ReadError: ECONNRESET): a connection the
            # kernel completed into the listen backlog just before the gateway closed its
            # listening socket is reset with it
            refused = True
    assert refused, "the gateway still accepted connections after the signal"

    for t in threads:
        t.join(timeout=GRACE_S + 20)
    assert served.proc.wait(timeout=40) == 0
    elapsed = time.monotonic() - signalled
    log = served.log.read_text()

    for name, out in outcomes.items():
        assert out.error is None, f"{name}: {out.error}\n{log[-3000:]}"
    done = outcomes["short stream"]
    assert done.status == 200 and done.events[-1] == "data: [DONE]"
    assert outcomes["short"].status == 200 and orjson.loads(outcomes["short"].body)["choices"][0]["text"]
    cut = outcomes["long stream"]
    assert cut.status == 200 and cut.events[-1] != "data: [DONE]"
    assert orjson.loads(cut.events[-1].removeprefix("data: "))["error"]["code"] == "shutting_down"
    refused_late = outcomes["long"]
    assert refused_late.status == 503 and refused_late.content_type == "application/json"
    assert orjson.loads(refused_late.body)["error"]["code"] == "shutting_down"

    assert GRACE_S - 1 < elapsed < GRACE_S + 15
    assert "Traceback" not in log, log[-4000:]
    time.sleep(0.3)
    assert not _alive(children), _alive(children)
    assert not list(private_tmp.iterdir())
    assert (data_dir / "appendonlydir").is_dir()  # Redis wrote its AOF


IDLE_EXIT_S = 2.0  # measured 0.6-0.9 s here (about 3 s before issue 23's fix); margin for a slow CI machine


@pytest.mark.model
def test_ctrl_c_with_nothing_in_flight_exits_at_once(tmp_path: Path, private_tmp: Path, reaper: list[Served]) -> None:
    """Issue 23: Ctrl-C on an idle `serve` (the real model, as `make run` starts it) took about
    3 s: the worker's blocking read and its cancel thread's poll (0.5 s each), then the exits
    of two processes holding torch and transformers (about 0.8 s each of garbage collection).
    Now gateway, worker and Redis are all gone within ``IDLE_EXIT_S``."""
    served = start(["serve", "--data-dir", str(tmp_path / "data")], tmp_path, new_session=True)
    reaper.append(served)
    children = psutil.Process(served.proc.pid).children(recursive=True)
    assert any("redis-server" in " ".join(c.cmdline()) for c in children)
    assert any("workers" in " ".join(c.cmdline()) for c in children)
    time.sleep(1.0)  # idle: the worker blocks in its read, its threads wait
    signalled = time.monotonic()
    os.killpg(served.proc.pid, signal.SIGINT)
    assert served.proc.wait(timeout=30) == 0
    took = time.monotonic() - signalled
    print(f"serve exited {took:.2f} s after Ctrl-C")
    assert took < IDLE_EXIT_S, served.log.read_text()[-3000:]
    assert not _alive(children), _alive(children)  # its children were waited for: gone already
    assert "Traceback" not in served.log.read_text()


def test_a_signal_during_start_up_leaves_no_process(tmp_path: Path, private_tmp: Path, reaper: list[Served]) -> None:
    """Ctrl-C while the worker and the gateway are still starting: exit 0, nothing left."""
    served = launch(["serve", "--engine", "echo", "--data-dir", str(tmp_path / "data")], tmp_path, new_session=True)
    reaper.append(served)
    children: list[psutil.Process] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # as soon as the worker exists, long before it is ready
        children = psutil.Process(served.proc.pid).children(recursive=True)
        if any("workers" in " ".join(c.cmdline()) for c in children):
            break
        time.sleep(0.01)
    assert any("workers" in " ".join(c.cmdline()) for c in children), served.log.read_text()
    os.killpg(served.proc.pid, signal.SIGINT)
    assert served.proc.wait(timeout=30) == 0, served.log.read_text()
    log = served.log.read_text()
    assert "tokengate is ready" not in log  # it really was stopped during start-up
    assert "Traceback" not in log, log
    time.sleep(0.3)
    assert not _alive(children)
    assert not list(private_tmp.iterdir())


def test_a_second_signal_forces_a_fast_exit(tmp_path: Path, reaper: list[Served]) -> None:
    served = start(
        ["serve", "--engine", "echo", "--echo-step-ms", str(STEP_MS), "--echo-tokens", "1000",
         "--shutdown-grace", "30", "--data-dir", str(tmp_path / "data")],
        tmp_path,
        new_session=True,
    )
    reaper.append(served)
    served.key = banner_key(served)
    children = psutil.Process(served.proc.pid).children(recursive=True)
    out = Outcome()
    thread = threading.Thread(target=_request, args=(served, 1000, True, out))
    thread.start()
    assert out.first.wait(30)
    os.killpg(served.proc.pid, signal.SIGINT)
    time.sleep(0.5)
    forced = time.monotonic()
    os.killpg(served.proc.pid, signal.SIGINT)
    assert served.proc.wait(timeout=15) == 0
    assert time.monotonic() - forced < 8  # not the 30 s grace time
    thread.join(timeout=10)
    assert out.error is None and out.events[-1] != "data: [DONE]"
    assert orjson.loads(out.events[-1].removeprefix("data: "))["error"]["code"] == "shutting_down"
    time.sleep(0.3)
    assert not _alive(children)
