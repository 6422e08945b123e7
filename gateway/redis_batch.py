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
saves. Parsing and packing are hiredis's, errors are redis-py's exception classes.

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
from redis._parsers.base import BaseParser
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

Batch = list[tuple[tuple[Any, ...], "asyncio.Future[Any]"]]


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
                fut.set_exception(BaseParser.parse_error(str(reply)))
            else:
                fut.set_result(reply)

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
        self._address: dict[str, Any] = {k: kw.get(k) for k in ("host", "port", "path", "db", "username", "password")}
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
        a = self._address
        async with asyncio.timeout(self.timeout_s):
            if a.get("path"):
                _t, conn = await loop.create_unix_connection(_Connection, a["path"])
            else:
                _t, conn = await loop.create_connection(_Connection, a["host"], a["port"])
            hello: list[tuple[Any, ...]] = []
            if a.get("password") is not None:
                hello.append(("AUTH", a["username"], a["password"]) if a.get("username") else ("AUTH", a["password"]))
            if a.get("db"):
                hello.append(("SELECT", a["db"]))
            for args in hello:
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
