"""read_json: 415 for a declared non-JSON body, 408 past the body deadline, 413, 400."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from starlette.requests import Request

from gateway import errors
from gateway.http.web import BODY_DEADLINE, is_json, read_json


def _request(body: list[bytes], headers: dict[str, str], deadline: float | None = None) -> Request:
    chunks = list(body)

    async def receive() -> dict[str, Any]:
        if not chunks:
            await asyncio.Event().wait()  # a client that stalls: the rest never comes
        chunk = chunks.pop(0)
        return {"type": "http.request", "body": chunk, "more_body": bool(chunks) or deadline is not None}

    scope: dict[str, Any] = {
        "type": "http",
        "method": "POST",
        "path": "/",
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
    }
    if deadline is not None:
        scope["extensions"] = {BODY_DEADLINE: {"at": deadline}}
    return Request(scope, receive)


def _read(request: Request, limit: int = 1024) -> Any:
    return asyncio.run(read_json(request, limit))


@pytest.mark.parametrize(
    ("content_type", "ok"),
    [
        ("application/json", True),
        ("application/json; charset=utf-8", True),
        ("Application/JSON", True),
        ("application/vnd.api+json", True),
        ("application/x-www-form-urlencoded", False),
        ("text/plain", False),
        ("multipart/form-data; boundary=x", False),
        ("text/json+xml", False),
    ],
)
def test_json_media_types(content_type: str, ok: bool) -> None:
    assert is_json(content_type) is ok


def test_a_body_declared_as_something_else_gets_415() -> None:
    request = _request([b'{"a": 1}'], {"content-type": "application/x-www-form-urlencoded"})
    with pytest.raises(errors.UnsupportedMediaType) as info:
        _read(request)
    assert info.value.status == 415 and "x-www-form-urlencoded" in info.value.message


@pytest.mark.parametrize("headers", [{}, {"content-type": "application/json; charset=utf-8"}])
def test_json_or_no_content_type_is_read(headers: dict[str, str]) -> None:
    assert _read(_request([b'{"a": ', b"1}"], headers)) == {"a": 1}


def test_a_body_that_stalls_past_its_deadline_gets_408() -> None:
    async def go() -> None:
        past = asyncio.get_running_loop().time() - 1  # the deadline is over: no waiting here
        async with asyncio.timeout(5):  # were the deadline ignored, this would end it (and fail)
            await read_json(_request([b'{"a": '], {}, deadline=past), 1024)

    with pytest.raises(errors.RequestTimeout) as info:
        asyncio.run(go())
    assert info.value.status == 408 and info.value.headers == {"connection": "close"}


def test_size_and_syntax_are_still_checked() -> None:
    with pytest.raises(errors.PayloadTooLarge):
        _read(_request([b"x" * 2000], {}), limit=1024)
    with pytest.raises(errors.InvalidRequest):
        _read(_request([b"{nope"], {}))
