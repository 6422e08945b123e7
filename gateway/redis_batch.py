"""Auto-pipelining: the Redis commands a gateway issues in one turn of its event loop go out
together, in one write on one connection.

At a thousand requests a second the gateway's Redis work is many small commands (an
admission script, a settlement script, a job's XADD) from many requests at once. Sent one
by one through redis-py, each pays a pooled connection, a write, a read and the library's
per-call machinery (about 150 us of CPU here). ``AutoPipeline.call`` queues a command and
returns a future; at the next turn of the loop the queue is packed (hiredis) and written at
once on the pipeline's own connection, and the replies, parsed by hiredis as they arrive,
resolve the futures in order. Nothing waits for an earlier batch's replies: Redis answers
one connection's commands in the order it got them. Commands queued by one task keep their
order; commands of different connections are as unordered as they always were.

This is hand-written on purpose: redis-py has no auto-pipelining (ioredis's
``enableAutoPipelining`` is the model), and its own pipeline object costs most of what it
saves. Parsing and packing are hiredis's, errors are redis-py's exception classes (mapped
from the reply as redis-py's parser maps them: ``error_from_reply``). The connection is the
one redis-py would open for the same client: TCP, TLS with the same context, or a unix
socket, with the same login and db (``redis_endpoint``).

Failure is per command where Redis says so (an error reply fails only its future) and per
connection otherwise: a connection that drops, or whose oldest command has waited longer
than ``timeout_s``, is closed and every command on it fails with a RedisError; the next
command opens a new one.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Any, cast

import hiredis
import redis.asyncio as aioredis
from redis.exceptions import (
    AuthenticationError,
    AuthenticationWrongNumberOfArgsError,
    BusyLoadingError,
    ExecAbortError,
    MasterDownError,
    ModuleError,
    NoPermissionError,
    NoScriptError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisError,
    ResponseError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.redis_endpoint import Endpoint, endpoint_of

Batch = list[tuple[tuple[Any, ...], "asyncio.Future[Any]"]]

# redis-py's classes for error replies, by the reply's first word (its parser's table, less the
# cluster redirections this connection never follows); the word is cut off the message
ERROR_CLASSES: dict[str, type[RedisError]] = {
    "OOM": OutOfMemoryError,
    "WRONGPASS": AuthenticationError,
    "EXECABORT": ExecAbortError,
    "LOADING": BusyLoadingError,
    "NOSCRIPT": NoScriptError,
    "READONLY": ReadOnlyError,
    "NOAUTH": AuthenticationError,
    "NOPERM": NoPermissionError,
    "MASTERDOWN": MasterDownError,
}
# ... and for "ERR", by the whole rest of the message (others: a ResponseError)
ERR_CLASSES: dict[str, type[RedisError]] = {
    "max number of clients reached": RedisConnectionError,
    "invalid password": AuthenticationError,
    "wrong number of arguments for 'auth' command": AuthenticationWrongNumberOfArgsError,
    "wrong number of arguments for 'AUTH' command": AuthenticationWrongNumberOfArgsError,
    "AUTH <password> called without any password configured for the default user. "
    "Are you sure your configuration is correct?": AuthenticationError,
    "Client sent AUTH, but no password is set": AuthenticationError,
    "Error loading the extension. Please check the server logs.": ModuleError,
    "Error unloading module: no such module with that name": ModuleError,
    "Error unloading module: operation not possible.": ModuleError,
    "Error unloading module: the module exports one or more module-side data types, can't unload": ModuleError,
}


def error_from_reply(reply: str) -> RedisError:
    """The exception redis-py raises for the error reply ``reply`` (without its ``-``)."""
    code, _, rest = reply.partition(" ")
    if code == "ERR":
        return ERR_CLASSES.get(rest, ResponseError)(rest)
    if code in ERROR_CLASSES:
        return ERROR_CLASSES[code](rest)
    return ResponseError(reply)


class _Connection(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.reader = hiredis.Reader()
        self.waiting: deque[asyncio.Future[Any]] = deque()
        self.deadlines: deque[tuple[float, asyncio.Future[Any]]] = deque()  # per batch: its last command

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        waiting = self.waiting
        while (reply := self.reader.gets()) is not False:
            fut = waiting.popleft()
            if fut.done():
                continue
            if isinstance(reply, hiredis.ReplyError):
                fut.set_exception(error_from_reply(str(reply)))
            else:
                fut.set_result(reply)
        deadlines = self.deadlines  # answered batches leave at once: the watch only ever sees the oldest open one
        while deadlines and deadlines[0][1].done():
            deadlines.popleft()

    def connection_lost(self, exc: Exception | None) -> None:
        self.fail(RedisConnectionError(f"Redis closed the connection: {exc or 'EOF'}"))

    def fail(self, exc: RedisError) -> None:
        self.transport = None
        while self.waiting:
            fut = self.waiting.popleft()
            if not fut.done():
                fut.set_exception(exc)


class AutoPipeline:
    def __init__(self, client: aioredis.Redis, timeout_s: float | None = None) -> None:
        kw = client.connection_pool.connection_kwargs
        self.endpoint: Endpoint = endpoint_of(client)  # a URL it cannot honour stops start-up here
        self.timeout_s = timeout_s or kw.get("socket_timeout") or 5.0
        self._queue: Batch = []
        self._conn: _Connection | None = None
        self._connecting: asyncio.Task[_Connection] | None = None
        self._watch: asyncio.TimerHandle | None = None
        self.batches = 0  # writes (for benchmarks and tests)
        self.commands = 0

    def call(self, *args: Any) -> asyncio.Future[Any]:
        """Queue one command (``execute_command``'s arguments); its future holds the reply,
        or the RedisError that command (or its connection) met. Cancelling the future does
        not unsend the command."""
        if not args:  # Redis answers nothing to an empty command: every later reply would shift
            raise ValueError("a Redis command needs a name")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        if not self._queue:
            loop.call_soon(self._flush)
        self._queue.append((args, fut))
        return fut

    def _flush(self) -> None:
        batch, self._queue = self._queue, []
        if not batch:
            return
        conn = self._conn
        if conn is not None and conn.transport is not None:
            self._write(conn, batch)
            return
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._connect())
        self._connecting.add_done_callback(lambda task: self._after_connect(task, batch))

    def _after_connect(self, task: asyncio.Task[_Connection], batch: Batch) -> None:
        if self._connecting is task:
            self._connecting = None
        if task.cancelled() or task.exception() is not None:
            why = "closed" if task.cancelled() else task.exception()
            exc = RedisConnectionError(f"cannot connect to Redis: {why}")
            for _args, fut in batch:
                if not fut.done():
                    fut.set_exception(exc)
            return
        self._write(task.result(), batch)

    def _write(self, conn: _Connection, batch: Batch) -> None:
        if conn.transport is None:  # lost since: its successor takes the batch
            self._conn = None
            self._queue = batch + self._queue
            asyncio.get_running_loop().call_soon(self._flush)
            return
        self.batches += 1
        self.commands += len(batch)
        try:
            packed = b"".join(hiredis.pack_command(args) for args, _fut in batch)
        except Exception:  # noqa: BLE001 - a command that cannot be packed fails alone
            good: Batch = []
            for args, fut in batch:
                try:
                    hiredis.pack_command(args)
                    good.append((args, fut))
                except Exception as exc:  # noqa: BLE001
                    fut.set_exception(RedisError(f"cannot send {args[:1]!r}: {exc}"))
            if good:
                self._write(conn, good)
            return
        conn.waiting.extend(fut for _args, fut in batch)
        conn.deadlines.append((time.monotonic() + self.timeout_s, batch[-1][1]))
        conn.transport.write(packed)
        if self._watch is None:
            self._watch = asyncio.get_running_loop().call_later(self.timeout_s, self._check)

    def _check(self) -> None:
        """A batch whose last reply is overdue means a stalled Redis: drop the connection, so
        everything on it fails now instead of waiting without end."""
        self._watch = None
        conn = self._conn
        if conn is None:
            return
        while conn.deadlines and conn.deadlines[0][1].done():
            conn.deadlines.popleft()
        if not conn.deadlines:
            return
        deadline = conn.deadlines[0][0]
        now = time.monotonic()
        if now >= deadline and conn.transport is not None:
            transport = conn.transport
            conn.fail(RedisTimeoutError(f"Redis did not answer within {self.timeout_s:g} s"))
            conn.deadlines.clear()
            transport.abort()
            self._conn = None
            return
        self._watch = asyncio.get_running_loop().call_later(max(0.0, deadline - now), self._check)

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        e = self.endpoint
        async with asyncio.timeout(self.timeout_s):
            if e.path is not None:
                _t, conn = await loop.create_unix_connection(_Connection, e.path)
            else:  # with TLS the host is also the name the certificate is checked against
                _t, conn = await loop.create_connection(_Connection, e.host, e.port, ssl=e.tls)
            for args in await e.handshake():
                reply: asyncio.Future[Any] = loop.create_future()
                conn.waiting.append(reply)
                assert conn.transport is not None
                conn.transport.write(hiredis.pack_command(args))
                await reply
        self._conn = conn
        return conn

    async def close(self) -> None:
        """Send what is queued, wait (up to the timeout) for the replies, close."""
        self._flush()
        if self._connecting is not None:
            await asyncio.wait({self._connecting})
            await asyncio.sleep(0)
        conn = self._conn
        if conn is not None and conn.waiting:
            await asyncio.wait(set(conn.waiting), timeout=self.timeout_s)
        if conn is not None and conn.transport is not None:
            conn.transport.close()
        self._conn = None
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
