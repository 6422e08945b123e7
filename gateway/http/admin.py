"""The admin API under ``/admin`` (docs/tenants.md): tenants, API keys, usage, workers and
the scheduler. ``auth.AdminGuard`` has checked the admin token before any of these runs."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.dispatch import records, traffic_log, tuning
from gateway.errors import Conflict, ModelNotFound
from gateway.http import console
from gateway.http.web import ORJSONResponse, read_json
from gateway.tenancy import admin_protocol as ap
from gateway.tenancy import usage
from gateway.tenancy.tenant_store import tenant_ids
from gateway.tenancy.tenants import to_doc

if TYPE_CHECKING:
    from gateway.http.services import Domain, Gateway

_ADMIN_BODY_LIMIT = 64 * 1024


def _gw(request: Request) -> Gateway:
    gw: Gateway = request.app.state.gateway
    return gw


async def _body(request: Request) -> Any:
    """The JSON body; an empty body reads as ``{}``."""
    if request.headers.get("content-length") in (
        None,
        "0",
    ) and "chunked" not in request.headers.get("transfer-encoding", ""):
        return {}
    return await read_json(request, _ADMIN_BODY_LIMIT)


def _list(data: list[dict[str, Any]], **extra: Any) -> Response:
    return ORJSONResponse({"object": "list", "data": data, **extra})


# -- tenants -------------------------------------------------------------------------------


async def create_tenant(request: Request) -> Response:
    gw = _gw(request)  # the burst must hold one request of up to the model's context (docs/tenants.md)
    tenant = ap.parse_create(await _body(request), context=gw.served())
    await gw.tenants.create(tenant)
    return ORJSONResponse(to_doc(tenant), status_code=201)


async def list_tenants(request: Request) -> Response:
    return _list([to_doc(t) for t in await _gw(request).tenants.list_tenants()])


async def get_tenant(request: Request) -> Response:
    gw = _gw(request)
    tenant = await gw.tenants.get(request.path_params["tenant"])
    state = await gw.domain().budget.state(tenant)  # the tenant's bucket: one for every model
    return ORJSONResponse({**to_doc(tenant), "state": state})


async def update_tenant(request: Request) -> Response:
    change = ap.parse_update(await _body(request))
    gw = _gw(request)
    tenant = await gw.tenants.update(
        request.path_params["tenant"], lambda t: ap.apply_update(t, change, gw.served())
    )
    gw.auth.cache.forget(tenant_id=tenant.id)
    return ORJSONResponse(to_doc(tenant))


async def delete_tenant(request: Request) -> Response:
    gw = _gw(request)
    tenant = await gw.tenants.delete(request.path_params["tenant"])
    gw.auth.cache.forget(tenant_id=tenant.id)
    return ORJSONResponse(
        {"id": tenant.id, "object": "tenant", "name": tenant.name, "deleted": True}
    )


async def tenant_usage(request: Request) -> Response:
    gw = _gw(request)
    tenant = await gw.tenants.get(request.path_params["tenant"])
    q = request.query_params
    first, last = usage.window(q.get("since"), q.get("until"), time.time())
    await gw.usage.flush()  # this gateway's own counts, at once (others' within a second)
    rows = await usage.series(gw.client, tenant.id, first, last)
    return _list(
        rows, tenant=tenant.id, since=first * 60, until=last * 60 + 59, totals=usage.totals(rows)
    )


async def usage_overview(request: Request) -> Response:
    """Every tenant's usage in the current minute and in the last hour (its 60 minutes, the
    current one included): one round trip of ``60 × tenants`` hash reads."""
    gw = _gw(request)
    tenants = await gw.tenants.list_tenants()
    last = int(time.time() // 60)
    await gw.usage.flush()
    hours = await usage.series_of(gw.client, [t.id for t in tenants], last - 59, last)
    data = [{"tenant": t.id, "name": t.name, "minute": usage.totals([r for r in hour if r["minute"] == last * 60]),
             "hour": usage.totals(hour)} for t, hour in zip(tenants, hours, strict=True)]
    return _list(data, since=(last - 59) * 60, until=last * 60 + 59)


# -- keys ----------------------------------------------------------------------------------


async def issue_key(request: Request) -> Response:
    name = ap.parse_key_create(await _body(request))
    key, info = await _gw(request).tenants.issue_key(request.path_params["tenant"], name)
    return ORJSONResponse({**info.doc(), "key": key}, status_code=201)


async def list_keys(request: Request) -> Response:
    found = await _gw(request).tenants.list_keys(request.path_params["tenant"])
    return _list([k.doc() for k in found])


async def revoke_key(request: Request) -> Response:
    prefix = request.path_params["prefix"]
    gw = _gw(request)
    await gw.tenants.revoke_key(prefix)
    gw.auth.cache.forget(prefix=prefix)
    return ORJSONResponse({"prefix": prefix, "object": "api_key", "deleted": True})


# -- the machinery -------------------------------------------------------------------------


def _domain(request: Request) -> Domain:
    """The domain of ``?model=`` (default: the gateway's first model); 404 for one it does not serve."""
    gw = _gw(request)
    model = request.query_params.get("model")
    if model is not None and model not in gw.domains:
        raise ModelNotFound(f"This gateway serves no model '{model}' (it serves: {', '.join(gw.domains)}).",
                            param="model")
    return gw.domain(model)


async def workers(request: Request) -> Response:
    """Every live worker of every model this gateway serves (each names its ``model``)."""
    doms = _gw(request).domains.values()
    return _list([dataclasses.asdict(hb) for dom in doms for hb in dom.dispatcher.workers.values()])


async def scheduler(request: Request) -> Response:
    """One model's scheduler (``?model=``; default: the gateway's first model), with its
    self-tuning as kept in Redis (any gateway shows the scheduling one's)."""
    d = _domain(request).dispatcher
    snap = d.snapshot()
    snap["tuning"] = {"enabled": d.tuning.enabled, "every_s": d.tuning.every_s,
                      **await tuning.read(_gw(request).client, d.settings.model_name)}
    return ORJSONResponse(snap)


async def tune(request: Request) -> Response:
    """Ask one model's scheduler (``?model=``) to re-solve its table now (the scheduling
    gateway takes the ask up within seconds; ``GET /admin/scheduler`` shows the verdict)."""
    d = _domain(request).dispatcher
    if not d.tuning.enabled:
        raise Conflict(f"The scheduler runs a fixed policy (--policy {d.settings.policy}): nothing is re-solved; "
                       "the self-tuned table is --policy smdp.")
    await tuning.ask(_gw(request).client, d.settings.model_name)
    return ORJSONResponse({"model": d.settings.model_name, "asked": True}, status_code=202)


async def traffic(request: Request) -> Response:
    """The requests one model's schedulers saw (``?model=``), as a trace to tune on: CSV, no
    content (``gateway/dispatch/traffic_log.py``)."""
    dom = _domain(request)
    text = await traffic_log.read_csv(_gw(request).client, dom.name)
    return Response(text, media_type="text/csv", headers={"content-disposition": "inline; filename=traffic.csv"})


async def cluster(request: Request) -> Response:
    """The operator console's live view of one model (``?model=``): every gateway, worker and
    the scheduler's queues; ``models`` lists the models this gateway serves."""
    return ORJSONResponse(await console.read(_gw(request), _domain(request).name))


async def explain_request(request: Request) -> Response:
    """Any tenant's request: its record (contract, timings) and, while the scheduler holds
    it, the scheduler's ``explain`` (asked of the scheduling gateway where this one follows)."""
    gw = _gw(request)
    doc = await records.read(gw.client, request.path_params["rid"], await tenant_ids(gw.client))
    for dom in gw.domains.values():
        schedule = await dom.dispatcher.explain_anywhere(doc["id"])
        if schedule is not None:
            doc["schedule"] = schedule
            break
    return ORJSONResponse(doc)


Endpoint = Callable[[Request], Awaitable[Response]]


def _by_method(handlers: dict[str, Endpoint]) -> Endpoint:
    """One endpoint for all of a path's methods, so that a 405 lists them all in ``Allow``
    (Starlette routes HEAD wherever GET is allowed)."""

    async def endpoint(request: Request) -> Response:
        return await handlers["GET" if request.method == "HEAD" else request.method](request)

    return endpoint


def routes() -> list[Route]:
    """Mounted at ``/admin``; one route per path (its 405 names every method it takes)."""
    table: dict[str, dict[str, Endpoint]] = {
        "/tenants": {"POST": create_tenant, "GET": list_tenants},
        "/tenants/{tenant}": {"GET": get_tenant, "PATCH": update_tenant, "DELETE": delete_tenant},
        "/tenants/{tenant}/usage": {"GET": tenant_usage},
        "/usage": {"GET": usage_overview},
        "/tenants/{tenant}/keys": {"POST": issue_key, "GET": list_keys},
        "/keys/{prefix}": {"DELETE": revoke_key},
        "/workers": {"GET": workers},
        "/scheduler": {"GET": scheduler},
        "/scheduler/tune": {"POST": tune},
        "/traffic": {"GET": traffic},
        "/cluster": {"GET": cluster},
        "/requests/{rid}": {"GET": explain_request},
    }
    out = []
    for path, handlers in table.items():
        endpoint = next(iter(handlers.values())) if len(handlers) == 1 else _by_method(handlers)
        out.append(Route(path, endpoint, methods=list(handlers)))
    return out
