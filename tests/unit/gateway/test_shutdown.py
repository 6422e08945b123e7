"""Signals treated alike and by phase; requests past the grace time end with a readable error."""

from __future__ import annotations

import asyncio
import signal
from typing import Any

import orjson
import pytest

from gateway.cli import shutdown
from gateway.cli.shutdown import Drain, Interrupted, StopSignals


class FakeServer:
    should_exit = False
    force_exit = False


@pytest.fixture
def no_exit_timer(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    armed: list[float] = []
    monkeypatch.setattr(shutdown, "exit_within", armed.append)
    return armed


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_during_start_up_unwinds_it(signum: int, no_exit_timer: list[float]) -> None:
    signals = StopSignals()
    with pytest.raises(Interrupted):
        signals._handle(signum, None)
    assert signals.stop_requested and not signals.forced
    signals.stopping()
    signals._handle(signum, None)  # during the cleanup: hurries it, raises nothing
    assert signals.forced and no_exit_timer == [shutdown.FORCED_EXIT_S]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_first_signal_stops_the_server_and_the_second_forces(signum: int, no_exit_timer: list[float]) -> None:
    async def go() -> tuple[FakeServer, Drain]:
        signals = StopSignals()
        server = FakeServer()
        drain = Drain(_never_answers, grace_s=1)
        signals.serving(server, drain)  # type: ignore[arg-type]
        signals._handle(signum, None)
        assert server.should_exit and not server.force_exit and not drain.expired
        signals._handle(signal.SIGINT if signum == signal.SIGTERM else signal.SIGTERM, None)
        assert server.force_exit and signals.forced and no_exit_timer == [shutdown.FORCED_EXIT_S]
        await asyncio.sleep(0)  # the handler scheduled the drain on the loop
        return server, drain

    _server, drain = asyncio.run(go())
    assert drain.expired


async def _never_answers(scope: Any, receive: Any, send: Any) -> None:
    await asyncio.Event().wait()


async def _streams_then_hangs(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    await send({"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True})
    try:
        await asyncio.Event().wait()
    finally:
        await send({"type": "http.response.body", "body": b"late", "more_body": False})  # dropped


async def _answers(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def _serve_until_expired(app: Any) -> list[dict[str, Any]]:
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def go() -> None:
        drain = Drain(app, grace_s=3)
        task = asyncio.create_task(drain({"type": "http"}, None, send))
        await asyncio.sleep(0)
        drain.expire()
        async with asyncio.timeout(5):  # were it not ended, this would fail the test
            await task

    asyncio.run(go())
    return sent


def test_a_request_without_a_response_yet_gets_a_json_503() -> None:
    sent = _serve_until_expired(_never_answers)
    assert sent[0]["status"] == 503
    headers = dict(sent[0]["headers"])
    assert headers[b"content-type"] == b"application/json" and headers[b"retry-after"] == b"1"
    body = orjson.loads(sent[1]["body"])
    assert body["error"]["code"] == "shutting_down" and "3 s" in body["error"]["message"]
    assert len(sent) == 2


def test_a_stream_ends_with_an_error_event() -> None:
    sent = _serve_until_expired(_streams_then_hangs)
    assert [m.get("more_body", False) for m in sent] == [False, True, False]
    last = sent[-1]["body"]
    assert last.startswith(b"data: ") and last.endswith(b"\n\n")
    assert orjson.loads(last[6:])["error"]["code"] == "shutting_down"


def test_finished_requests_are_untouched_and_later_ones_are_refused() -> None:
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def go() -> None:
        drain = Drain(_answers, grace_s=3)
        await drain({"type": "http"}, None, send)
        drain.expire()
        await drain({"type": "http"}, None, send)

    asyncio.run(go())
    assert sent[0]["status"] == 200 and sent[1]["body"] == b"ok"
    assert sent[2]["status"] == 503
