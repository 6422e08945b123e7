"""Where and how to reach Redis, exactly as a redis-py client would, for the connections the
gateway opens itself (``redis_batch.AutoPipeline``) instead of through redis-py's pool.

Everything comes from the client's connection pool, into which ``from_url`` parsed the URL:
a ``rediss://`` URL and its ``ssl_*`` query parameters, its user, password and db, or a
``unix://`` socket mean the same to both. An option this module does not know is refused,
never dropped: a TLS setting lost on the way would be a silent downgrade.
"""

from __future__ import annotations

import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from redis.credentials import CredentialProvider

# the keyword arguments of redis-py's SSLConnection (redis-py 8.1); the defaults it applies
# when one is absent are in ``ssl_context``
SSL_OPTIONS = frozenset({
    "ssl_keyfile", "ssl_certfile", "ssl_password", "ssl_cert_reqs", "ssl_check_hostname",
    "ssl_ca_certs", "ssl_ca_data", "ssl_ca_path", "ssl_include_verify_flags", "ssl_exclude_verify_flags",
    "ssl_min_version", "ssl_ciphers",
})
CERT_REQS = {"none": ssl.CERT_NONE, "optional": ssl.CERT_OPTIONAL, "required": ssl.CERT_REQUIRED}


def ssl_context(options: Mapping[str, Any]) -> ssl.SSLContext:
    """The context redis-py's ``SSLConnection`` builds from the same ``ssl_*`` options,
    step for step, its defaults included: the server's certificate is required and its host
    name checked; ``ssl_ca_*`` add to the system's trusted CAs."""
    unknown = {k for k in options if k.startswith("ssl_")} - SSL_OPTIONS
    if unknown:
        raise ValueError(f"Redis TLS option(s) not understood here: {', '.join(sorted(unknown))}")
    reqs = options.get("ssl_cert_reqs", "required")
    if reqs is None:
        verify = ssl.CERT_NONE
    elif isinstance(reqs, str):
        if reqs not in CERT_REQS:
            raise ValueError(f"ssl_cert_reqs must be one of {', '.join(CERT_REQS)}, not {reqs!r}")
        verify = CERT_REQS[reqs]
    else:
        verify = ssl.VerifyMode(reqs)
    context = ssl.create_default_context()
    context.check_hostname = bool(options.get("ssl_check_hostname", True)) and verify != ssl.CERT_NONE
    context.verify_mode = verify
    for flag in options.get("ssl_include_verify_flags") or ():
        context.verify_flags |= flag
    for flag in options.get("ssl_exclude_verify_flags") or ():
        context.verify_flags &= ~flag
    certfile, keyfile = options.get("ssl_certfile"), options.get("ssl_keyfile")
    if keyfile and not certfile:
        raise ValueError("ssl_keyfile needs ssl_certfile (the client certificate)")
    if certfile:
        context.load_cert_chain(certfile=certfile, keyfile=keyfile, password=options.get("ssl_password"))
    cafile, capath, cadata = (options.get(k) for k in ("ssl_ca_certs", "ssl_ca_path", "ssl_ca_data"))
    if cafile or capath or cadata:
        context.load_verify_locations(cafile=cafile, capath=capath, cadata=cadata)
    if options.get("ssl_min_version") is not None:
        context.minimum_version = ssl.TLSVersion(options["ssl_min_version"])
    if options.get("ssl_ciphers") is not None:
        context.set_ciphers(options["ssl_ciphers"])
    return context


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One Redis server and how to log in to it. ``path`` set: a unix socket (host and port
    unused); ``tls`` set: TLS over TCP with that context, the host name as server name."""

    host: str = "localhost"
    port: int = 6379
    path: str | None = None
    tls: ssl.SSLContext | None = None
    db: int = 0
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    credential_provider: CredentialProvider | None = None
    client_name: str | None = None

    async def handshake(self) -> list[tuple[Any, ...]]:
        """The commands a new connection sends before any other, in redis-py's order:
        AUTH (from the credential provider if there is one), CLIENT SETNAME, SELECT."""
        commands: list[tuple[Any, ...]] = []
        if self.credential_provider is not None:
            commands.append(("AUTH", *await self.credential_provider.get_credentials_async()))
        elif self.password is not None:
            commands.append(("AUTH", self.username, self.password) if self.username else ("AUTH", self.password))
        if self.client_name:
            commands.append(("CLIENT", "SETNAME", self.client_name))
        if self.db:
            commands.append(("SELECT", self.db))
        return commands


def endpoint_of(client: aioredis.Redis) -> Endpoint:
    """The server ``client`` connects to, and how: its pool's connection class says TCP, TLS or
    a unix socket, its connection kwargs say the rest. Raises ValueError for what cannot be
    honoured (Sentinel, an unknown connection class, TLS options on a plain connection)."""
    pool = client.connection_pool
    kw = pool.connection_kwargs
    cls = pool.connection_class
    direct = issubclass(cls, (aioredis.Connection, aioredis.UnixDomainSocketConnection))
    if not direct or issubclass(cls, aioredis.SentinelManagedConnection):
        raise ValueError(f"cannot open a Redis connection like {cls.__name__} (redis://, rediss:// or unix:// only)")
    tls = ssl_context(kw) if issubclass(cls, aioredis.SSLConnection) else None
    given_tls = sorted(k for k, v in kw.items() if k.startswith("ssl_") and v is not None)
    if tls is None and given_tls:  # redis-py's own Connection refuses them too (a TypeError); say why
        raise ValueError(f"Redis TLS option(s) {', '.join(given_tls)} need a rediss:// URL")
    unix = issubclass(cls, aioredis.UnixDomainSocketConnection)
    return Endpoint(
        host=kw.get("host", "localhost"), port=int(kw.get("port", 6379)), path=kw["path"] if unix else None, tls=tls,
        db=int(kw.get("db") or 0), username=kw.get("username"), password=kw.get("password"),
        credential_provider=kw.get("credential_provider"), client_name=kw.get("client_name"),
    )
