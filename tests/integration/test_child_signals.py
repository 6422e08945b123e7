"""Starting a child and recording it cannot be split by a stop signal (gateway.cli.processes)."""

from __future__ import annotations

import os
import signal
import sys
import threading

import pytest

from gateway.cli import processes


class Stop(Exception):
    pass


def _raise(signum: int, frame: object) -> None:
    raise Stop


def test_a_stop_signal_waits_until_the_child_is_recorded() -> None:
    previous = signal.signal(signal.SIGINT, _raise)
    recorded = []
    idle = threading.Event()
    other = threading.Thread(target=idle.wait, daemon=True)  # the signal may reach any thread
    other.start()
    try:
        with pytest.raises(Stop):
            with processes.signals_deferred():
                os.kill(os.getpid(), signal.SIGINT)  # arrives "during" the start
                proc = processes.spawn([sys.executable, "-c", "import time; time.sleep(60)"])
                recorded.append(proc)  # still reached: the signal is held until the block ends
        assert len(recorded) == 1
        assert signal.getsignal(signal.SIGINT) is _raise  # the real handler is back
    finally:
        idle.set()
        signal.signal(signal.SIGINT, previous)
        for proc in recorded:
            proc.kill()
            proc.wait()


def test_a_child_started_from_another_thread_needs_no_deferral() -> None:
    """A benchmark restarts its Redis from a worker thread: nothing to defer there, and no error
    (signal handlers can only be set in the main thread)."""
    started: list[object] = []
    errors: list[BaseException] = []

    def start() -> None:
        try:
            with processes.signals_deferred():
                started.append(processes.spawn([sys.executable, "-c", "pass"]))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    thread = threading.Thread(target=start)
    thread.start()
    thread.join(timeout=30)
    assert not errors and len(started) == 1
    started[0].wait()  # type: ignore[attr-defined]
