"""``AutoPipeline`` on a real redis-server: one loop turn's commands go out as one batch, each
future gets its own reply or its own error, an unreachable Redis fails every future instead
of hanging, and ``close`` sends what is queued. On both loops the gateway may run on."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import NoScriptError, RedisError, ResponseError

from gateway.cli.embedded_redis import free_port
from gateway.redis_batch import ERR_CLASSES, ERROR_CLASSES, AutoPipeline

pytestmark = [pytest.mark.redis, pytest.mark.anyio]

UNKNOWN_SHA = "0" * 40
PATIENCE_S = 10.0  # a future not settled by then counts as hanging


@pytest.fixture(params=["asyncio", "uvloop"])
def anyio_backend(request: pytest.FixtureRequest) -> tuple[str, dict[str, bool]]:
    """The plain asyncio loop (tests) and uvloop (what `tokengate gateway` runs on)."""
    return "asyncio", {"use_uvloop": request.param == "uvloop"}


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    c = aioredis.Redis.from_url(redis_url)
    yield c
    await c.aclose()


async def _settled(futures: list[asyncio.Future[Any]]) -> list[Any]:
    """Each future's reply or exception; a future that never settles fails the test."""
    try:
        async with asyncio.timeout(PATIENCE_S):
            return await asyncio.gather(*futures, return_exceptions=True)
    except TimeoutError:
        pending = sum(not f.done() for f in futures)
        raise AssertionError(f"{pending} of {len(futures)} futures still pending after {PATIENCE_S} s") from None


async def _close(batch: AutoPipeline) -> None:
    try:
        async with asyncio.timeout(PATIENCE_S):
            await batch.close()
    except TimeoutError:
        raise AssertionError(f"close() still waiting after {PATIENCE_S} s") from None


async def test_one_turn_is_one_batch_and_each_command_gets_its_own_reply_in_order(
    client: aioredis.Redis,
) -> None:
    batch = AutoPipeline(client)
    futures = [batch.call("INCR", "counter") for _ in range(200)]  # no await between: one turn
    futures.append(batch.call("RPUSH", "list", "a"))
    futures.append(batch.call("RPUSH", "list", "b"))
    futures.append(batch.call("LRANGE", "list", 0, -1))
    futures.append(batch.call("GET", "counter"))

    replies = await _settled(futures)

    assert replies == [*range(1, 201), 1, 2, [b"a", b"b"], b"200"]
    assert (batch.batches, batch.commands) == (1, 204)
    await _close(batch)


async def test_an_error_reply_fails_only_its_own_future(client: aioredis.Redis, redis_client: redis.Redis) -> None:
    redis_client.set("text", "not a number")
    batch = AutoPipeline(client)
    futures = [
        batch.call("INCR", "ok"),
        batch.call("INCR", "text"),  # ERR value is not an integer
        batch.call("EVALSHA", UNKNOWN_SHA, 0),  # NOSCRIPT
        batch.call("LPUSH", "text", "x"),  # WRONGTYPE
        batch.call("INCR", "ok"),
        batch.call("GET", "text"),
    ]

    first, not_integer, no_script, wrong_type, second, text = await _settled(futures)

    assert (first, second, text) == (1, 2, b"not a number")
    assert isinstance(not_integer, ResponseError) and not isinstance(not_integer, NoScriptError)
    assert "not an integer" in str(not_integer)
    assert isinstance(no_script, NoScriptError)  # what Budget catches to load its script
    assert isinstance(wrong_type, ResponseError) and "WRONGTYPE" in str(wrong_type)
    assert batch.batches == 1
    assert redis_client.get("ok") == b"2"
    await _close(batch)


# error replies of every kind redis-py names (and some it does not), raised by a script
ERROR_REPLIES = [
    "NOSCRIPT No matching script. Please use EVAL.",
    "WRONGTYPE Operation against a key holding the wrong kind of value",
    "ERR value is not an integer or out of range",
    "ERR invalid password",
    "ERR max number of clients reached",
    "ERR wrong number of arguments for 'auth' command",
    "ERR Client sent AUTH, but no password is set",
    "ERR",
    "OOM command not allowed when used memory > 'maxmemory'.",
    "WRONGPASS invalid username-password pair or user is disabled.",
    "NOAUTH Authentication required.",
    "NOPERM this user has no permissions to run the 'get' command",
    "LOADING Redis is loading the dataset in memory",
    "READONLY You can't write against a read only replica.",
    "EXECABORT Transaction discarded because of previous errors.",
    "MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'.",
    "BUSYGROUP Consumer Group name already exists",
    "NOGROUP No such key or consumer group",
    # and every entry of our tables
    *(f"{code} some message" for code in ERROR_CLASSES),
    *(f"ERR {message}" for message in ERR_CLASSES),
]


async def test_error_replies_raise_what_redis_py_raises(redis_url: str) -> None:
    """``error_from_reply`` agrees with redis-py's own parser, class and message, reply for reply."""
    client = aioredis.Redis.from_url(redis_url, retry=Retry(NoBackoff(), 0))  # a ConnectionError is not retried
    batch = AutoPipeline(client)
    try:
        for reply in ERROR_REPLIES:
            args = ("EVAL", "return redis.error_reply(ARGV[1])", 0, reply)
            with pytest.raises(RedisError) as theirs:
                await client.execute_command(*args)
            [ours] = await _settled([batch.call(*args)])
            assert (type(ours), str(ours)) == (type(theirs.value), str(theirs.value)), reply
    finally:
        await _close(batch)
        await client.aclose()


async def test_an_unreachable_redis_fails_every_queued_future() -> None:
    nobody = aioredis.Redis.from_url(f"redis://127.0.0.1:{free_port()}/0", socket_timeout=2, socket_connect_timeout=2)
    batch = AutoPipeline(nobody)
    try:
        for _attempt in range(2):  # and again: a failed connection leaves nothing stuck behind
            replies = await _settled([batch.call("PING"), batch.call("INCR", "x"), batch.call("GET", "x")])
            assert len(replies) == 3
            for reply in replies:
                assert isinstance(reply, RedisError), reply
        await _close(batch)
    finally:
        await nobody.aclose()


async def test_commands_of_different_turns_are_different_batches(client: aioredis.Redis) -> None:
    batch = AutoPipeline(client)
    assert await batch.call("PING") in (b"PONG", True)  # the connection is up: the next batches go out at once
    before = batch.batches

    first = batch.call("INCR", "a")
    await asyncio.sleep(0)  # the loop turns: the first batch is flushed
    second = batch.call("INCR", "b")
    third = batch.call("INCR", "b")  # same turn as the second

    assert await _settled([first, second, third]) == [1, 1, 2]
    assert batch.batches - before == 2
    assert (await batch.call("INCR", "a"), batch.batches - before) == (2, 3)
    await _close(batch)


async def test_answered_batches_leave_the_overdue_watch_at_once(client: aioredis.Redis) -> None:
    """The watch keeps one deadline per batch written; answered ones must not pile up until it
    next fires (thousands every 5 s at load: a periodic 10 ms stall of the event loop)."""
    batch = AutoPipeline(client)
    for i in range(500):  # 500 batches, one per turn
        assert await batch.call("INCR", "n") == i + 1
    conn = batch._conn
    assert conn is not None and len(conn.deadlines) == 0
    pending = batch.call("BLPOP", "nothing", 0.2)  # an open batch keeps its deadline while it waits
    await asyncio.sleep(0.05)
    assert len(conn.deadlines) == 1
    assert await pending is None and len(conn.deadlines) == 0
    await _close(batch)


async def test_close_sends_what_is_queued_and_waits_for_the_replies(
    client: aioredis.Redis, redis_client: redis.Redis
) -> None:
    batch = AutoPipeline(client)
    futures = [batch.call("SET", f"key:{i}", str(i)) for i in range(5)]
    futures.append(batch.call("INCR", "closing"))

    await _close(batch)  # in the same turn: nothing was flushed before

    assert all(f.done() for f in futures)
    assert futures[-1].result() == 1
    assert batch.batches == 1
    assert redis_client.mget([f"key:{i}" for i in range(5)]) == [str(i).encode() for i in range(5)]
