"""The operator console's page (docs/operations.md, "The operator console"): ``GET /console``
and its assets, served from the package (``gateway/console/static``: no build step, nothing
fetched from elsewhere). The page itself holds no data and no secret, so it is served to
anyone; everything it shows or changes goes through the admin API, with the admin token the
operator types into its sign-in form (kept in the tab's session storage). Not in the OpenAPI
document: it is a page, not part of the API."""

from __future__ import annotations

import os
from importlib.resources import files

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import PathLike, StaticFiles
from starlette.types import Scope

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
