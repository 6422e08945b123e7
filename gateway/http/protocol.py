"""uvicorn's httptools protocol with the limits a public HTTP server needs.

uvicorn (0.54) has no timeout for a request's line and headers, no cap on open connections,
and answers malformed HTTP with a plain-text 400. Per connection, this subclass adds:

- a header timeout: from the connection's first moment (and, on a keep-alive connection,
  from the first byte of each later request) until the end of the headers; a connection
  that has not sent them by then is closed (with a 408 if it had started a request);
- a connection cap: at ``max_connections``, a new connection first takes the place of an
  idle one (a keep-alive connection between requests), which is closed, as nginx reuses
  idle keep-alive connections; only when every connection
  is busy does the new one get a 503 with ``Retry-After`` at once, before anything is
  parsed; its input is then discarded for at most a second (closing a socket with unread
  input would send a reset that destroys the 503 on its way), and beyond
  ``REFUSAL_LINGER_MAX`` such connections new ones are dropped without a word;
- OpenAI's error body (``errors.error_body``) on every answer uvicorn gives by itself; a
  400 to malformed HTTP and a 408 at the header timeout linger the same way as the 503;
- the body deadline of each request in its scope (``web.BODY_DEADLINE``), which
  ``web.read_json`` enforces with a 408.

The idle time between requests is uvicorn's own ``timeout_keep_alive``.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from dataclasses import dataclass
from typing import Any, ClassVar

import orjson
import uvicorn
from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol
from uvicorn.server import ServerState

from gateway.errors import GatewayError, InvalidRequest, RequestTimeout, Unavailable, error_body
from gateway.http.web import BODY_DEADLINE

log = logging.getLogger("tokengate.gateway")

REFUSAL_LOG_S = 10.0  # at most one warning about refused connections per this many seconds
REFUSAL_LINGER_S = 1.0  # a refused connection is read (and discarded) this long for the 503 to arrive
REFUSAL_LINGER_MAX = 1024  # refused connections lingering at once; beyond it they are dropped at once
NOFILE_MIN_HEADROOM = 256  # descriptors kept free of client connections (Redis, model, logs)
# The uvicorn series (major.minor) that GuardedProtocol, a subclass of uvicorn's internal
# HttpToolsProtocol, and shutdown.QuietServer, which overrides uvicorn.Server's signal and
# lifespan handling, were tested against; pyproject.toml pins uvicorn to them. For another
# series: re-check both against its httptools_impl.py and server.py, then add it here.
TESTED_UVICORN = ("0.54",)


def untested_uvicorn(version: str = uvicorn.__version__) -> str | None:
    """Why ``version`` of uvicorn is not known to work here, or None if it is."""
    if ".".join(version.split(".")[:2]) in TESTED_UVICORN:
        return None
    return (f"uvicorn {version} is not a version tested with gateway/http/protocol.py and gateway/cli/shutdown.py "
            f"(TESTED_UVICORN: {', '.join(TESTED_UVICORN)}): re-check both against it")


def connection_cap(requested: int, nofile: int) -> int:
    """``--max-connections`` as granted under an open-file limit of ``nofile``: below it by
    an eighth, at least ``NOFILE_MIN_HEADROOM``, for the Redis pool, files and the listener."""
    headroom = max(NOFILE_MIN_HEADROOM, nofile // 8)
    return max(1, min(requested, nofile - headroom))


def raise_nofile_limit() -> int:
    """Raises this process's soft RLIMIT_NOFILE to its hard limit; returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, target, exc)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    header_timeout_s: float
    body_timeout_s: float
    max_connections: int


def error_response_bytes(err: GatewayError) -> bytes:
    """A complete HTTP/1.1 response that closes the connection, for answers given before (or
    instead of) the application: status line, JSON error body, ``connection: close``."""
    body = orjson.dumps(error_body(err))
    head = [STATUS_LINE[err.status]]
    for name, value in {**err.headers, "content-type": "application/json", "connection": "close"}.items():
        head.append(f"{name}: {value}\r\n".encode("latin-1"))
    head.append(b"content-length: %d\r\n\r\n" % len(body))
    return b"".join(head) + body


MALFORMED = error_response_bytes(
    InvalidRequest(
        "The request is not valid HTTP/1.1 (request line, a header or Content-Length).",
        code="invalid_http_request",
    )
)
HEADER_TIMEOUT = error_response_bytes(
    RequestTimeout("The request line and headers did not arrive in time.", code="header_timeout")
)
OVERLOADED = error_response_bytes(
    Unavailable(
        "The server has too many open connections; try again shortly.",
        code="too_many_connections",
        headers={"retry-after": "1"},
    )
)


class _Refusals:
    """Counts refused connections, to log them at most every ``REFUSAL_LOG_S`` seconds, and
    those still lingering."""

    def __init__(self) -> None:
        self.count = 0
        self.logged_at = 0.0
        self.lingering = 0

    def note(self, open_now: int, limit: int) -> None:
        self.count += 1
        now = time.monotonic()
        if now - self.logged_at >= REFUSAL_LOG_S:
            log.warning("refused %d connection(s): %d open, --max-connections %d", self.count, open_now, limit)
            self.count = 0
            self.logged_at = now


class GuardedProtocol(HttpToolsProtocol):
    """Built by ``protocol_class`` with its limits; uvicorn makes one per connection."""

    limits: ClassVar[ConnectionLimits]
    refusals: ClassVar[_Refusals]

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self._header_timer: asyncio.TimerHandle | None = None
        self._in_request = False  # bytes of a request's head have arrived, the head is not complete
        self._linger: asyncio.TimerHandle | None = None  # set on a refused connection

    # -- connection cap ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.limits.max_connections and not self._reclaim_idle():
            self._refuse(transport)
            return
        super().connection_made(transport)
        self._arm_header_timer()

    def _idle(self) -> bool:
        """A keep-alive connection between requests: closing it loses nothing. (A new
        connection that has not sent its first request yet is not idle: it is about to.)"""
        return (
            self._linger is None
            and not self._in_request
            and self.cycle is not None
            and self.cycle.response_complete
            and not self.transport.is_closing()
        )

    def _reclaim_idle(self) -> bool:
        """Close one idle connection to make room; False when every connection is busy."""
        for conn in self.connections:
            if isinstance(conn, GuardedProtocol) and conn._idle():
                conn._disarm_header_timer()
                conn.transport.close()
                self.connections.discard(conn)  # counted out now; its connection_lost comes later
                return True
        return False

    def _refuse(self, transport: asyncio.Transport) -> None:
        """503 and FIN now; what the client sends is discarded until it closes, or a second."""
        self.transport = transport
        self.refusals.note(len(self.connections), self.limits.max_connections)
        if not self._answer_and_linger(OVERLOADED):
            transport.abort()

    def _answer_and_linger(self, response: bytes) -> bool:
        """Write a last answer and a FIN, then discard what the client still sends until it
        closes, or for a second: closing a socket with unread input sends a reset, which can
        destroy the answer on its way (a 400 to a request line that came with a megabyte of
        header was lost so, now and then). False, having written nothing, when
        ``REFUSAL_LINGER_MAX`` connections linger already, or while an earlier request on the
        connection is still being answered (its answer must not meet a closed write side)."""
        busy = self.cycle is not None and not self.cycle.response_complete
        if busy or self.refusals.lingering >= REFUSAL_LINGER_MAX or not self.transport.can_write_eof():
            return False
        self.transport.write(response)
        self.transport.write_eof()
        self.refusals.lingering += 1
        self._linger = self.loop.call_later(REFUSAL_LINGER_S, self.transport.abort)
        return True

    def _last_answer(self, response: bytes) -> None:
        """The connection's last answer: lingering where it may, else written and closed."""
        if not self._answer_and_linger(response):
            self.transport.write(response)
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self._linger is None:
            super().data_received(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        if self._linger is not None:
            self._linger.cancel()
            self.refusals.lingering -= 1
        super().connection_lost(exc)

    # -- header timeout ---------------------------------------------------------------------

    def _arm_header_timer(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.limits.header_timeout_s, self._header_timeout)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        if self._in_request:
            self._last_answer(HEADER_TIMEOUT)
        else:
            self.transport.close()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_request = True
        self._arm_header_timer()  # a later request on a keep-alive connection

    def on_headers_complete(self) -> None:
        self._in_request = False
        self._disarm_header_timer()
        self.scope["extensions"] = {BODY_DEADLINE: {"at": self.loop.time() + self.limits.body_timeout_s}}
        super().on_headers_complete()

    # -- malformed requests -----------------------------------------------------------------

    def send_400_response(self, msg: str) -> None:
        self._disarm_header_timer()
        self._last_answer(MALFORMED)


def protocol_class(limits: ConnectionLimits) -> type[GuardedProtocol]:
    """The class to pass as ``uvicorn.Config(http=...)``: one per server, with its limits."""
    if (why := untested_uvicorn()) is not None:
        log.warning("%s", why)
    attrs = {"limits": limits, "refusals": _Refusals()}
    return type("GuardedProtocol", (GuardedProtocol,), attrs)
