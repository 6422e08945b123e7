"""A slice of ``bench.fuzz`` (malformed HTTP over raw sockets) against a live echo gateway:
every request answered, every error OpenAI's error object, nothing >= 500, no hang."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest

from bench import fuzz
from tests.e2e.conftest import ADMIN_TOKEN
from tests.e2e.echo_gateway import echo_gateway

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REQUESTS, SEED = 400, 7
TOLERATED: tuple[str, ...] = ()  # no finding class is tolerated
KNOWN: tuple[str, ...] = ()  # every kind of malformed input is sent


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[fuzz.Target]:
    with echo_gateway(tmp_path_factory.mktemp("fuzz")) as (served, _):
        url = urlsplit(served.base_url)
        yield fuzz.Target(url.hostname or "", url.port or 80, served.key, ADMIN_TOKEN, served.model, 65536)


def test_malformed_http_gets_openai_errors(target: fuzz.Target) -> None:
    report = asyncio.run(fuzz.run(target, REQUESTS, SEED, timeout_s=10.0, concurrency=4, exclude=KNOWN))
    sent = report.requests
    assert sent > 300 and report.statuses["200"] > 20 and report.statuses["400"] > 50, report.statuses
    found = {
        name: [f"#{c.index} [{c.kind}] {fuzz._excerpt(c.data)} -> {o.status or o.error} {fuzz._excerpt(o.body)}"
               for c, o in report.examples.get(name, [])]
        for name in report.left(TOLERATED)
    }
    assert not found, found


def _send(target: fuzz.Target, data: bytes, truncated: bool = False) -> fuzz.Outcome:
    return asyncio.run(fuzz.send(target, fuzz.Case(0, "hand-made", data, truncated=truncated), 5.0))


def test_a_websocket_upgrade_is_answered_like_any_request(target: fuzz.Target) -> None:
    upgrade = (
        f"GET /v1/models HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {target.key}\r\nconnection: Upgrade\r\n"
        "upgrade: websocket\r\nsec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\nsec-websocket-version: 13\r\n"
    ).encode()
    plain = _send(target, upgrade + b"\r\n")
    assert plain.status == 200, (plain.status, plain.error)
    with_body = _send(target, upgrade.replace(b"GET", b"POST") + b"content-length: 2\r\n\r\n{}")
    assert with_body.status == 405 and fuzz.is_openai_error(fuzz._json(with_body.body)), with_body.error


def test_a_client_that_hangs_up_mid_body_is_no_server_error(target: fuzz.Target) -> None:
    before = asyncio.run(fuzz.server_errors(target))
    cut = (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {target.key}\r\n"
        'content-type: application/json\r\ncontent-length: 100\r\n\r\n{"model":'
    ).encode()
    assert _send(target, cut, truncated=True).status is None  # nobody left to answer
    asyncio.run(asyncio.sleep(0.5))
    assert asyncio.run(fuzz.server_errors(target)) == before
