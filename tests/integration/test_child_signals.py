"""Starting a child and recording it cannot be split by a stop signal (gateway.processes)."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

from gateway import processes


class Stop(Exception):
    pass


def _raise(signum: int, frame: object) -> None:
    raise Stop


def test_a_stop_signal_waits_until_the_child_is_recorded_and_the_child_can_be_stopped() -> None:
    previous = signal.signal(signal.SIGINT, _raise)
    recorded = []
    try:
        with pytest.raises(Stop):
            with processes.signals_deferred():
                os.kill(os.getpid(), signal.SIGINT)  # arrives "during" the start
                proc = processes.spawn([sys.executable, "-c", "import time; time.sleep(60)"])
                recorded.append(proc)  # still reached: the signal is held until the block ends
        assert len(recorded) == 1
        blocked = int(Path(f"/proc/{recorded[0].pid}/status").read_text().split("SigBlk:")[1].split()[0], 16)
        assert not blocked & (1 << (signal.SIGTERM - 1)) and not blocked & (1 << (signal.SIGINT - 1))
        recorded[0].send_signal(signal.SIGTERM)  # the child is not deaf to the stop it inherited the mask of
        assert recorded[0].wait(timeout=10) == -signal.SIGTERM
    finally:
        signal.signal(signal.SIGINT, previous)
        for proc in recorded:
            if proc.poll() is None:
                proc.kill()
