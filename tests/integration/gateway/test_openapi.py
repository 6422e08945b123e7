"""`GET /openapi.json` against the gateway it describes (in process, real Redis, echo
worker): a valid OpenAPI 3.1 document of exactly the app's routes, and real responses of
every route, successes and errors, conform to it: documented status, body schema, headers."""

from __future__ import annotations

import re
from typing import Any

import httpx
import orjson
import pytest
from jsonschema import Draft202012Validator
from openapi_spec_validator import validate as validate_openapi

from gateway.http import console, openapi
from gateway.http.app import create_app
from tests.integration.gateway.conftest import ADMIN, Harness

pytestmark = [pytest.mark.redis, pytest.mark.anyio]


async def _document(harness: Harness) -> dict[str, Any]:
    r = await harness.http.get("/openapi.json")  # no key, no admin token
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    doc: dict[str, Any] = r.json()
    return doc


class Conformance:
    """Checks responses against the document, as a client generated from it would read them."""

    def __init__(self, doc: dict[str, Any]) -> None:
        self.doc = doc
        self.seen: set[tuple[str, str, int]] = set()

    def _validate(self, schema: dict[str, Any], value: Any, where: str) -> None:
        validator = Draft202012Validator({**schema, "components": self.doc["components"]})
        errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(value)]
        assert not errors, f"{where}: {errors}\n{value!r}"

    def _operation(self, method: str, url: str) -> tuple[str, dict[str, Any]]:
        path = httpx.URL(url).path
        for template, item in self.doc["paths"].items():
            if re.fullmatch(re.sub(r"{\w+}", "[^/]+", template), path) and method.lower() in item:
                return template, item[method.lower()]
        raise AssertionError(f"{method} {path} is not in the document")

    def check(self, r: httpx.Response) -> httpx.Response:
        method = r.request.method
        template, op = self._operation(method, str(r.request.url))
        where = f"{method} {template} -> {r.status_code}"
        assert str(r.status_code) in op["responses"], f"{where}: undocumented status\n{r.text[:500]}"
        self.seen.add((method, template, r.status_code))
        documented = op["responses"][str(r.status_code)]
        for name, header in documented.get("headers", {}).items():
            value = r.headers.get(name)
            if value is None:
                assert not header.get("required"), f"{where}: no {name} header"
                continue
            kind = header["schema"]["type"]
            self._validate(header["schema"], int(value) if kind == "integer" else
                           float(value) if kind == "number" else value, f"{where}, header {name}")
        media = r.headers["content-type"].split(";")[0].strip()
        assert media in documented["content"], f"{where}: undocumented content type {media}"
        schema = documented["content"][media]["schema"]
        if media == "application/json":
            self._validate(schema, r.json(), where)
        elif media == "text/event-stream":
            events = [line for line in r.text.split("\n\n") if line]
            assert events[-1] == "data: [DONE]" or '"error"' in events[-1], f"{where}: {events[-1]}"
            for event in events:
                assert event.startswith("data: "), event
                data = event.removeprefix("data: ")
                self._validate(schema, {"data": data}, where)
                if data != "[DONE]":  # contentSchema is an annotation: validate the decoded data here
                    content = schema["properties"]["data"]["anyOf"][1]["contentSchema"]
                    self._validate(content, orjson.loads(data), f"{where}, event")
        else:
            assert schema == {"type": "string"}, where
        return r


async def test_the_document_is_valid_openapi_3_1(harness: Harness) -> None:
    doc = await _document(harness)
    validate_openapi(doc)
    assert doc["openapi"] == "3.1.0"
    assert doc["components"]["securitySchemes"]["ApiKey"] == {
        "type": "http", "scheme": "bearer", "description": doc["components"]["securitySchemes"]["ApiKey"]["description"]
    }


async def test_its_paths_are_exactly_the_routes(harness: Harness) -> None:
    doc = await _document(harness)
    app = create_app(harness.gw)
    while not hasattr(app, "routes"):  # through the raw ASGI layers around Starlette
        app = app.app  # type: ignore[attr-defined]
    routes = app.routes
    table = set(openapi.route_table(routes)) - set(openapi.route_table(console.routes()))  # pages, not API
    assert {(m.upper(), p) for p, item in doc["paths"].items() for m in item} == table
    assert len(table) == 26 and {("GET", "/admin/tenants/{tenant}/usage"), ("GET", "/health")} <= table
    for path, item in doc["paths"].items():
        for method, op in item.items():
            wanted = "AdminToken" if path.startswith("/admin") else "ApiKey" if path.startswith("/v1") else None
            assert op["security"] == ([{wanted: []}] if wanted else []), (method, path)
            if wanted:
                assert "401" in op["responses"], (method, path)
            for status, response in op["responses"].items():
                if int(status) >= 400 and path not in openapi.PROBES:
                    assert response["content"]["application/json"]["schema"] == openapi.ref("ErrorResponse")


async def test_request_schemas_are_the_validating_models(harness: Harness) -> None:
    schemas = (await _document(harness))["components"]["schemas"]
    for model in openapi.REQUEST_MODELS:
        own = model.model_json_schema(ref_template=openapi.REF)
        own.pop("$defs", None)
        assert schemas[model.__name__] == own, model.__name__


async def test_real_responses_conform(harness: Harness) -> None:
    conformance = Conformance(await _document(harness))
    check = conformance.check
    http, model = harness.http, harness.model
    admin = {"authorization": f"Bearer {ADMIN}"}

    # the admin API, its successes and its refusals
    t = check(await http.post("/admin/tenants", json={"name": "acme", "rate": 1000}, headers=admin))
    tid = t.json()["id"]
    check(await http.post("/admin/tenants", json={"name": "acme", "rate": 1000}, headers=admin))  # 409
    check(await http.post("/admin/tenants", json={"name": "acme", "rate": "1000"}, headers=admin))  # 400
    check(await http.post("/admin/tenants", json={"name": "x", "rate": 1}))  # 401
    check(await http.get("/admin/tenants", headers=admin))
    check(await http.get("/admin/tenants/acme", headers=admin))
    check(await http.get("/admin/tenants/nobody", headers=admin))  # 404
    check(await http.patch(f"/admin/tenants/{tid}", json={"limits": {"max_concurrent": 4}}, headers=admin))
    fast = check(await http.post("/admin/tenants", json={"name": "fast", "rate": 1, "slo_ttft_ms": 800,
                                                          "slo_tpot_ms": 40}, headers=admin))
    check(await http.patch("/admin/tenants/fast", json={"slo_ttft_ms": None}, headers=admin))
    check(await http.patch("/admin/tenants/fast", json={"slo_tpot_ms": 0}, headers=admin))  # 400
    check(await http.delete(f"/admin/tenants/{fast.json()['id']}", headers=admin))
    key = check(await http.post("/admin/tenants/acme/keys", json={"name": "k"}, headers=admin)).json()["key"]
    check(await http.post("/admin/tenants/acme/keys", headers=admin))  # no body: a key without a name
    check(await http.get("/admin/tenants/acme/keys", headers=admin))
    check(await http.get("/admin/workers", headers=admin))
    check(await http.get("/admin/scheduler", headers=admin))
    check(await http.get("/admin/usage", headers=admin))
    check(await http.get("/admin/cluster", headers=admin))
    check(await http.get("/admin/tenants/acme/usage?since=abc", headers=admin))  # 400

    # generation: JSON and streams, both routes, with every header the document promises
    auth = {"authorization": f"Bearer {key}"}
    hello = [{"role": "user", "content": "Say hello."}]
    chat = {"model": model, "messages": hello, "max_tokens": 5}
    done = check(await http.post("/v1/chat/completions", json=chat, headers=auth))
    assert done.status_code == 200 and done.headers["x-ratelimit-limit-requests"] == "4"
    check(await http.post("/v1/chat/completions", json={**chat, "stream": True}, headers=auth))
    check(await http.post("/v1/chat/completions", headers=auth,
                          json={**chat, "stream": True, "stream_options": {"include_usage": True}}))
    text = {"model": model, "prompt": [1, 2, 3], "max_tokens": 5}
    check(await http.post("/v1/completions", json=text, headers=auth))
    check(await http.post("/v1/completions", json={**text, "stream": True, "stream_options": {"include_usage": True}},
                          headers=auth))
    check(await http.get("/v1/models", headers=auth))
    assert check(await http.get(f"/v1/models/{model}", headers=auth)).json()["id"] == model
    check(await http.get(f"/v1/requests/{done.headers['x-request-id']}", headers=auth))
    check(await http.get(f"/v1/requests/{done.json()['id']}", headers=auth))
    check(await http.get("/v1/requests/0123", headers=auth))  # 404
    check(await http.get(f"/admin/requests/{done.headers['x-request-id']}", headers=admin))
    check(await http.get("/admin/requests/0123", headers=admin))  # 404
    check(await http.get("/admin/traffic", headers=admin))  # text/csv
    check(await http.post("/admin/scheduler/tune", headers=admin))  # 202: asked

    # generation's refusals
    check(await http.post("/v1/chat/completions", json=chat))  # 401
    check(await http.post("/v1/chat/completions", json={**chat, "model": "gpt-17"}, headers=auth))  # 404
    check(await http.get("/v1/models/gpt-17", headers=auth))  # 404
    check(await http.get(f"/v1/models/{model}"))  # 401
    check(await http.post("/v1/chat/completions", content=b"{not json", headers=auth))  # 400
    check(await http.post("/v1/chat/completions", json={**chat, "max_tokens": 10**9}, headers=auth))  # 400
    check(await http.post("/v1/chat/completions", json=chat, headers={**auth, "x-tokengate-deadline-ms": "0"}))
    late = check(await http.post("/v1/completions", json=text, headers={**auth, "x-tokengate-deadline-ms": "0.01"}))
    assert late.status_code == 503 and late.json()["error"]["code"] == "deadline_unmet"
    small = {"rate": 1, "burst": 20, "max_queue_delay_s": 0,  # a burst of 20 holds the largest request: 4 + 16
             "limits": {"max_prompt_tokens": 4, "max_output_tokens": 16}}
    assert (await http.patch("/admin/tenants/acme", json=small, headers=admin)).status_code == 200
    check(await http.post("/v1/completions", json={**text, "max_tokens": 16}, headers=auth))  # 200, spends the burst
    poor = check(await http.post("/v1/completions", json={**text, "max_tokens": 16}, headers=auth))
    assert poor.status_code == 429 and "budget_wait_s" in poor.json()["error"]
    check(await http.post("/v1/completions", content=b"[" * (2 << 20), headers=auth))  # 413 (then held a second)

    # operations, then the admin deletions
    check(await http.get("/healthz"))
    check(await http.get("/readyz"))
    assert check(await http.get("/health")).content == b""  # vLLM's, as /readyz judges
    check(await http.get("/metrics"))
    check(await http.get("/openapi.json"))
    prefix = key.split("-")[1]
    check(await http.delete(f"/admin/keys/{prefix}", headers=admin))
    check(await http.delete(f"/admin/keys/{prefix}", headers=admin))  # 404
    check(await http.delete("/admin/tenants/acme", headers=admin))

    statuses = {s for _, _, s in conformance.seen}
    assert statuses == {200, 201, 202, 400, 401, 404, 409, 413, 429, 503}
    assert len({(m, p) for m, p, _ in conformance.seen}) == 26  # every operation
