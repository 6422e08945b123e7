"""Ordered shutdown: SIGINT and SIGTERM alike, and requests that outlive the grace time.

``StopSignals`` owns both signals for the life of the process (uvicorn's own handlers are
switched off): the first one unwinds the start-up, or asks the server to stop admitting and
let in-flight requests finish; any later one forces a fast exit. ``Drain`` ends the requests
still running when the grace time is over with an error the client can read (a 503, or a
final ``data: {"error": ...}`` event on a stream) instead of a cut connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import logging
import signal
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import FrameType

import orjson
import uvicorn
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import Unavailable, error_body

log = logging.getLogger("tokengate.serve")

FORCED_EXIT_S = 10.0  # after a second signal the process is gone within this, whatever hangs
FORCED_LIFESPAN_S = 2.0  # after a second signal, settling budgets and closing dispatch get this


class Interrupted(KeyboardInterrupt):
    """Raised out of the start-up by the first SIGINT/SIGTERM (a KeyboardInterrupt, so that
    event loops propagate it instead of logging it as a callback error)."""


def exit_within(seconds: float) -> None:
    """A C-level timer: if the process is still alive after ``seconds``, every thread's stack
    goes to stderr and it exits with status 1 (re-arming replaces the previous timer)."""
    faulthandler.dump_traceback_later(seconds, exit=True)


class QuietServer(uvicorn.Server):
    """uvicorn's server without its signal handling (which re-raises a caught SIGTERM once
    it is done, killing the process before its children are stopped): ``StopSignals``
    owns SIGINT and SIGTERM."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await super().shutdown(sockets)
        if self.force_exit:  # uvicorn skips the lifespan's shutdown then; give it a moment
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(FORCED_LIFESPAN_S):
                    await self.lifespan.shutdown()


class StopSignals:
    """SIGINT and SIGTERM, treated alike.

    While starting (no server attached) the first signal raises ``Interrupted``; while a
    server runs it sets ``should_exit``; once the stop is under way (``stopping()``, or after
    that first signal) any signal sets ``forced``: uvicorn stops waiting, ``Drain`` ends what
    is left at once, children are hurried, and the process is gone within ``FORCED_EXIT_S``.
    The handler only sets flags and schedules work on the loop: it may interrupt any code,
    the logging module's stream writes included.
    """

    def __init__(self) -> None:
        self.stop_requested = False
        self.forced = False
        self._server: uvicorn.Server | None = None
        self._drain: Drain | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def install(self) -> StopSignals:
        signal.signal(signal.SIGINT, self._handle)
        signal.signal(signal.SIGTERM, self._handle)
        return self

    def serving(self, server: uvicorn.Server, drain: Drain) -> None:
        """Called on the server's loop: signals now stop the server instead of raising."""
        self._loop = asyncio.get_running_loop()
        self._server = server
        self._drain = drain
        if self.stop_requested:
            server.should_exit = True

    def stopping(self) -> None:
        """The server is done (or never ran): from now on a signal forces the stop."""
        self.stop_requested = True
        self._server = None
        self._drain = None
        self._loop = None

    def _soon(self, fn: Callable[..., object], *args: object) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(fn, *args)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.stop_requested:
            if not self.forced:
                self.forced = True
                exit_within(FORCED_EXIT_S)
                if self._server is not None:
                    self._server.force_exit = True
                if self._drain is not None:
                    self._soon(log.warning, "%s again: stopping now", name)
                    self._soon(self._drain.expire)
            return
        self.stop_requested = True
        if self._server is None:
            raise Interrupted(name)
        self._server.should_exit = True
        self._soon(log.info, "%s: admitting nothing new; requests in flight may finish (another signal forces)", name)


@dataclass(eq=False)
class _InFlight:
    task: asyncio.Task[object] | None
    send: Send
    started: bool = False
    complete: bool = False
    stream: bool = False
    cut: bool = False

    async def forward(self, message: Message) -> None:
        if self.cut:
            return  # the app's last words after the grace time; the client got ours
        if message["type"] == "http.response.start":
            self.started = True
            headers = dict(message.get("headers", []))
            self.stream = headers.get(b"content-type", b"").startswith(b"text/event-stream")
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self.complete = True
        await self.send(message)


def shutdown_error(grace_s: float) -> Unavailable:
    return Unavailable(
        f"The server is shutting down: the request did not finish within the {grace_s:g} s shutdown grace time.",
        code="shutting_down",
        headers={"retry-after": "1", "connection": "close"},
    )


class Drain:
    """Outermost ASGI layer: remembers each running HTTP request (its task, what it sent);
    ``expire()`` cancels them and completes each response with ``shutdown_error`` itself."""

    def __init__(self, app: ASGIApp, grace_s: float) -> None:
        self.app = app
        self.grace_s = grace_s
        self._in_flight: set[_InFlight] = set()
        self.expired = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.expired:
            await self._finish(_InFlight(None, send))
            return
        req = _InFlight(asyncio.current_task(), send)
        self._in_flight.add(req)
        try:
            await self.app(scope, receive, req.forward)
        except BaseException:
            if not req.cut:
                raise
            if req.task is not None:
                req.task.uncancel()
        finally:
            self._in_flight.discard(req)
        if req.cut:
            await self._finish(req)

    def expire(self) -> None:
        """The grace time is over: end every request still running."""
        self.expired = True
        if self._in_flight:
            log.warning("shutdown grace time over: ending %d request(s) with an error", len(self._in_flight))
        for req in list(self._in_flight):
            req.cut = True
            if req.task is not None:
                req.task.cancel("shutdown grace time over")

    async def _finish(self, req: _InFlight) -> None:
        err = shutdown_error(self.grace_s)
        body = orjson.dumps(error_body(err))
        if not req.started:
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
            headers += [(k.encode(), v.encode()) for k, v in err.headers.items()]
            await req.send({"type": "http.response.start", "status": err.status, "headers": headers})
            await req.send({"type": "http.response.body", "body": body})
        elif req.stream and not req.complete:
            await req.send({"type": "http.response.body", "body": b"data: " + body + b"\n\n"})
        # a plain response cut half-way cannot be mended: uvicorn closes the connection


async def expire_after_grace(server: uvicorn.Server, drain: Drain, grace_s: float) -> None:
    """Once the server stops admitting, give in-flight requests ``grace_s``, then ``expire``."""
    while not server.should_exit:
        await asyncio.sleep(0.1)
    await asyncio.sleep(grace_s)
    drain.expire()
