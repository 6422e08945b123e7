"""EmbeddedRedis: its own session, durable with a data directory, restartable, leaves nothing."""

from __future__ import annotations

import os
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from gateway.cli.embedded_redis import EmbeddedRedis

pytestmark = pytest.mark.redis


@pytest.fixture
def private_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    tmp = tmp_path / "tmpdir"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    yield tmp


def test_without_a_data_dir_nothing_persists_and_nothing_is_left(private_tmp: Path) -> None:
    server = EmbeddedRedis().start()
    assert server.proc is not None
    assert os.getsid(server.proc.pid) == server.proc.pid != os.getsid(0)  # Ctrl-C does not reach it
    redis.Redis.from_url(server.url).set("k", "v")
    assert list(private_tmp.iterdir())  # its log, while it runs
    server.restart()
    assert redis.Redis.from_url(server.url).get("k") is None
    server.stop()
    assert not list(private_tmp.iterdir())


def test_with_a_data_dir_writes_survive_a_kill_and_a_new_server(tmp_path: Path, private_tmp: Path) -> None:
    data = tmp_path / "data"
    server = EmbeddedRedis(data_dir=data).start()
    try:
        redis.Redis.from_url(server.url).set("tenant", "acme")
        assert server.proc is not None
        old = server.proc.pid
        os.kill(old, signal.SIGKILL)  # a crash: the reply came after the AOF write, so it is kept
        server.proc.wait()
        server.restart()
        assert server.proc.pid != old
        assert redis.Redis.from_url(server.url).get("tenant") == b"acme"
        with pytest.raises(RuntimeError, match="another tokengate uses the data directory"):
            EmbeddedRedis(data_dir=data).start()
    finally:
        server.stop()
    with EmbeddedRedis(data_dir=data) as again:  # a new `serve`: another port, the same data
        assert redis.Redis.from_url(again.url).get("tenant") == b"acme"
    assert (data / "appendonlydir").is_dir()
    assert not list(private_tmp.iterdir())


def test_a_relative_data_dir_works_and_a_failed_start_says_why(tmp_path: Path, private_tmp: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    server = EmbeddedRedis(data_dir=Path("data")).start()  # as `serve --data-dir data` passes it
    try:
        assert redis.Redis.from_url(server.url).set("k", "v")
        assert (tmp_path / "data" / "redis.log").exists()
    finally:
        server.stop()
    broken = EmbeddedRedis(data_dir=Path("broken"))
    monkeypatch.setattr(broken, "_argv", lambda where: [broken.binary, "--port", "-1", "--dir", str(where)])
    with pytest.raises(RuntimeError, match=r"exited at start-up \(status 1\)"):  # its status, not a blank
        broken.start()
