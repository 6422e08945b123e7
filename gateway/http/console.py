"""The operator console's page and its data's I/O (docs/operations.md, "The operator
console"). ``GET /console`` and its assets are served from the package
(``gateway/console/static``: no build step, nothing fetched from elsewhere). The page itself
holds no data and no secret, so it is served to anyone; everything it shows or changes goes
through the admin API, with the admin token the operator types into its sign-in form (kept
in the tab's session storage). Not in the OpenAPI document: it is a page, not part of the
API. ``publish_loop`` writes this gateway's part of the cluster view every second, with its
recent traffic (``status.Traffic``, kept per gateway here); ``read`` merges the live parts
(``gateway.console.status``)."""

from __future__ import annotations

import asyncio
import logging
import os
import time
import weakref
from importlib.resources import files
from typing import Any

import orjson
from redis.exceptions import RedisError
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import PathLike, StaticFiles
from starlette.types import Scope

from common import wire
from gateway.console import status
from gateway.dispatch import tuning
from gateway.http.services import Gateway

log = logging.getLogger("tokengate.console")

PATH = "/console"
# the page runs only its own script and style, talks only to this origin, and is never framed
HEADERS = {
    "content-security-policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-cache",
}
_PAGE = files("gateway.console").joinpath("static", "index.html").read_bytes()


async def page(request: Request) -> Response:
    return Response(_PAGE, media_type="text/html; charset=utf-8", headers=HEADERS)


class _Assets(StaticFiles):
    """The page's script and style, revalidated on each load (ETag), with the page's headers."""

    def file_response(self, full_path: PathLike, stat_result: os.stat_result, scope: Scope,
                      status_code: int = 200) -> Response:
        response = super().file_response(full_path, stat_result, scope, status_code)
        response.headers.update(HEADERS)
        return response


async def no_icon(request: Request) -> Response:
    """Browsers ask for ``/favicon.ico`` whatever the page says: nothing, rather than a 404."""
    return Response(status_code=204, headers={"cache-control": "max-age=86400"})


def routes() -> list[BaseRoute]:
    return [
        Route(PATH, page, methods=["GET"]),
        Route("/favicon.ico", no_icon, methods=["GET"]),
        Mount(f"{PATH}/static", app=_Assets(packages=[("gateway.console", "static")]), name="console"),
    ]


# each gateway's recent traffic per model, kept beside it (a process may hold several: the tests' harnesses)
_TRAFFIC: weakref.WeakKeyDictionary[Gateway, dict[str, status.Traffic]] = weakref.WeakKeyDictionary()


async def publish(gw: Gateway) -> None:
    """One part per model this gateway serves, under that domain's gateway id."""
    traffic = _TRAFFIC.setdefault(gw, {})
    now = time.time()
    for dom in list(gw.domains.values()):
        doc = status.part(dom.dispatcher.snapshot(), gw.metrics, gw.started, now,
                          traffic.setdefault(dom.name, status.Traffic()))
        await gw.batch.call("SET", wire.console_key(dom.settings.gateway_id), orjson.dumps(doc),
                            "PX", int(status.STALE_S * 1000))


async def publish_loop(gw: Gateway) -> None:
    """Rewrite this gateway's part every ``status.PUBLISH_S`` until cancelled; a Redis outage
    only leaves it out of the view until Redis answers again (the dispatcher logs outages)."""
    while True:
        try:
            await publish(gw)
        except RedisError as exc:
            log.debug("console part not published: %s", exc)
        await asyncio.sleep(status.PUBLISH_S)


async def read(gw: Gateway, model: str | None = None) -> dict[str, Any]:
    """The cluster view of ``model`` (default: this gateway's first) now: the live gateways'
    parts, the workers with their heartbeat ages, the scheduling lease's holder (two round
    trips: the ids, ages and holder, then the parts; the heartbeats themselves are the
    dispatcher's, re-read every 0.5 s). KeyError for a model this gateway does not serve."""
    dom = gw.domain(model)
    pipe = gw.client.pipeline(transaction=False)
    pipe.zrange(wire.GATEWAYS_ZSET, 0, -1)
    pipe.zrange(wire.WORKERS_ZSET, 0, -1, withscores=True)
    pipe.get(wire.scheduler_lease(dom.name))
    ids, beats, holder = await pipe.execute()
    raws = await gw.client.mget([wire.console_key(wire.text(i)) for i in ids]) if ids else []
    parts = [orjson.loads(raw) for raw in raws if raw is not None]
    now = time.time()
    beat = {wire.text(w): float(score) for w, score in beats}
    workers = [status.worker_view(hb, beat.get(wid), now) for wid, hb in dom.dispatcher.workers.items()]
    view = status.cluster(dom.settings.gateway_id, parts, workers, now, wire.text(holder) if holder else "",
                          dom.name)
    view["models"] = list(gw.domains)
    view["tuning"] = {"enabled": dom.dispatcher.tuning.enabled, "every_s": dom.dispatcher.tuning.every_s,
                      **await tuning.read(gw.client, dom.name)}
    return view
