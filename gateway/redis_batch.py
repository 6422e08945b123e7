"""Auto-pipelining: the Redis commands a gateway issues in one turn of its event loop go out
together, in one pipelined round trip.

At a thousand requests a second the gateway's Redis work is many small commands (an
admission script, a settlement script, a job's XADD) from many requests at once. Sent one
by one, each pays a pooled connection, a write, a read and the client library's per-call
overhead. ``AutoPipeline.call`` queues a command and returns a future; the queue is sent at
the next turn of the loop as one non-transactional pipeline on one pooled connection, and
each future gets its own reply (or its own error). Batches are not serialised: a batch
is sent at once even while an earlier one awaits its replies, so a command waits at most
one loop turn before it is written. Commands queued by one task keep their order; commands
of different batches are as unordered as separate connections always were.

redis-py has no auto-pipelining of its own (ioredis's ``enableAutoPipelining`` is the model
here).
"""

from __future__ import annotations

import asyncio
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError


class AutoPipeline:
    def __init__(self, client: aioredis.Redis) -> None:
        self.client = client
        self._queue: list[tuple[tuple[Any, ...], asyncio.Future[Any]]] = []
        self._inflight: set[asyncio.Task[None]] = set()
        self.batches = 0  # pipelines sent (for benchmarks)
        self.commands = 0

    def call(self, *args: Any) -> asyncio.Future[Any]:
        """Queue one command (``execute_command``'s arguments); its future holds the reply,
        or the RedisError that command (or its batch's connection) met. Cancelling the
        future does not unsend the command."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        if not self._queue:
            loop.call_soon(self._flush)
        self._queue.append((args, fut))
        return fut

    def _flush(self) -> None:
        batch, self._queue = self._queue, []
        if batch:
            task = asyncio.ensure_future(self._send(batch))
            self._inflight.add(task)
            task.add_done_callback(self._inflight.discard)

    async def _send(self, batch: list[tuple[tuple[Any, ...], asyncio.Future[Any]]]) -> None:
        self.batches += 1
        self.commands += len(batch)
        pipe = self.client.pipeline(transaction=False)
        for args, _fut in batch:
            pipe.execute_command(*args)
        try:
            replies: list[Any] = await pipe.execute(raise_on_error=False)
        except (RedisError, OSError) as exc:
            replies = [exc] * len(batch)
        except asyncio.CancelledError:  # the gateway is closing: nobody may wait forever
            replies = [RedisConnectionError("the gateway closed its Redis connection")] * len(batch)
            self._settle(batch, replies)
            raise
        self._settle(batch, replies)

    @staticmethod
    def _settle(batch: list[tuple[tuple[Any, ...], asyncio.Future[Any]]], replies: list[Any]) -> None:
        for (_args, fut), reply in zip(batch, replies, strict=True):
            if fut.done():
                continue
            if isinstance(reply, BaseException):
                fut.set_exception(reply if isinstance(reply, RedisError) else RedisConnectionError(str(reply)))
            else:
                fut.set_result(reply)

    async def close(self) -> None:
        """Send what is queued and wait for the batches in flight."""
        self._flush()
        if self._inflight:
            await asyncio.wait(set(self._inflight))
