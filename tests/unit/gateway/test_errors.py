import orjson
import pytest

from gateway import errors as e


@pytest.mark.parametrize(
    ("exc", "status", "type_", "code"),
    [
        (e.InvalidRequest("x", param="p"), 400, "invalid_request_error", None),
        (e.Unauthorized("x"), 401, "invalid_request_error", "invalid_api_key"),
        (e.ModelNotFound("x"), 404, "invalid_request_error", "model_not_found"),
        (e.RequestTimeout("x"), 408, "invalid_request_error", "body_timeout"),
        (e.PayloadTooLarge("x"), 413, "invalid_request_error", "payload_too_large"),
        (e.UnsupportedMediaType("x"), 415, "invalid_request_error", "unsupported_media_type"),
        (e.RateLimited("x"), 429, "requests", "rate_limit_exceeded"),
        (e.Unavailable("x"), 503, "server_error", "service_unavailable"),
        (e.Timeout("x"), 503, "server_error", "timeout"),
    ],
)
def test_one_mapping_to_status_and_openai_body(exc: e.GatewayError, status: int, type_: str, code: str | None) -> None:
    response = e.error_response(exc)
    assert response.status_code == status
    body = orjson.loads(response.body)
    assert body == {"error": {"message": "x", "type": type_, "param": exc.param, "code": code}}


def test_headers_and_extra_fields_travel() -> None:
    exc = e.RateLimited("slow down", headers={"retry-after": "2"}, extra={"estimate_s": 1.5})
    response = e.error_response(exc)
    assert response.headers["retry-after"] == "2"
    assert orjson.loads(response.body)["error"]["estimate_s"] == 1.5


def test_worker_and_scheduler_failures_map_to_the_right_status() -> None:
    from common import protocol as p
    from gateway.http.lifecycle import failure as _failure

    dropped = _failure(p.Failed("r1", "deadline", "queued past its deadline"))
    assert (dropped.status, dropped.code) == (503, "deadline_unmet") and "r1" in dropped.message
    assert _failure(p.Failed("r2", "redis", "down")).status == 503
    crashed = _failure(p.Failed("r3", "dead_letter", "failed 3 deliveries"))
    assert (crashed.status, crashed.code) == (500, "dead_letter") and "r3" in crashed.message


def test_every_429_and_503_says_when_to_retry() -> None:
    for exc in (e.RateLimited("slow down"), e.Unavailable("later"), e.Overloaded("full"), e.Timeout("late")):
        assert e.error_response(exc).headers["retry-after"] == str(e.RETRY_AFTER_S)
    assert "retry-after" not in e.error_response(e.InvalidRequest("bad")).headers


def test_lost_work_and_shutdown_are_503s_a_client_may_retry() -> None:
    from common import protocol as p
    from gateway.http.lifecycle import failure

    for code in ("lost", "shutdown", "gateway_error", "no_worker"):
        err = failure(p.Failed("r", code, "gone"))
        assert (err.status, err.code) == (503, code)
    assert failure(p.Failed("r", "unencodable", "bad")).status == 400
