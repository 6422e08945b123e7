"""What a re-solve is told of the fleet: the workers' measured profiles, each with the formulas
the scheduler fitted on their live steps where it fitted any (``tuning.deployment_args``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from common import protocol as p
from gateway.dispatch.tuning import deployment_args
from sched_core.simulate.cli import read_fleet
from sched_core.types import DEFAULT_PROFILES, packaged_profile

LEARNT = {"decode_launch": 0.09, "decode_seq": 0.018, "kv_token": 9e-6, "prefill_launch": 0.17,
          "prefill_token": 2.2e-3, "prefill_attention": 0.0}


def _workers() -> dict[str, p.Heartbeat]:
    profile = {**packaged_profile(DEFAULT_PROFILES["cpu"]), "pool": "cpu", "measured_at": 1.0}
    return {w: p.Heartbeat(w, "cpu", "cpu", "float32", "transformers", "m", 32, 32, 0.0, 0.0, profile=profile)
            for w in ("w1", "w2")}


@pytest.mark.parametrize("fitted", [0, 800])
def test_the_fleet_a_re_solve_simulates_runs_at_the_speed_the_scheduler_learnt(tmp_path: Path, fitted: int) -> None:
    out = tmp_path / "fleet.json"
    args = deployment_args(_workers(), "m", out, {"cpu": {"fitted_steps": fitted, "step_model": LEARNT}})
    assert args[:4] == ["--cpu-workers", "2", "--cpu-slots", "32"] and args[-2:] == ["--fleet", str(out)]
    prof = read_fleet(str(out)).profiles[""]["cpu"]
    step = LEARNT["decode_launch"] + LEARNT["decode_seq"] * 32 + LEARNT["kv_token"] * 32 * 200
    if fitted:  # the online fit's formulas, on the measured profile's step budget and spread
        assert prof.decode_step_s(32, 200) == pytest.approx(step)
        assert prof.prefill_s(1, 100) == pytest.approx(LEARNT["prefill_launch"] + LEARNT["prefill_token"] * 100)
        assert "800 live steps" in prof.source
    else:  # nothing fitted yet: the profile as the workers measured it
        assert prof.decode_step_s(32, 200) != pytest.approx(step)
        assert "live steps" not in prof.source
