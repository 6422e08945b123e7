"""`serve`'s private Redis never takes the port its gateway is about to listen on: that port is
free to the system until the gateway binds it (a CI run lost a test to exactly that)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from gateway.cli import embedded_redis


class FakeSocket:
    """Binds to the ports of ``handed`` in turn, as the system hands out ephemeral ports."""

    handed: Iterator[int] = iter(())

    def __enter__(self) -> FakeSocket:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def bind(self, _address: tuple[str, int]) -> None:
        self.port = next(self.handed)

    def getsockname(self) -> tuple[str, int]:
        return ("127.0.0.1", self.port)


def test_a_free_port_is_never_one_to_avoid(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeSocket.handed = iter([8000, 8000, 44257])
    monkeypatch.setattr(embedded_redis.socket, "socket", FakeSocket)
    assert embedded_redis.free_port(avoid=(8000,)) == 44257
    FakeSocket.handed = iter([8000])
    assert embedded_redis.free_port() == 8000  # nothing to avoid: the first the system hands out


def test_the_private_redis_avoids_the_port_it_is_told(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeSocket.handed = iter([9100, 9101])
    monkeypatch.setattr(embedded_redis.socket, "socket", FakeSocket)
    monkeypatch.setattr(embedded_redis, "redis_server_binary", lambda: "redis-server")
    assert embedded_redis.EmbeddedRedis(avoid=(9100,)).port == 9101
