"""Who is calling: an API key on the OpenAI routes, the admin token on ``/admin``.

Both arrive as ``Authorization: Bearer <secret>`` (what the openai client sends). Failures
say what was wrong without echoing the secret; logs name a key by its prefix only.
"""

from __future__ import annotations

import hmac
import logging
import time
from dataclasses import dataclass, field

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.errors import Unauthorized, error_response
from gateway.tenancy import keys
from gateway.tenancy.tenant_store import TenantStore
from gateway.tenancy.tenants import Tenant

log = logging.getLogger("tokengate.auth")


def bearer(headers: Headers) -> str | None:
    value = headers.get("authorization", "")
    scheme, _, secret = value.partition(" ")
    if scheme.lower() != "bearer" or not secret.strip():
        return None
    return secret.strip()


@dataclass(frozen=True, slots=True)
class Caller:
    """An authenticated request: its tenant and its key (admission checks in Redis, in the
    same call, that the key is still live)."""

    tenant: Tenant
    key: keys.KeyRef


@dataclass(slots=True)
class KeyCache:
    """Keys verified in the last ``ttl_s`` seconds: prefix -> (digest, tenant, expiry).
    Pure; ``now`` is an argument. A hit still needs the presented key's digest to match."""

    ttl_s: float
    max_entries: int = 10_000
    entries: dict[str, tuple[str, Tenant, float]] = field(default_factory=dict)

    def get(self, ref: keys.KeyRef, now: float) -> Tenant | None:
        found = self.entries.get(ref.prefix)
        if found is None or found[2] <= now or not hmac.compare_digest(found[0], ref.digest):
            return None
        return found[1]

    def put(self, ref: keys.KeyRef, tenant: Tenant, now: float) -> None:
        if self.ttl_s <= 0.0:
            return
        if len(self.entries) >= self.max_entries:
            self.entries = {p: e for p, e in self.entries.items() if e[2] > now}
            if len(self.entries) >= self.max_entries:
                self.entries.clear()
        self.entries[ref.prefix] = (ref.digest, tenant, now + self.ttl_s)

    def forget(self, prefix: str | None = None, tenant_id: str | None = None) -> None:
        self.entries = {
            p: e for p, e in self.entries.items() if p != prefix and e[1].id != tenant_id
        }


def _refused(key: str) -> Unauthorized:
    prefix = keys.prefix_of(key)
    log.info("refused API key %s", f"with prefix {prefix}" if prefix else "(malformed)")
    shown = f"tg-{prefix}-…" if prefix else "(malformed)"
    return Unauthorized(f"Incorrect API key provided: {shown}. It is unknown or revoked.")


class Authenticator:
    """API key -> tenant. Verified keys are cached for ``ttl_s`` (one round trip saved per
    request); the generation path's admission script re-checks the key in Redis, so a
    revoked key is refused at once, while a tenant's new budget or limits reach a replica
    that cached it within ``ttl_s``. The replica that changes a tenant forgets it at once."""

    def __init__(self, store: TenantStore, ttl_s: float) -> None:
        self.store = store
        self.cache = KeyCache(ttl_s)

    async def caller(self, headers: Headers, *, fresh: bool = False) -> Caller:
        """The caller, or 401; ``fresh`` skips the cache (routes that do not admit)."""
        key = bearer(headers)
        if key is None:
            raise Unauthorized(
                "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'."
            )
        prefix = keys.prefix_of(key)
        if prefix is None:
            raise _refused(key)
        ref = keys.KeyRef(prefix, keys.digest(key))
        now = time.monotonic()
        tenant = None if fresh else self.cache.get(ref, now)
        if tenant is None:
            found = await self.store.lookup(prefix)
            if found is None or not hmac.compare_digest(found[0], ref.digest):
                self.cache.forget(prefix=prefix)
                raise _refused(key)
            tenant = found[1]
            self.cache.put(ref, tenant, now)
        return Caller(tenant, ref)

    def cached(self, headers: Headers) -> Tenant | None:
        """The tenant the presented key's prefix was verified for recently, without checking
        the secret (no hashing, no Redis): only for refusing cheaply, never for serving."""
        key = bearer(headers)
        prefix = keys.prefix_of(key) if key else None
        found = self.cache.entries.get(prefix) if prefix else None
        return found[1] if found is not None else None

    async def tenant(self, headers: Headers) -> Tenant:
        """The caller's tenant, checked against Redis now (no cache)."""
        return (await self.caller(headers, fresh=True)).tenant


def admin_error(headers: Headers, token: str | None) -> Unauthorized | None:
    """Why a request may not use the admin API, or None when it may (constant-time compare)."""
    if token is None:
        return Unauthorized(
            "The admin API is disabled: start the gateway with --admin-token "
            "(or TOKENGATE_ADMIN_TOKEN).",
            code="admin_disabled",
        )
    given = bearer(headers)
    if given is None:
        return Unauthorized(
            "The admin API needs 'Authorization: Bearer <admin token>'.", code="invalid_admin_token"
        )
    if not hmac.compare_digest(given.encode(), token.encode()):
        return Unauthorized(
            "That is not the admin token: use the one given with --admin-token (TOKENGATE_ADMIN_TOKEN), "
            "or the one `tokengate serve` printed at start and keeps in its data directory.",
            code="invalid_admin_token",
        )
    return None


class AdminGuard:
    """Everything under ``/admin`` (``/admin`` itself included) answers 401 without the admin
    token, before any routing: no redirect, and an unknown admin path does not reveal
    itself either. Wraps the whole app; other paths pass untouched."""

    def __init__(self, app: ASGIApp, token: str | None) -> None:
        self.app = app
        self.token = token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and (path == "/admin" or path.startswith("/admin/")):
            err = admin_error(Headers(scope=scope), self.token)
            if err is not None:
                await error_response(err)(scope, receive, send)
                return
        await self.app(scope, receive, send)
