"""HTTP helpers shared by the OpenAI and the admin routes."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse

from gateway.errors import ClientGone, InvalidRequest, PayloadTooLarge, RequestTimeout, UnsupportedMediaType

# The scope extension in which the server (``gateway.http.protocol.GuardedProtocol``) puts the event
# loop time by which a request's body must have arrived: ``{"at": loop_time}``.
BODY_DEADLINE = "tokengate.body_deadline"


class ORJSONResponse(JSONResponse):
    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


def is_json(content_type: str) -> bool:
    """``application/json`` or ``application/<anything>+json``, parameters (charset) allowed."""
    mime = content_type.split(";", 1)[0].strip().lower()
    return mime == "application/json" or (mime.startswith("application/") and mime.endswith("+json"))


def body_deadline(request: Request) -> float | None:
    """When the body must have arrived (event loop time), if the server set a deadline."""
    deadline = request.scope.get("extensions", {}).get(BODY_DEADLINE)
    return None if deadline is None else float(deadline["at"])


async def read_json(request: Request, limit: int) -> Any:
    """The request's JSON body: 415 if it is declared as something else (no Content-Type is
    accepted), 413 over ``limit`` bytes, 408 past the server's body deadline, 400 if invalid."""
    return parse_json(await read_body(request, limit))


def declared_length(request: Request) -> int | None:
    """The body's declared ``Content-Length`` (None: absent or not a number)."""
    declared = request.headers.get("content-length")
    return int(declared) if declared is not None and declared.isdigit() else None


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body, read up to ``limit`` bytes: 415 if it is declared as something other
    than JSON, 413 over the limit (from the declared length, before anything is read, where
    there is one; ``PayloadTooLarge.read`` says how much was read), 408 past the body deadline."""
    declared_type = request.headers.get("content-type", "").strip()
    if declared_type and not is_json(declared_type):
        raise UnsupportedMediaType(
            f"The request body must be JSON (Content-Type: application/json), not {declared_type[:100]!r}.",
            param="Content-Type",
        )
    declared = declared_length(request)
    if declared is not None and declared > limit:
        raise PayloadTooLarge(f"The request body is larger than {limit} bytes.")
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout_at(body_deadline(request)):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise PayloadTooLarge(f"The request body is larger than {limit} bytes.", read=size)
                chunks.append(chunk)
    except ClientDisconnect:
        raise ClientGone(f"The client left before its body was complete ({size} bytes received).") from None
    except TimeoutError:
        raise RequestTimeout(
            f"The request body did not arrive in time ({size} bytes received).",
            headers={"connection": "close"},
        ) from None
    return b"".join(chunks)


def parse_json(body: bytes) -> Any:
    """A body as JSON; 400 if it is not."""
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"The request body is not valid JSON: {exc}") from None
