"""The guarded httptools protocol, driven with a fake transport: no sockets, no sleeping."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
import uvicorn
from uvicorn.server import ServerState

from gateway.http.protocol import ConnectionLimits, GuardedProtocol, connection_cap, protocol_class
from gateway.http.web import BODY_DEADLINE


class FakeTransport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.written = b""
        self.closed = False
        self.eof = False
        self.aborted = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written += bytes(data)

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed or self.aborted

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.eof = True

    def abort(self) -> None:
        self.aborted = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 50000), "sockname": ("127.0.0.1", 8000)}.get(name, default)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def _response(raw: bytes) -> tuple[int, dict[str, str], Any]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, orjson.loads(body)


async def _app(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    pending = asyncio.all_tasks(loop)  # requests the app has not answered yet
    for task in pending:
        task.cancel()
    if pending:
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    loop.close()


def _connect(
    loop: asyncio.AbstractEventLoop, state: ServerState | None = None, max_connections: int = 10
) -> tuple[GuardedProtocol, FakeTransport]:
    config = uvicorn.Config(_app, log_level="critical", lifespan="off")
    cls = protocol_class(ConnectionLimits(header_timeout_s=5.0, body_timeout_s=7.0, max_connections=max_connections))
    proto = cls(config=config, server_state=state or ServerState(), app_state={}, _loop=loop)
    transport = FakeTransport()
    proto.connection_made(transport)
    return proto, transport


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
        b"GET / HTTP/1.1\r\nBad Header\r\n\r\n",
        b"NOT A REQUEST LINE\r\n\r\n",
    ],
)
def test_malformed_http_gets_openai_shaped_400(loop: asyncio.AbstractEventLoop, request_bytes: bytes) -> None:
    proto, transport = _connect(loop)
    proto.data_received(request_bytes)
    status, headers, body = _response(transport.written)
    assert status == 400 and headers["content-type"] == "application/json"
    assert body == {"error": {"message": body["error"]["message"], "type": "invalid_request_error",
                              "param": None, "code": "invalid_http_request"}}
    # FIN after the answer, and the rest of what the client sends is read and dropped: a close
    # with unread input would reset the connection and could destroy the 400 on its way
    assert transport.eof and not transport.closed and proto._linger is not None
    answered = transport.written
    proto.data_received(b"x-big: " + b"h" * 100_000)
    assert transport.written == answered
    proto._linger._run()  # a client that never closes is dropped after a second
    assert transport.aborted
    proto.connection_lost(None)
    assert type(proto).refusals.lingering == 0


def test_a_connection_silent_past_the_header_timeout_is_closed(loop: asyncio.AbstractEventLoop) -> None:
    proto, transport = _connect(loop)
    timer = proto._header_timer
    assert timer is not None and timer.when() == pytest.approx(loop.time() + 5.0, abs=0.5)
    timer._run()  # the timer's callback, as the loop would run it after 5 s
    assert transport.closed and transport.written == b""  # nothing started: just closed


def test_a_partial_request_past_the_header_timeout_gets_408(loop: asyncio.AbstractEventLoop) -> None:
    proto, transport = _connect(loop)
    proto.data_received(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
    assert proto._header_timer is not None
    proto._header_timer._run()
    status, headers, body = _response(transport.written)
    assert status == 408 and body["error"]["code"] == "header_timeout" and headers["connection"] == "close"
    assert transport.eof and proto._linger is not None  # lingers like a 400
    proto.connection_lost(None)


def test_complete_headers_stop_the_timer_and_stamp_the_body_deadline(loop: asyncio.AbstractEventLoop) -> None:
    proto, transport = _connect(loop)
    proto.data_received(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n")
    assert proto._header_timer is None
    assert proto.scope["extensions"][BODY_DEADLINE]["at"] == pytest.approx(loop.time() + 7.0, abs=0.5)
    assert not transport.closed


def test_the_next_request_on_a_keep_alive_connection_is_timed_again(loop: asyncio.AbstractEventLoop) -> None:
    proto, transport = _connect(loop)
    proto.data_received(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert proto._header_timer is None
    loop.run_until_complete(asyncio.sleep(0))  # the app answers
    assert transport.written.startswith(b"HTTP/1.1 200")
    assert proto._header_timer is None  # idle between requests: uvicorn's keep-alive timeout
    proto.data_received(b"GET / HT")
    assert proto._header_timer is not None


def test_connections_beyond_the_limit_get_a_fast_503(loop: asyncio.AbstractEventLoop) -> None:
    state = ServerState()
    for _ in range(3):
        _connect(loop, state, max_connections=3)
    assert len(state.connections) == 3
    proto, transport = _connect(loop, state, max_connections=3)
    status, headers, body = _response(transport.written)
    assert status == 503 and headers["retry-after"] == "1" and body["error"]["code"] == "too_many_connections"
    assert transport.eof and not transport.aborted  # FIN after the 503; the client's bytes are read
    assert len(state.connections) == 3 and proto._header_timer is None
    proto.data_received(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")  # discarded, never parsed
    assert transport.written.count(b"HTTP/1.1") == 1
    assert proto._linger is not None and proto._linger.when() == pytest.approx(loop.time() + 1.0, abs=0.5)
    proto._linger._run()  # a client that never closes is dropped after a second
    assert transport.aborted
    proto.connection_lost(None)
    assert type(proto).refusals.lingering == 0


def test_refused_connections_linger_only_up_to_a_bound(loop: asyncio.AbstractEventLoop) -> None:
    from gateway.http.protocol import REFUSAL_LINGER_MAX

    state = ServerState()
    first, _ = _connect(loop, state, max_connections=1)
    cls = type(first)
    refused = []
    for _ in range(REFUSAL_LINGER_MAX + 1):
        proto = cls(config=first.config, server_state=state, app_state={}, _loop=loop)
        transport = FakeTransport()
        proto.connection_made(transport)
        refused.append(transport)
    assert cls.refusals.lingering == REFUSAL_LINGER_MAX
    assert all(t.eof and not t.aborted for t in refused[:-1])
    assert refused[-1].aborted and refused[-1].written == b""  # no fd held for it


@pytest.mark.parametrize(
    ("requested", "nofile", "granted"),
    [(4096, 1024, 768), (4096, 20000, 4096), (100_000, 20000, 17500), (10, 100, 1), (4096, 1 << 20, 4096)],
)
def test_the_connection_cap_leaves_headroom_below_the_file_limit(requested: int, nofile: int, granted: int) -> None:
    assert connection_cap(requested, nofile) == granted
