"""`tokengate serve --engine echo` with a tenant whose budget never binds: the live gateway
that the API fuzzers (schemathesis, ``bench.fuzz``) throw requests at."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from tests.e2e.conftest import ADMIN_TOKEN, Served, serving


@contextmanager
def echo_gateway(tmp: Path, max_body_bytes: int = 65536) -> Iterator[tuple[Served, str]]:
    """The gateway (``Served.key``: an API key of tenant ``fuzz``) and that tenant's id;
    stopped at the end."""
    with serving(["serve", "--engine", "echo", "--echo-tokens", "4", "--admin-token", ADMIN_TOKEN,
                  "--max-body-bytes", str(max_body_bytes), "--request-timeout", "20"], tmp) as served:
        admin = served.auth(ADMIN_TOKEN)
        body = {"name": "fuzz", "rate": 1e8, "burst": 10**10, "max_queue_delay_s": 0}
        created = httpx.post(served.base_url + "/admin/tenants", json=body, headers=admin)
        created.raise_for_status()
        issued = httpx.post(served.base_url + "/admin/tenants/fuzz/keys", headers=admin)
        issued.raise_for_status()
        served.key = issued.json()["key"]
        yield served, created.json()["id"]
