"""The compiled core must really be the one in use: no silent fallback to Python."""

from pathlib import Path

import sched_core
import sched_core._core


def test_compiled_extension_loaded() -> None:
    path = Path(sched_core._core.__file__)
    assert path.suffix in {".so", ".pyd"}, f"sched_core._core is not an extension: {path}"
    # The editable install elsewhere must not stand in for this checkout's build.
    assert path.parent == Path(sched_core.__file__).parent
    assert sched_core._core.IMPLEMENTATION == "cython"


def test_default_scheduler_is_the_compiled_one() -> None:
    assert sched_core.Scheduler is sched_core._core.Scheduler
    assert sched_core.IMPLEMENTATIONS["cython"] is sched_core._core.Scheduler
    assert sched_core.IMPLEMENTATIONS["reference"] is sched_core.ReferenceScheduler
