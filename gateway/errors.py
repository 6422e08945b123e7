"""One error tree, one mapping to HTTP status and OpenAI's error object.

OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``; the official client
picks its exception class from the status code (400 BadRequestError, 401
AuthenticationError, 404 NotFoundError, 409 ConflictError, 408, 413, 415 and others
APIStatusError, 429 RateLimitError, 503 InternalServerError).
"""

from __future__ import annotations

from typing import Literal

import orjson
from pydantic import ConfigDict, with_config
from starlette.responses import Response
from typing_extensions import TypedDict  # pydantic needs this one before Python 3.12

# -- OpenAI's error object, the shape every error body has (``gateway.api.shapes`` lists it
# among the response shapes the OpenAPI document publishes)

ErrorType = Literal["invalid_request_error", "server_error", "requests", "tokens"]


class ErrorExtra(TypedDict, total=False):
    """What an error object may add to OpenAI's four fields."""

    budget_wait_s: float
    estimate_ms: float
    best_ttft_p99_ms: float
    best_p99_ms: float


@with_config(ConfigDict(extra="forbid"))
class ErrorObject(ErrorExtra):
    """OpenAI's error object; ``budget_wait_s`` on a 429 over the token budget, ``estimate_ms``
    on a 503 whose deadline or SLO cannot be met, and on the latter the best bounds the
    gateway could promise (``best_ttft_p99_ms``, ``best_p99_ms``)."""

    message: str
    type: ErrorType
    param: str | None
    code: str | None


@with_config(ConfigDict(extra="forbid"))
class ErrorResponse(TypedDict):
    error: ErrorObject


# -- the error tree --------------------------------------------------------------------------



class GatewayError(Exception):
    status = 500
    type: ErrorType = "server_error"
    code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        extra: ErrorExtra | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.headers = headers or {}
        self.extra: ErrorExtra = extra or {}


class InvalidRequest(GatewayError):
    status = 400
    type: ErrorType = "invalid_request_error"


class Unauthorized(GatewayError):
    status = 401
    type: ErrorType = "invalid_request_error"
    code = "invalid_api_key"


class NotFound(GatewayError):
    status = 404
    type: ErrorType = "invalid_request_error"
    code = "not_found"


class ModelNotFound(NotFound):
    code = "model_not_found"


class Conflict(GatewayError):
    status = 409
    type: ErrorType = "invalid_request_error"
    code = "conflict"


class ClientGone(GatewayError):
    """The client closed its connection before its request was complete: nobody is left to
    answer; the status (nginx's 499) only reaches the metrics."""

    status = 499
    type: ErrorType = "invalid_request_error"
    code = "client_closed_request"


class RequestTimeout(GatewayError):
    """The client did not send its request (headers or body) in time."""

    status = 408
    type: ErrorType = "invalid_request_error"
    code = "body_timeout"


class PayloadTooLarge(GatewayError):
    status = 413
    type: ErrorType = "invalid_request_error"
    code = "payload_too_large"

    def __init__(self, message: str, *, read: int = 0, headers: dict[str, str] | None = None) -> None:
        super().__init__(message, headers=headers)
        self.read = read  # body bytes read before the refusal (0: refused from the declared length)


class UnsupportedMediaType(GatewayError):
    """A body declared as something other than JSON."""

    status = 415
    type: ErrorType = "invalid_request_error"
    code = "unsupported_media_type"


class RateLimited(GatewayError):
    status = 429
    type: ErrorType = "requests"
    code = "rate_limit_exceeded"


class TokensRateLimited(RateLimited):
    """Over the tenant's token budget (OpenAI's ``tokens`` limit type)."""

    type: ErrorType = "tokens"


class Unavailable(GatewayError):
    status = 503
    type: ErrorType = "server_error"
    code = "service_unavailable"


class Overloaded(Unavailable):
    code = "overloaded"


class Timeout(Unavailable):
    code = "timeout"


class WorkerFailed(GatewayError):
    status = 500
    type: ErrorType = "server_error"
    code = "worker_error"


class UpstreamFailed(WorkerFailed):
    """The server an upstream worker fronts failed this request (docs/operations.md)."""

    status = 502
    code = "upstream_error"


def error_body(exc: GatewayError) -> ErrorResponse:
    return {"error": {"message": exc.message, "type": exc.type, "param": exc.param, "code": exc.code, **exc.extra}}


RETRY_AFTER_S = 1  # what a 429 or 503 that knows no better tells the client to wait


def error_response(exc: GatewayError) -> Response:
    """The one mapping to HTTP: status, OpenAI's body, and ``Retry-After`` on every 429/503."""
    headers = exc.headers
    if exc.status in (429, 503) and "retry-after" not in headers:
        headers = {**headers, "retry-after": str(RETRY_AFTER_S)}
    return Response(
        orjson.dumps(error_body(exc)),
        status_code=exc.status,
        media_type="application/json",
        headers=headers,
    )
