"""The OpenAPI 3.1 document of the HTTP surface, served at ``GET /openapi.json``.

Built once, when the app is made, from the app's own route table (``documented``): every
(method, path) of the routes, the ``/admin`` mount included, must have exactly one entry in
``OPERATIONS`` and the other way round, or start-up fails naming the difference, so the
table and the document cannot drift. Request bodies are the JSON schemas of the pydantic
models that validate them (``gateway.api.openai_protocol``, ``gateway.tenancy.admin_protocol``);
response bodies and headers are the shapes the handlers build (``gateway.api.shapes``), and tests check
real responses against the document (``tests/integration/gateway/test_openapi.py``).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson
from pydantic import TypeAdapter
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Mount, Route

from gateway.api import openai_protocol as oai
from gateway.api.headers import (
    ADMITTED_HEADERS,
    DEADLINE_HEADER,
    DEADLINE_MS_MAX,
    HEADERS,
    OPTIONAL_ADMITTED_HEADERS,
    SLO_HEADERS,
)
from gateway.api.shapes import RESPONSE_TYPES
from gateway.http import admin
from gateway.settings import GatewaySettings
from gateway.tenancy import admin_protocol as ap
from gateway.tenancy.tenants import SLO_MS_MIN

OPENAPI_PATH = "/openapi.json"
PROBES = ("/readyz", "/health")  # their 503 is a probe's answer (`NotReady`), not an OpenAI error
REF = "#/components/schemas/{model}"



REQUEST_MODELS: tuple[type[Any], ...] = (
    oai.ChatCompletionRequest,
    oai.CompletionRequest,
    ap.TenantCreate,
    ap.TenantUpdate,
    ap.KeyCreate,
)
def schemas() -> dict[str, Any]:
    """``components/schemas``: the request models as they validate (``mode="validation"``)
    and the response shapes, with their shared parts once each."""
    inputs = [(t.__name__, "validation", TypeAdapter(t)) for t in REQUEST_MODELS]
    inputs += [(t.__name__, "serialization", TypeAdapter(t)) for t in RESPONSE_TYPES]
    _, defs = TypeAdapter.json_schemas(inputs, ref_template=REF)  # type: ignore[arg-type]
    found: dict[str, Any] = defs["$defs"]
    missing = [t.__name__ for t in (*REQUEST_MODELS, *RESPONSE_TYPES) if t.__name__ not in found]
    if missing:  # a name clash made pydantic qualify a name
        raise RuntimeError(f"schemas missing from the OpenAPI components: {missing}")
    return dict(sorted(found.items()))


def ref(name: str) -> dict[str, str]:
    return {"$ref": REF.format(model=name)}


def _headers(required: Sequence[str], optional: Sequence[str] = ()) -> dict[str, Any]:
    # inline, not $ref: OpenAPI 3.1 allows no "required" beside a reference
    out = {h: {**HEADERS[h], "required": True} for h in required}
    return out | {h: HEADERS[h] for h in optional}


# -- operations --------------------------------------------------------------------------------

Security = Literal["ApiKey", "AdminToken"] | None


@dataclass(frozen=True)
class Operation:
    """One (method, path) of the route table, as the document describes it."""

    summary: str
    tag: str
    security: Security
    ok: tuple[int, str]  # status, response schema ("": text)
    errors: dict[int, str] = field(default_factory=dict)  # status -> when
    body: str | None = None  # request schema name
    body_required: bool = True
    parameters: tuple[dict[str, Any], ...] = ()
    ok_headers: tuple[Sequence[str], Sequence[str]] = ((), ())  # required, optional
    streams: str | None = None  # the chunk schema of a text/event-stream 200
    text_type: str = "text/plain"  # a text response's media type


def _path_param(name: str, description: str) -> dict[str, Any]:
    # any string: one that names nothing is a 404
    return {"name": name, "in": "path", "required": True, "description": description, "schema": {"type": "string"}}


def _query_seconds(name: str, default: str) -> dict[str, Any]:
    return {
        "name": name,
        "in": "query",
        "required": False,
        "description": f"Unix seconds; default {default}.",
        "schema": {"type": "number", "minimum": 0, "exclusiveMaximum": 1e11},
    }


_MODEL_QUERY = {
    "name": "model",
    "in": "query",
    "required": False,
    "description": "The model whose scheduling domain to show; default the gateway's first model.",
    "schema": {"type": "string"},
}
_NO_MODEL = "`model_not_found`: this gateway serves no such model."


DEADLINE_PARAM = {
    "name": DEADLINE_HEADER,
    "in": "header",
    "required": False,
    "description": "The client's deadline in milliseconds from now (0 < N < 86,400,000). A request the "
    "scheduler cannot serve in time is refused at once (429 or 503 `deadline_unmet`).",
    "schema": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": DEADLINE_MS_MAX},
}

SLO_PARAMS = tuple(
    {
        "name": name,
        "in": "header",
        "required": False,
        "description": f"The client's SLO on its {what} in milliseconds ({SLO_MS_MIN:g} ≤ N ≤ {top:,.0f}); "
        "without it, the tenant's default SLO applies. A request whose calibrated p99 bound cannot meet it is "
        "refused at once (503 `slo_unattainable`, with `Retry-After` and the best bounds).",
        "schema": {"type": "number", "minimum": SLO_MS_MIN, "maximum": top},
    }
    for (name, top), what in zip(SLO_HEADERS.items(), ("first token", "time per output token"), strict=True)
)

REDIS_DOWN = "`redis_unavailable`: the gateway's store is not answering."
BAD_JSON = "The body is not a JSON object, or a field is invalid (`param` names it)."
NOT_JSON = "`unsupported_media_type`: the body is declared as something other than JSON."
SLOW_BODY = "`body_timeout`: the body did not arrive within the server's body deadline; the connection closes."


def _generation(summary: str, body: str, chunk: str, ok: str) -> Operation:
    return Operation(
        summary=summary,
        tag="openai",
        security="ApiKey",
        ok=(200, ok),
        body=body,
        parameters=(DEADLINE_PARAM, *SLO_PARAMS),
        ok_headers=(ADMITTED_HEADERS, OPTIONAL_ADMITTED_HEADERS),
        streams=chunk,
        errors={
            400: BAD_JSON + " Also `context_length_exceeded`, `prompt_too_long`, `max_tokens_exceeded`, "
            "`budget_exceeded` (more than the burst), a bad `x-tokengate-deadline-ms`, `x-slo-ttft-ms` or "
            "`x-slo-tpot-ms`.",
            401: "`invalid_api_key`: no, a malformed, an unknown or a revoked key.",
            404: "`model_not_found`: not a model this gateway serves, or not one the tenant may use.",
            413: "`payload_too_large`: the body is over the gateway's `--max-body-bytes`.",
            408: SLOW_BODY,
            415: NOT_JSON,
            429: "`rate_limit_exceeded`: over the tenant's token budget (`type` `tokens`, with "
            "`budget_wait_s`) or its `max_concurrent` (`type` `requests`), or too many long prompts "
            "being tokenized for the tenant; `oversize_held`: the tenant keeps sending requests refused "
            "for their size, past its allowance (docs/api.md, \"Oversized requests\").",
            500: "`worker_error`: the model worker failed on this request.",
            503: "`no_worker`, `overloaded`, `timeout`, `deadline_unmet` (with `estimate_ms`), "
            "`slo_unattainable` (with `estimate_ms`, `best_ttft_p99_ms` and `best_p99_ms`), `lost`, "
            "`shutdown`, " + REDIS_DOWN,
        },
    )


ADMIN_TOO_LARGE = f"`payload_too_large`: the body is over {admin._ADMIN_BODY_LIMIT // 1024} KiB."
_TENANT = _path_param("tenant", "The tenant's id (`tn_…`) or its name.")
_NO_TENANT = "`not_found`: no such tenant."
_BURST_TOO_SMALL = ("`burst_too_small` (`param` `burst`): the tenant's burst would not hold one request within its "
                    "limits (`limits.max_prompt_tokens` + `limits.max_output_tokens`, or the model's context where "
                    "either is unset); the message names the fix.")
_ADMIN_401 = "`invalid_admin_token`, or `admin_disabled` when the gateway has no admin token."

OPERATIONS: dict[tuple[str, str], Operation] = {
    ("POST", "/v1/chat/completions"): _generation(
        "Create a chat completion", "ChatCompletionRequest", "ChatCompletionChunk", "ChatCompletion"
    ),
    ("POST", "/v1/completions"): _generation(
        "Create a completion", "CompletionRequest", "TextCompletionChunk", "TextCompletion"
    ),
    ("GET", "/v1/models"): Operation(
        "The models the key's tenant may use", "openai", "ApiKey", (200, "ModelList"),
        {401: "`invalid_api_key`.", 503: REDIS_DOWN},
    ),
    ("GET", "/v1/models/{model}"): Operation(
        "One model, if the key's tenant may use it", "openai", "ApiKey", (200, "ModelCard"),
        {401: "`invalid_api_key`.",
         404: "`model_not_found`: not a model this gateway serves, or not one the tenant may use.",
         503: REDIS_DOWN},
        parameters=(_path_param("model", "The model's id, as `GET /v1/models` lists it (a `/` in it may be "
                                "sent as `%2F`)."),),
    ),
    ("GET", "/v1/requests/{rid}"): Operation(
        "One of the caller's own requests: state, tokens, budget wait, schedule", "openai", "ApiKey",
        (200, "RequestRecord"),
        {401: "`invalid_api_key`.", 404: "`not_found`: unknown, expired, or another tenant's request.",
         503: REDIS_DOWN},
        parameters=(_path_param("rid", "The `x-request-id`, or the response's `chatcmpl-…`/`cmpl-…` id."),),
    ),
    ("POST", "/admin/tenants"): Operation(
        "Create a tenant", "admin", "AdminToken", (201, "TenantDoc"),
        {400: BAD_JSON + " Unknown fields are refused. " + _BURST_TOO_SMALL, 401: _ADMIN_401,
         409: "`conflict`: a tenant with this name exists.", 413: ADMIN_TOO_LARGE,
         408: SLOW_BODY, 415: NOT_JSON, 503: REDIS_DOWN},
        body="TenantCreate",
    ),
    ("GET", "/admin/tenants"): Operation(
        "List tenants", "admin", "AdminToken", (200, "TenantList"), {401: _ADMIN_401, 503: REDIS_DOWN},
    ),
    ("GET", "/admin/tenants/{tenant}"): Operation(
        "A tenant and its budget now", "admin", "AdminToken", (200, "TenantWithState"),
        {401: _ADMIN_401, 404: _NO_TENANT, 503: REDIS_DOWN}, parameters=(_TENANT,),
    ),
    ("PATCH", "/admin/tenants/{tenant}"): Operation(
        "Change a tenant (only the fields given; in `limits`, null removes a limit)", "admin", "AdminToken",
        (200, "TenantDoc"),
        {400: BAD_JSON + " Unknown fields and nulls (outside `limits`) are refused. " + _BURST_TOO_SMALL,
         401: _ADMIN_401,
         404: _NO_TENANT, 409: "`conflict`: the new name is taken, or the tenant kept changing under us.",
         413: ADMIN_TOO_LARGE, 408: SLOW_BODY, 415: NOT_JSON, 503: REDIS_DOWN},
        body="TenantUpdate", body_required=False, parameters=(_TENANT,),
    ),
    ("DELETE", "/admin/tenants/{tenant}"): Operation(
        "Delete a tenant; its keys stop working at once", "admin", "AdminToken", (200, "TenantDeleted"),
        {401: _ADMIN_401, 404: _NO_TENANT, 503: REDIS_DOWN}, parameters=(_TENANT,),
    ),
    ("GET", "/admin/tenants/{tenant}/usage"): Operation(
        "A tenant's usage per minute", "admin", "AdminToken", (200, "UsageList"),
        {400: "`since`/`until` are not unix seconds, `since` is after `until`, or the window is over 7 days.",
         401: _ADMIN_401, 404: _NO_TENANT, 503: REDIS_DOWN},
        parameters=(_TENANT, _query_seconds("since", "an hour before `until`"), _query_seconds("until", "now")),
    ),
    ("POST", "/admin/tenants/{tenant}/keys"): Operation(
        "Issue an API key (shown once)", "admin", "AdminToken", (201, "IssuedKey"),
        {400: BAD_JSON, 401: _ADMIN_401, 404: _NO_TENANT, 409: "`conflict`: no free key prefix (never in practice).",
         413: ADMIN_TOO_LARGE, 408: SLOW_BODY, 415: NOT_JSON, 503: REDIS_DOWN},
        body="KeyCreate", body_required=False, parameters=(_TENANT,),
    ),
    ("GET", "/admin/tenants/{tenant}/keys"): Operation(
        "A tenant's keys, by prefix, without secrets", "admin", "AdminToken", (200, "ApiKeyList"),
        {401: _ADMIN_401, 404: _NO_TENANT, 503: REDIS_DOWN}, parameters=(_TENANT,),
    ),
    ("DELETE", "/admin/keys/{prefix}"): Operation(
        "Revoke an API key", "admin", "AdminToken", (200, "KeyRevoked"),
        {401: _ADMIN_401, 404: "`not_found`: no key with this prefix.", 503: REDIS_DOWN},
        parameters=(_path_param("prefix", "The key's prefix: 8 hex digits (`tg-<prefix>-…`)."),),
    ),
    ("GET", "/admin/workers"): Operation(
        "Live worker heartbeats", "admin", "AdminToken", (200, "WorkerList"), {401: _ADMIN_401},
    ),
    ("GET", "/admin/scheduler"): Operation(
        "One model's scheduler as this gateway sees it: queues, cost curves, thresholds, tenants", "admin",
        "AdminToken", (200, "SchedulerSnapshot"), {401: _ADMIN_401, 404: _NO_MODEL}, parameters=(_MODEL_QUERY,),
    ),
    ("POST", "/admin/scheduler/tune"): Operation(
        "Ask one model's scheduler to re-solve its policy table on the traffic it served now; the verdict "
        "(swapped or kept, and why) appears in GET /admin/scheduler's `tuning`", "admin", "AdminToken",
        (202, "TuneAsked"),
        {401: _ADMIN_401, 404: _NO_MODEL, 409: "`conflict`: the scheduler runs a fixed policy (not `smdp`).",
         503: REDIS_DOWN},
        parameters=(_MODEL_QUERY,),
    ),
    ("GET", "/admin/traffic"): Operation(
        "The requests one model's schedulers saw, as a trace to tune on (CSV: arrival, prompt and generated "
        "tokens, finished, tenant; no content)", "admin", "AdminToken", (200, ""),
        {401: _ADMIN_401, 404: _NO_MODEL, 503: REDIS_DOWN}, parameters=(_MODEL_QUERY,), text_type="text/csv",
    ),
    ("GET", "/admin/usage"): Operation(
        "Every tenant's usage in the current minute and the last hour", "admin", "AdminToken",
        (200, "UsageOverview"), {401: _ADMIN_401, 503: REDIS_DOWN},
    ),
    ("GET", "/admin/cluster"): Operation(
        "One model's cluster now: gateways and their counters, workers, the scheduler's queues and policy",
        "admin", "AdminToken", (200, "Cluster"), {401: _ADMIN_401, 404: _NO_MODEL, 503: REDIS_DOWN},
        parameters=(_MODEL_QUERY,),
    ),
    ("GET", "/admin/requests/{rid}"): Operation(
        "Any tenant's request: its record and, while queued or running, the scheduler's explanation", "admin",
        "AdminToken", (200, "RequestRecord"),
        {401: _ADMIN_401, 404: "`not_found`: unknown or expired.", 503: REDIS_DOWN},
        parameters=(_path_param("rid", "The `x-request-id`, or the response's `chatcmpl-…`/`cmpl-…` id."),),
    ),
    ("GET", "/healthz"): Operation("The process is up", "ops", None, (200, "Health")),
    ("GET", "/readyz"): Operation(
        "Ready: Redis answers and a worker has a live heartbeat", "ops", None, (200, "Ready"),
        {503: "Not ready; the body says why (`NotReady`, not an OpenAI error)."},
    ),
    ("GET", "/health"): Operation(
        "vLLM's health check: 200 with an empty body when ready, as `/readyz` judges", "ops", None, (200, ""),
        {503: "Not ready; the body says why (`NotReady`, as `/readyz`'s; not an OpenAI error)."},
    ),
    ("GET", "/metrics"): Operation("Prometheus metrics", "ops", None, (200, "")),
    ("GET", OPENAPI_PATH): Operation("This document", "ops", None, (200, "")),
}

_STATUS_TEXT = {
    200: "OK", 201: "Created", 202: "Accepted", 400: "Bad request", 401: "Unauthorized", 404: "Not found",
    408: "Request timeout", 409: "Conflict",
    413: "Payload too large", 415: "Unsupported media type", 429: "Too many requests",
    500: "Server error", 503: "Unavailable",
}
# headers every error of this status carries (required) and may carry (optional)
_ERROR_HEADERS: dict[int, tuple[Sequence[str], Sequence[str]]] = {
    429: (("retry-after",), ("x-ratelimit-limit-tokens", "x-ratelimit-remaining-tokens", "x-ratelimit-reset-tokens",
                             *OPTIONAL_ADMITTED_HEADERS)),
    503: (("retry-after",), ("x-tokengate-estimate-ms", "x-tokengate-ttft-p99-ms", "x-tokengate-p99-ms")),
}


def route_table(routes: Sequence[BaseRoute], prefix: str = "") -> Iterator[tuple[str, str]]:
    """Every (method, OpenAPI path) the routes answer, mounts flattened; HEAD (which
    Starlette adds to every GET) left out."""
    for r in routes:
        if isinstance(r, Mount):
            yield from route_table(r.routes, prefix + r.path)
        elif isinstance(r, Route):
            path = re.sub(r"{(\w+)(:\w+)?}", r"{\1}", prefix + r.path)
            for method in sorted(r.methods or ()):
                if method != "HEAD":
                    yield method, path


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def _example(body: str, model: str) -> dict[str, Any]:
    examples: dict[str, dict[str, Any]] = {
        "ChatCompletionRequest": {"model": model, "messages": [{"role": "user", "content": "Say hello."}],
                                  "max_tokens": 16},
        "CompletionRequest": {"model": model, "prompt": "Once upon a time", "max_tokens": 16},
        "TenantCreate": {"name": "acme", "rate": 2000, "slo_ttft_ms": 800, "limits": {"max_concurrent": 16}},
        "TenantUpdate": {"rate": 4000, "slo_ttft_ms": None, "limits": {"max_concurrent": None}},
        "KeyCreate": {"name": "laptop"},
    }
    return examples[body]


def _event(chunk: str) -> dict[str, Any]:
    """One server-sent event of a stream (what OpenAPI 3.2 calls the ``itemSchema``; 3.1 has
    none, and tools that read SSE, schemathesis among them, take ``schema`` per event)."""
    return {
        "description": "One event. Its `data` is a chunk; an error after the stream began is a last "
        "`{\"error\": …}` event; a stream that ends well ends with `data: [DONE]`.",
        "type": "object",
        "required": ["data"],
        "properties": {
            "data": {
                "anyOf": [
                    {"const": "[DONE]"},
                    {
                        "type": "string",
                        "contentMediaType": "application/json",
                        "contentSchema": {"oneOf": [ref(chunk), ref("ErrorResponse")]},
                    },
                ]
            },
        },
    }


def _operation(method: str, path: str, op: Operation, settings: GatewaySettings) -> dict[str, Any]:
    status, schema = op.ok
    ok: dict[str, Any] = {"description": _STATUS_TEXT[status]}
    if schema == "":
        ok["content"] = {op.text_type: {"schema": {"type": "string"}}}
        if path == OPENAPI_PATH:
            ok["content"] = _json({"type": "object"})
    else:
        ok["content"] = _json(ref(schema))
    if op.streams:
        ok["description"] = "The completion (JSON), or with `stream: true` a server-sent event stream."
        ok["content"]["text/event-stream"] = {"schema": _event(op.streams)}
    required, optional = op.ok_headers
    if required or optional:
        ok["headers"] = _headers(required, optional)
    responses: dict[str, Any] = {str(status): ok}
    for code, when in sorted(op.errors.items()):
        if code == 413 and op.tag == "openai":
            when = f"`payload_too_large`: the body is over {settings.max_body_bytes} bytes (`--max-body-bytes`)."
        err: dict[str, Any] = {"description": f"{_STATUS_TEXT[code]}: {when}"}
        err["content"] = _json(ref("NotReady" if path in PROBES else "ErrorResponse"))
        if code in _ERROR_HEADERS and path not in PROBES:  # a probe's 503 has no Retry-After
            err["headers"] = _headers(*_ERROR_HEADERS[code])
        responses[str(code)] = err
    out: dict[str, Any] = {
        "operationId": f"{method.lower()}{re.sub(r'[^A-Za-z0-9]+', '_', path)}".rstrip("_"),
        "summary": op.summary,
        "tags": [op.tag],
        "security": [{op.security: []}] if op.security else [],
        "responses": responses,
    }
    if op.parameters:
        out["parameters"] = list(op.parameters)
    if op.body:
        body = _json(ref(op.body))
        body["application/json"]["example"] = _example(op.body, settings.model_name)
        out["requestBody"] = {"required": op.body_required, "content": body}
    return out


def document(routes: Sequence[BaseRoute], settings: GatewaySettings) -> dict[str, Any]:
    """The OpenAPI 3.1 document of exactly these routes; ValueError when a route has no entry
    in ``OPERATIONS`` or an entry has no route."""
    table = list(route_table(routes))
    undocumented = [f"{m} {p}" for m, p in table if (m, p) not in OPERATIONS]
    unrouted = [f"{m} {p}" for m, p in OPERATIONS if (m, p) not in table]
    if undocumented or unrouted:
        raise ValueError(f"OpenAPI operations and routes differ: undocumented {undocumented}, unrouted {unrouted}")
    paths: dict[str, dict[str, Any]] = {}
    for method, path in table:
        paths.setdefault(path, {})[method.lower()] = _operation(method, path, OPERATIONS[method, path], settings)
    components: dict[str, Any] = {
        "schemas": schemas(),
        "securitySchemes": {
            "ApiKey": {
                "type": "http",
                "scheme": "bearer",
                "description": "A tenant's API key, `tg-<prefix>-<secret>` (the openai client's `api_key`).",
            },
            "AdminToken": {
                "type": "http",
                "scheme": "bearer",
                "description": "The gateway's admin token (`--admin-token`, `TOKENGATE_ADMIN_TOKEN`).",
            },
        },
    }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "tokengate",
            "version": "1",
            "description": "A multi-tenant, token-budget LLM gateway speaking OpenAI's REST API. "
            f"Serves the model `{settings.model_name}`. Errors are OpenAI error objects. See docs/api.md.",
        },
        "paths": paths,
        "components": components,
    }


class _Served:
    def __init__(self) -> None:
        self.body = b""

    async def respond(self, request: Request) -> Response:
        return Response(self.body, media_type="application/json")


def documented(routes: list[BaseRoute], settings: GatewaySettings) -> list[BaseRoute]:
    """``routes`` plus ``GET /openapi.json``, whose document (describing all of them, itself
    too) is built here, once."""
    served = _Served()
    every = [*routes, Route(OPENAPI_PATH, served.respond, methods=["GET"])]
    served.body = orjson.dumps(document(every, settings))
    return every
