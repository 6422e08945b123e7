"""Every Redis connection honours the whole URL: on a redis-server that speaks only TLS (its
plain port closed), wants a client certificate and a password, ``AutoPipeline`` (commands, a
script, an error reply), a whole gateway and its worker all work over ``rediss://`` with the
URL's ``ssl_*`` parameters; a wrong CA or a missing client certificate fails with a
RedisError, never a plaintext attempt. And a ``unix://`` URL with its db and password."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest
import redis
import redis.asyncio as aioredis
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisError, ResponseError
from redis.retry import Retry

from gateway.cli.embedded_redis import EmbeddedRedis
from gateway.dispatch.prompts import PromptBuilder
from gateway.redis_batch import AutoPipeline
from tests.integration.gateway.conftest import make_harness
from workers.model_store import ModelSpec
from workers.settings import WorkerSettings, connect

pytestmark = [pytest.mark.redis, pytest.mark.anyio]

PASSWORD = "tls-test-password"
PATIENCE_S = 10.0
SCRIPT = "redis.call('SET', KEYS[1], ARGV[1]) return redis.call('STRLEN', KEYS[1])"


@pytest.fixture(params=["asyncio", "uvloop"])
def anyio_backend(request: pytest.FixtureRequest) -> tuple[str, dict[str, bool]]:
    """The plain asyncio loop and uvloop (what `tokengate gateway` runs on): each has its own TLS."""
    return "asyncio", {"use_uvloop": request.param == "uvloop"}


@dataclass(frozen=True)
class Certs:
    ca: Path
    other_ca: Path  # signed nothing here: trusting it alone must fail
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def make_certs(where: Path) -> Certs:
    """A throwaway CA, a server certificate for 127.0.0.1 and a client certificate (openssl)."""
    if shutil.which("openssl") is None:
        pytest.fail("the openssl command is needed to make the test's certificates")

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=where, check=True, capture_output=True)

    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    for ca in ("ca", "other-ca"):
        openssl("req", "-x509", "-new", *key, "-keyout", f"{ca}.key", "-out", f"{ca}.crt", "-days", "2",
                "-subj", f"/CN=tokengate test {ca}",
                "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    for leaf, usage in (("server", "serverAuth"), ("client", "clientAuth")):
        (where / f"{leaf}.ext").write_text(
            "subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\n"
            f"keyUsage=critical,digitalSignature\nextendedKeyUsage={usage}\n"
            "authorityKeyIdentifier=keyid,issuer\nsubjectKeyIdentifier=hash\n"
        )
        openssl("req", "-new", *key, "-keyout", f"{leaf}.key", "-out", f"{leaf}.csr", "-subj", f"/CN={leaf}")
        openssl("x509", "-req", "-in", f"{leaf}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                "-out", f"{leaf}.crt", "-days", "2", "-extfile", f"{leaf}.ext")
    return Certs(where / "ca.crt", where / "other-ca.crt", where / "server.crt", where / "server.key",
                 where / "client.crt", where / "client.key")


class TlsRedis(EmbeddedRedis):
    """The tests' redis-server (``EmbeddedRedis``) on TLS only: no plain TCP port, client
    certificates required, a password; and a unix socket (plain, as unix sockets are)."""

    def __init__(self, certs: Certs) -> None:
        super().__init__()
        self.certs = certs
        self.socket = Path()

    def _argv(self, where: Path) -> list[str]:
        argv = super()._argv(where)
        argv[argv.index("--port") + 1] = "0"  # TCP without TLS: nobody listens
        self.socket = where / "redis.sock"
        c = self.certs
        return [
            *argv,
            "--tls-port", str(self.port),
            "--tls-cert-file", str(c.server_cert), "--tls-key-file", str(c.server_key),
            "--tls-ca-cert-file", str(c.ca), "--tls-auth-clients", "yes",
            "--requirepass", PASSWORD,
            "--unixsocket", str(self.socket), "--unixsocketperm", "700",
        ]

    def tls_url(self, db: int = 0, ca: Path | None = None, client_cert: bool = True, **query: str) -> str:
        params = {"ssl_ca_certs": str(ca or self.certs.ca), **query}
        if client_cert:
            params |= {"ssl_certfile": str(self.certs.client_cert), "ssl_keyfile": str(self.certs.client_key)}
        return f"rediss://default:{PASSWORD}@127.0.0.1:{self.port}/{db}?{urlencode(params)}"

    def answers(self) -> bool:
        try:
            with redis.Redis.from_url(self.tls_url(), socket_timeout=0.5, socket_connect_timeout=0.5,
                                      retry=Retry(NoBackoff(), 0)) as client:
                return bool(client.ping())
        except RedisError:
            return False


@pytest.fixture(scope="module")
def tls_server(redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsRedis]:
    plain = redis.Redis.from_url(redis_server.url)  # the same binary, so the same build
    try:
        has_tls = bool(plain.config_get("tls-port"))
    finally:
        plain.close()
    if not has_tls:
        pytest.skip(f"{redis_server.binary} was built without TLS (it has no tls-port setting)")
    with TlsRedis(make_certs(tmp_path_factory.mktemp("redis-tls"))) as server:
        yield server


@pytest.fixture
def tls(tls_server: TlsRedis) -> Iterator[TlsRedis]:
    with redis.Redis.from_url(tls_server.tls_url()) as client:
        client.flushall()
    yield tls_server


async def _settled(futures: list[asyncio.Future[Any]]) -> list[Any]:
    async with asyncio.timeout(PATIENCE_S):
        return await asyncio.gather(*futures, return_exceptions=True)


@pytest.fixture
async def tls_client(tls: TlsRedis) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(tls.tls_url(db=2, client_name="tokengate-tls-test"))
    yield client
    await client.aclose()


async def test_auto_pipeline_speaks_tls_with_the_urls_certificates_login_and_db(
    tls: TlsRedis, tls_client: aioredis.Redis
) -> None:
    batch = AutoPipeline(tls_client)
    assert batch.endpoint.tls is not None
    sha = await batch.call("SCRIPT", "LOAD", SCRIPT)
    futures = [
        batch.call("SET", "greeting", "hello"),
        batch.call("GET", "greeting"),
        batch.call("EVALSHA", sha, 1, "scripted", "four"),
        batch.call("EVALSHA", "0" * 40, 0),  # NOSCRIPT
        batch.call("INCR", "greeting"),  # ERR value is not an integer
        batch.call("CLIENT", "GETNAME"),
    ]
    ok, greeting, length, no_script, not_integer, name = await _settled(futures)
    await batch.close()

    assert (ok, greeting, length, name) == (b"OK", b"hello", 4, b"tokengate-tls-test")
    assert isinstance(no_script, NoScriptError)
    assert isinstance(not_integer, ResponseError) and "not an integer" in str(not_integer)
    with redis.Redis.from_url(tls.tls_url(db=2)) as db2, redis.Redis.from_url(tls.tls_url(db=0)) as db0:
        assert (db2.get("scripted"), db0.get("greeting")) == (b"four", None)  # the URL's db, not 0


@pytest.mark.parametrize("mistake", ["a CA that did not sign the server's certificate", "no client certificate"])
async def test_a_failed_tls_handshake_is_a_redis_error(tls: TlsRedis, mistake: str) -> None:
    wrong_ca = mistake.startswith("a CA")
    url = tls.tls_url(ca=tls.certs.other_ca) if wrong_ca else tls.tls_url(client_cert=False)
    client = aioredis.Redis.from_url(url)
    batch = AutoPipeline(client, timeout_s=5.0)
    try:
        replies = await _settled([batch.call("PING"), batch.call("SET", "x", "1")])
    finally:
        await batch.close()
        await client.aclose()
    for reply in replies:
        assert isinstance(reply, RedisConnectionError), reply
    if wrong_ca:  # refused by this side's certificate check, before a byte of AUTH went out
        assert "CERTIFICATE_VERIFY_FAILED" in str(replies[0]), replies[0]
    with redis.Redis.from_url(tls.tls_url()) as good:
        assert good.get("x") is None


async def test_a_unix_socket_urls_db_and_password(tls: TlsRedis) -> None:
    client = aioredis.Redis.from_url(f"unix://{tls.socket}?db=3&password={PASSWORD}")
    batch = AutoPipeline(client)
    try:
        assert batch.endpoint.path == str(tls.socket) and batch.endpoint.tls is None
        assert await _settled([batch.call("SET", "k", "v"), batch.call("GET", "k")]) == [b"OK", b"v"]
    finally:
        await batch.close()
        await client.aclose()
    with redis.Redis.from_url(tls.tls_url(db=3)) as db3:
        assert db3.get("k") == b"v"


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_gateway_and_its_worker_over_tls(
    tls: TlsRedis, prompts: PromptBuilder, model_spec: ModelSpec
) -> None:
    """``redis_client(settings)`` and its AutoPipelines, and ``workers.settings.connect``: a
    tenant is made, a key issued, a completion admitted, run by the worker, settled."""
    url = tls.tls_url()
    with connect(WorkerSettings(redis_url=url)) as worker_client:
        assert worker_client.ping()
    async with make_harness(url, prompts, model_spec.name) as h:
        assert h.gw.batch.endpoint.tls is not None
        _tenant, key = await h.tenant("over-tls")
        r = await h.complete(key)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] > 0
