"""The HTTP server under abuse: slow-loris connections, too many connections, malformed HTTP,
a stalled body and a non-JSON body, against `serve --engine echo`."""

from __future__ import annotations

import selectors
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import orjson
import pytest

from tests.e2e.conftest import Served, banner_key, start

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

HEADER_TIMEOUT_S = 2.0


def _address(served: Served) -> tuple[str, int]:
    url = urlsplit(served.base_url)
    assert url.hostname and url.port
    return url.hostname, url.port


def _read_all(sock: socket.socket, timeout_s: float) -> bytes:
    sock.settimeout(timeout_s)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def _exchange(served: Served, raw: bytes, timeout_s: float = 5) -> tuple[int, dict[str, str], bytes]:
    with socket.create_connection(_address(served), timeout=timeout_s) as sock:
        sock.sendall(raw)
        data = _read_all(sock, timeout_s)
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v for k, v in (line.split(": ", 1) for line in lines[1:])}
    return int(lines[0].split()[1]), headers, body


def _openai_error(body: bytes) -> dict[str, object]:
    error = orjson.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("limits")
    s = start(["serve", "--engine", "echo", "--header-timeout", str(HEADER_TIMEOUT_S), "--body-timeout", "1"], tmp)
    s.key = banner_key(s)
    yield s
    assert s.stop() == 0


def test_slow_loris_connections_do_not_stall_others_and_are_closed(served: Served) -> None:
    partial = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nX-Slow: "
    loris: list[socket.socket] = []
    silent: list[socket.socket] = []
    try:
        for i in range(300):
            sock = socket.create_connection(_address(served), timeout=5)
            if i % 6 == 0:
                silent.append(sock)  # connects and never says a word
            else:
                sock.sendall(partial)
                loris.append(sock)
        opened = time.monotonic()

        body = {"model": served.model, "prompt": "hi", "max_tokens": 4}
        t0 = time.monotonic()
        r = httpx.post(served.base_url + "/v1/completions", json=body, headers=served.auth(), timeout=10)
        assert r.status_code == 200 and time.monotonic() - t0 < 2.0

        sel = selectors.DefaultSelector()
        for sock in loris + silent:
            sock.setblocking(False)
            sel.register(sock, selectors.EVENT_READ, b"")
        answers: dict[socket.socket, bytes] = {}
        deadline = opened + HEADER_TIMEOUT_S + 10
        while len(answers) < len(loris) + len(silent) and time.monotonic() < deadline:
            for key, _ in sel.select(timeout=0.5):
                sock = key.fileobj  # type: ignore[assignment]
                chunk = sock.recv(65536)
                if chunk:
                    sel.modify(sock, selectors.EVENT_READ, key.data + chunk)
                else:  # closed by the server
                    answers[sock] = key.data
                    sel.unregister(sock)
        closed_after = time.monotonic() - opened
        assert len(answers) == len(loris) + len(silent), f"{len(answers)} of {len(loris) + len(silent)} closed"
        assert closed_after > HEADER_TIMEOUT_S * 0.8
        assert all(answers[s] == b"" for s in silent)
        for sock in loris:
            assert answers[sock].startswith(b"HTTP/1.1 408 ")
            assert _openai_error(answers[sock].partition(b"\r\n\r\n")[2])["code"] == "header_timeout"
    finally:
        for sock in loris + silent:
            sock.close()
    assert httpx.get(served.base_url + "/healthz").status_code == 200


@pytest.mark.parametrize(
    "raw",
    [
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: ten\r\n\r\n",
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n",
        b"GET /healthz HTTP/1.1\r\nHost: x\r\nNo colon here\r\n\r\n",
        b"GET /he alth z HTTP/9\r\n\r\n",
    ],
    ids=["content-length", "two-content-lengths", "bad-header", "bad-request-line"],
)
def test_malformed_http_gets_an_openai_shaped_400(served: Served, raw: bytes) -> None:
    status, headers, body = _exchange(served, raw)
    assert status == 400 and headers["content-type"] == "application/json"
    error = _openai_error(body)
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_http_request"
    assert error["param"] is None


@pytest.mark.parametrize("content_type", ["application/x-www-form-urlencoded", "text/plain"])
def test_a_body_that_is_not_declared_json_gets_415(served: Served, content_type: str) -> None:
    body = orjson.dumps({"model": served.model, "prompt": "hi", "max_tokens": 4})
    headers = {"content-type": content_type, **served.auth()}
    r = httpx.post(served.base_url + "/v1/completions", content=body, headers=headers)
    assert r.status_code == 415 and r.headers["content-type"] == "application/json"
    assert _openai_error(r.content)["code"] == "unsupported_media_type"
    no_type = httpx.post(served.base_url + "/v1/completions", content=body, headers=served.auth())
    assert no_type.status_code == 200  # some clients send no Content-Type at all


def test_a_body_that_stalls_gets_408(served: Served) -> None:
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {served.key}\r\nContent-Length: 100\r\n\r\n"
    )
    t0 = time.monotonic()
    status, headers, body = _exchange(served, head.encode() + b'{"model": ', timeout_s=10)
    assert status == 408 and headers["connection"] == "close"
    assert _openai_error(body)["code"] == "body_timeout"
    assert 0.8 < time.monotonic() - t0 < 5


def test_connections_beyond_the_limit_are_refused_fast(tmp_path: Path) -> None:
    limit = 40
    served = start(["serve", "--engine", "echo", "--max-connections", str(limit), "--header-timeout", "60"], tmp_path)
    held: list[socket.socket] = []
    try:
        for _ in range(limit):  # each answers one request, so the server has surely counted it,
            sock = socket.create_connection(_address(served), timeout=5)
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # then stays busy: half a request
            held.append(sock)
        t0 = time.monotonic()
        status, headers, body = _exchange(served, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n", timeout_s=5)
        assert time.monotonic() - t0 < 1.0
        assert status == 503 and headers["retry-after"] == "1"
        assert _openai_error(body)["code"] == "too_many_connections"
        assert "refused 1 connection(s)" in served.log.read_text()
        for sock in held:
            sock.close()

        def healthy() -> bool:  # once the held connections' close has reached the server
            try:
                return httpx.get(served.base_url + "/healthz").status_code == 200
            except httpx.HTTPError:
                return False

        deadline = time.monotonic() + 10
        while not healthy() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert httpx.get(served.base_url + "/readyz").status_code == 200
    finally:
        for sock in held:
            sock.close()
        assert served.stop() == 0


def test_at_the_limit_a_new_connection_takes_the_place_of_an_idle_one(tmp_path: Path) -> None:
    limit = 40
    served = start(["serve", "--engine", "echo", "--max-connections", str(limit)], tmp_path)
    held: list[socket.socket] = []
    try:
        for _ in range(limit):  # idle keep-alive connections, as a burst of clients leaves them
            sock = socket.create_connection(_address(served), timeout=5)
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            answer = sock.recv(65536)
            while not answer.endswith(b"}"):  # the whole response, so what follows can only be EOF
                answer += sock.recv(65536)
            assert answer.startswith(b"HTTP/1.1 200 ")
            held.append(sock)
        for _ in range(5):  # new clients are served, not refused
            raw = b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
            status, _headers, _body = _exchange(served, raw, timeout_s=5)
            assert status == 200
        time.sleep(0.5)
        closed = 0
        for sock in held:  # the server closed idle ones to make room (at least the first time)
            sock.setblocking(False)
            try:
                closed += sock.recv(1) == b""
            except BlockingIOError:
                pass
        assert closed >= 1
        assert "refused" not in served.log.read_text()
    finally:
        for sock in held:
            sock.close()
        assert served.stop() == 0
