"""``redis_endpoint``: a Redis URL means to the gateway's own connections what it means to
redis-py (the same TLS context, login, db, socket), and what cannot be honoured is refused."""

from __future__ import annotations

import inspect
import ssl

import pytest
import redis.asyncio as aioredis
from redis.credentials import UsernamePasswordCredentialProvider

from gateway.redis_endpoint import SSL_OPTIONS, Endpoint, endpoint_of

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _redis_py_context(client: aioredis.Redis) -> ssl.SSLContext:
    """The context redis-py itself would hand to its SSLConnection (built, never connected)."""
    context = client.connection_pool.make_connection().ssl_context.get()
    assert isinstance(context, ssl.SSLContext)
    return context


@pytest.mark.parametrize("query", [
    "",
    "?ssl_cert_reqs=none",
    "?ssl_cert_reqs=optional",
    "?ssl_cert_reqs=required&ssl_check_hostname=false",
    "?ssl_check_hostname=true",
    f"?ssl_min_version={int(ssl.TLSVersion.TLSv1_3)}",
    "?ssl_ciphers=ECDHE%2BAESGCM",
    "?ssl_include_verify_flags=VERIFY_X509_STRICT&ssl_exclude_verify_flags=VERIFY_X509_TRUSTED_FIRST",
])
def test_the_tls_context_is_the_one_redis_py_builds(query: str) -> None:
    client = aioredis.Redis.from_url(f"rediss://cache.example:6380/0{query}")
    ours = endpoint_of(client).tls
    theirs = _redis_py_context(client)
    assert ours is not None
    assert (ours.verify_mode, ours.check_hostname, ours.verify_flags) == (
        theirs.verify_mode, theirs.check_hostname, theirs.verify_flags)
    assert (ours.minimum_version, ours.maximum_version, ours.options) == (
        theirs.minimum_version, theirs.maximum_version, theirs.options)
    assert [c["name"] for c in ours.get_ciphers()] == [c["name"] for c in theirs.get_ciphers()]


def test_tls_is_verified_by_default_as_in_redis_py() -> None:
    tls = endpoint_of(aioredis.Redis.from_url("rediss://cache.example:6380/0")).tls
    assert tls is not None and tls.verify_mode == ssl.CERT_REQUIRED and tls.check_hostname


def test_every_tls_option_of_redis_py_is_known_here() -> None:
    """A new ``ssl_*`` keyword of redis-py's SSLConnection must be mirrored in
    ``gateway/redis_endpoint.py: ssl_context`` (until then it is refused, not dropped)."""
    params = inspect.signature(aioredis.SSLConnection.__init__).parameters
    theirs = {name for name in params if name.startswith("ssl_")}
    assert theirs == SSL_OPTIONS, f"re-check gateway/redis_endpoint.py against redis-py: {theirs ^ SSL_OPTIONS}"


@pytest.mark.parametrize(("url", "endpoint"), [
    ("redis://cache.example:6380/4", Endpoint(host="cache.example", port=6380, db=4)),
    ("redis://", Endpoint()),
    ("redis://app:s%40cret@cache.example/1?client_name=gw",
     Endpoint(host="cache.example", db=1, username="app", password="s@cret", client_name="gw")),
    ("unix:///run/redis.sock?db=2&password=pw", Endpoint(path="/run/redis.sock", db=2, password="pw")),
])
def test_address_login_and_db_come_from_the_url(url: str, endpoint: Endpoint) -> None:
    assert endpoint_of(aioredis.Redis.from_url(url)) == endpoint


async def test_the_handshake_logs_in_names_and_selects_in_redis_py_order() -> None:
    full = endpoint_of(aioredis.Redis.from_url("rediss://app:pw@h/3?client_name=gw&ssl_cert_reqs=none"))
    assert await full.handshake() == [("AUTH", "app", "pw"), ("CLIENT", "SETNAME", "gw"), ("SELECT", 3)]
    assert await Endpoint(password="pw").handshake() == [("AUTH", "pw")]
    assert await Endpoint().handshake() == []
    provided = Endpoint(credential_provider=UsernamePasswordCredentialProvider("u", "p"), password="ignored")
    assert await provided.handshake() == [("AUTH", "u", "p")]


@pytest.mark.parametrize(("url", "why"), [
    ("redis://h:6379/0?ssl_ca_certs=ca.pem", "need a rediss:// URL"),
    ("rediss://h:6379/0?ssl_verify=yes", "not understood here: ssl_verify"),
    ("rediss://h:6379/0?ssl_cert_reqs=sometimes", "ssl_cert_reqs must be one of"),
    ("rediss://h:6379/0?ssl_keyfile=client.key", "ssl_keyfile needs ssl_certfile"),
])
def test_what_cannot_be_honoured_is_refused(url: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        endpoint_of(aioredis.Redis.from_url(url))


def test_a_connection_class_it_does_not_know_is_refused() -> None:
    class Custom(aioredis.connection.AbstractConnection):
        pass

    pool = aioredis.ConnectionPool(connection_class=Custom)
    with pytest.raises(ValueError, match="cannot open a Redis connection like Custom"):
        endpoint_of(aioredis.Redis(connection_pool=pool))
