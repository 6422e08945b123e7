"""The OpenAPI document without a server: built from routes, agreeing with the validators."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson
import pytest
from jsonschema import Draft202012Validator
from pydantic import ValidationError
from starlette.requests import Request
from starlette.routing import Mount, Route

from gateway.api import openai_protocol as oai
from gateway.errors import InvalidRequest
from gateway.http import app as gateway_app
from gateway.http import openapi
from gateway.settings import GatewaySettings
from gateway.tenancy import admin_protocol as ap

SETTINGS = GatewaySettings(redis_url="redis://127.0.0.1:1/0", model_name="tiny", max_body_bytes=4096)


async def _nothing(request: Request) -> None:
    return None


def _routes() -> list[Any]:
    return [Route(path, _nothing, methods=[method]) for method, path in openapi.OPERATIONS if
            not path.startswith("/admin")] + [
        Mount("/admin", routes=[Route(path.removeprefix("/admin"), _nothing, methods=[method])
                                for method, path in openapi.OPERATIONS if path.startswith("/admin")])
    ]


def test_route_table_flattens_mounts_and_drops_head() -> None:
    routes = [Route("/a/{x:path}", _nothing, methods=["GET"]), Mount("/m", routes=[Route("/b", _nothing)])]
    assert sorted(openapi.route_table(routes)) == [("GET", "/a/{x}"), ("GET", "/m/b")]


def test_the_document_has_one_operation_per_route() -> None:
    doc = openapi.document(_routes(), SETTINGS)
    assert sum(len(item) for item in doc["paths"].values()) == len(openapi.OPERATIONS) == 26  # +POST .../tune
    assert "4096 bytes" in doc["paths"]["/v1/completions"]["post"]["responses"]["413"]["description"]


def test_a_route_without_an_operation_or_an_operation_without_a_route_stops_start_up() -> None:
    with pytest.raises(ValueError, match=r"undocumented \['PUT /v1/models'\]"):
        openapi.document([*_routes(), Route("/v1/models", _nothing, methods=["PUT"])], SETTINGS)
    with pytest.raises(ValueError, match=r"unrouted \['GET /healthz'\]"):
        openapi.document([r for r in _routes() if getattr(r, "path", "") != "/healthz"], SETTINGS)


def test_documented_adds_the_route_that_serves_it() -> None:
    routes = openapi.documented([r for r in _routes() if getattr(r, "path", "") != openapi.OPENAPI_PATH], SETTINGS)
    assert ("GET", openapi.OPENAPI_PATH) in set(openapi.route_table(routes))


@pytest.mark.parametrize(("value", "ok"), [("0", False), ("0.001", True), ("86399999", True), ("86400000", False),
                                           ("-5", False), ("nan", False), ("soon", False)])
def test_the_deadline_header_is_bounded_as_documented(value: str, ok: bool) -> None:
    assert gateway_app.DEADLINE_HEADER == openapi.DEADLINE_HEADER
    schema = openapi.DEADLINE_PARAM["schema"]
    try:
        number: Any = orjson.loads(value)  # the header's value as a JSON number, if it is one
    except orjson.JSONDecodeError:
        number = value
    assert Draft202012Validator(schema).is_valid(number) is ok
    request = Request({"type": "http", "headers": [(openapi.DEADLINE_HEADER.encode(), value.encode())]})
    if ok:
        assert gateway_app._deadline_s(request) == pytest.approx(float(value) / 1000)
    else:
        with pytest.raises(InvalidRequest):
            gateway_app._deadline_s(request)


def _schema(name: str) -> Draft202012Validator:
    doc = openapi.document(_routes(), SETTINGS)
    return Draft202012Validator({"$ref": openapi.REF.format(model=name), "components": doc["components"]})


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
TEXT = {"model": "tiny", "prompt": "hi"}


@pytest.mark.parametrize(
    ("name", "body"),
    [
        ("ChatCompletionRequest", {**CHAT, "logprobs": True}),
        ("ChatCompletionRequest", {**CHAT, "logprobs": False, "presence_penalty": 0.5}),
        ("ChatCompletionRequest", {**CHAT, "frequency_penalty": -1}),
        ("ChatCompletionRequest", {**CHAT, "tools": [{"type": "function"}]}),
        ("ChatCompletionRequest", {**CHAT, "n": 2}),
        ("ChatCompletionRequest", {**CHAT, "stop": ["a", "b", "c", "d", "e"]}),
        ("ChatCompletionRequest", {**CHAT, "seed": 2**63}),
        ("ChatCompletionRequest", {**CHAT, "max_tokens": 2**31}),
        ("ChatCompletionRequest", {**CHAT, "temperature": "1"}),
        ("ChatCompletionRequest", {**CHAT, "user": "u" * 257}),
        ("ChatCompletionRequest", {**CHAT, "messages": [{"role": "user", "content": [{"type": "image"}]}]}),
        ("CompletionRequest", {**TEXT, "echo": True}),
        ("CompletionRequest", {**TEXT, "prompt": [2**31]}),
        ("CompletionRequest", {**TEXT, "prompt": ["a", "b"]}),
        ("TenantCreate", {"name": "acme", "rate": 1, "typo": 1}),
        ("TenantCreate", {"name": "a_b", "rate": 1}),
        ("TenantUpdate", {"name": None}),
        ("TenantUpdate", {"limits": None}),
        ("TenantUpdate", {"priority": 10}),
        ("TenantCreate", {"name": "acme", "rate": 1, "slo_ttft_ms": 0}),
        ("TenantUpdate", {"slo_ttft_ms": 600_001}),
        ("TenantUpdate", {"slo_tpot_ms": "40"}),
        ("KeyCreate", {"name": "k" * 129}),
    ],
)
def test_what_the_schema_refuses_the_gateway_refuses(name: str, body: dict[str, Any]) -> None:
    assert not _schema(name).is_valid(body)
    model = {m.__name__: m for m in openapi.REQUEST_MODELS}[name]
    with pytest.raises(ValidationError):
        model.model_validate(body)


@pytest.mark.parametrize(
    ("name", "body"),
    [
        ("ChatCompletionRequest", {**CHAT, "logprobs": False, "presence_penalty": 0, "tools": [], "n": 1}),
        ("ChatCompletionRequest", {**CHAT, "logprobs": None, "tools": None, "stop": "x", "seed": -(2**63)}),
        ("ChatCompletionRequest", {**CHAT, "messages": [{"role": "tool", "content": [{"type": "text", "text": "x"}]}],
                                   "unknown_openai_field": {"ignored": True}}),
        ("CompletionRequest", {**TEXT, "prompt": [0, 2**31 - 1], "echo": False, "max_tokens": 2**31 - 1}),
        ("TenantCreate", {"name": "acme", "rate": 1, "limits": {"max_concurrent": None}}),
        ("TenantUpdate", {"limits": {"allowed_models": None}}),
        ("TenantUpdate", {}),
        ("TenantCreate", {"name": "acme", "rate": 1, "slo_ttft_ms": 600_000, "slo_tpot_ms": None}),
        ("TenantUpdate", {"slo_ttft_ms": None, "slo_tpot_ms": 60_000}),
        ("KeyCreate", {}),
    ],
)
def test_what_the_schema_accepts_the_gateway_accepts(name: str, body: dict[str, Any]) -> None:
    assert _schema(name).is_valid(body)
    model = {m.__name__: m for m in openapi.REQUEST_MODELS}[name]
    model.model_validate(body)


def test_the_examples_are_accepted() -> None:
    doc = openapi.document(_routes(), SETTINGS)
    parse: dict[str, Callable[[Any], object]] = {
        "/v1/chat/completions": oai.parse_chat,
        "/v1/completions": oai.parse_completion,
        "/admin/tenants": ap.parse_create,
        "/admin/tenants/{tenant}": ap.parse_update,
        "/admin/tenants/{tenant}/keys": ap.parse_key_create,
    }
    for path, item in doc["paths"].items():
        for op in item.values():
            if "requestBody" in op:
                parse.pop(path)(op["requestBody"]["content"]["application/json"]["example"])
    assert not parse
