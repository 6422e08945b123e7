"""Child processes of `serve`: each in its own session, each dying with its parent.

Its own session keeps Ctrl-C in the terminal (SIGINT to the foreground process group) away
from the children, so `serve` alone decides the order they stop in. PR_SET_PDEATHSIG covers
the case nothing else can: a SIGKILL of `serve` still ends them. The signal fires when the
*thread* that started the child exits, so children are started from the main thread only.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import IO

log = logging.getLogger("tokengate.serve")

_PR_SET_PDEATHSIG = 1


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
STOP_POLL_S = 0.01  # how often ``stop`` looks whether its children are gone: each stage of a stop waits this


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """SIGINT and SIGTERM wait until the block ends. A stop signal during start-up raises
    (``shutdown.Interrupted``) wherever the main thread is: between a child's start and the
    line that records it, it would leave a child nobody stops. Start and record in here.
    The handlers are swapped for a recorder (Python runs handlers in the main thread only,
    whichever thread the signal reached; a mask would cover just this thread), and a signal
    that came meanwhile goes to the real handler as the block ends. In another thread (a
    benchmark restarting its Redis from a worker thread) there is nothing to defer: the
    signal's exception is raised in the main thread, not in the one starting the child."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = {s: signal.signal(s, lambda signum, frame: caught.append(signum)) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for signum in caught:
            handler = previous[signal.Signals(signum)]
            if callable(handler):
                handler(signum, None)
            elif handler == signal.SIG_DFL:
                os.kill(os.getpid(), signum)


def die_with_parent() -> None:
    """``preexec_fn`` of every child: SIGTERM when the parent dies."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def spawn(
    argv: Sequence[str], stdout: int | IO[bytes] | None = None, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """``env``: variables added to this process's environment."""
    return subprocess.Popen(
        list(argv),
        env={**os.environ, **env} if env else None,
        start_new_session=True,
        preexec_fn=die_with_parent,
        stdout=stdout,
        stderr=stdout,
    )


def signal_all(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    """SIGTERM to each that still runs."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)


def stop(
    procs: Sequence[subprocess.Popen[bytes]],
    timeout_s: float,
    hurry: Callable[[], bool] = lambda: False,
    hurry_s: float = 2.0,
    signalled: Sequence[subprocess.Popen[bytes]] = (),
) -> None:
    """SIGTERM to each, then wait up to ``timeout_s`` for all (and for ``signalled``, told
    already); SIGKILL whatever is left.

    ``hurry`` is polled while waiting: once it says yes (a second Ctrl-C), each child gets
    one more SIGTERM (a worker's "exit now") and at most ``hurry_s`` more seconds.
    """
    signal_all(procs)
    procs = [*procs, *signalled]
    deadline = time.monotonic() + timeout_s
    hurried = False
    while any(proc.poll() is None for proc in procs) and time.monotonic() < deadline:
        if hurry() and not hurried:
            hurried = True
            left = sum(proc.poll() is None for proc in procs)
            log.warning("stopping now: %d child process(es) get %g s more", left, hurry_s)
            deadline = min(deadline, time.monotonic() + hurry_s)
            for proc in procs:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
        time.sleep(STOP_POLL_S)
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
