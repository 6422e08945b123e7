"""What a re-solve is told of the fleet: the workers' measured profiles, each with its formulas
refit on the pool's live step records where there are enough (``tuning.deployment_args``)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from common import protocol as p
from gateway.dispatch.tuning import LIVE_STEPS, deployment_args, live_steps
from sched_core.costmodel import MIN_LIVE_STEPS
from sched_core.simulate.cli import read_fleet
from sched_core.types import DEFAULT_PROFILES, packaged_profile

# steps as a worker sharing its CPUs ran them (bench.policies_live's refit, AMD EPYC)
LIVE = {"decode_launch": 0.1, "decode_seq": 0.0186, "kv_token": 2.24e-5, "prefill_launch": 0.164,
        "prefill_token": 0.0023}


def _workers() -> dict[str, p.Heartbeat]:
    profile = {**packaged_profile(DEFAULT_PROFILES["cpu"]), "pool": "cpu", "measured_at": 1.0}
    return {w: p.Heartbeat(w, "cpu", "cpu", "float32", "transformers", "m", 32, 32, 0.0, 0.0, profile=profile)
            for w in ("w1", "w2")}


def _steps(n: int) -> list[tuple[int, int, int, float]]:
    """``n`` live steps of every kind, timed by ``LIVE`` with a 5 % spread."""
    rng = random.Random(7)
    out = []
    for i in range(n):
        seqs = 0 if i % 10 == 0 else rng.randint(1, 32)
        prefill = rng.choice((0, 0, rng.randint(8, 64))) if seqs else rng.randint(8, 64)
        kv = seqs * rng.randint(20, 200)
        t = (LIVE["decode_launch"] * (seqs > 0) + LIVE["decode_seq"] * seqs + LIVE["kv_token"] * kv
             + LIVE["prefill_launch"] * (prefill > 0) + LIVE["prefill_token"] * prefill)
        out.append((prefill, seqs, kv, t * rng.uniform(0.95, 1.05)))
    return out


@pytest.mark.parametrize("live", [MIN_LIVE_STEPS, MIN_LIVE_STEPS - 1, 0])
def test_a_re_solve_simulates_the_workers_at_the_speed_they_served(tmp_path: Path, live: int) -> None:
    out = tmp_path / "fleet.json"
    args = deployment_args(_workers(), "m", out, {"cpu": _steps(live)})
    assert args[:4] == ["--cpu-workers", "2", "--cpu-slots", "32"] and args[-2:] == ["--fleet", str(out)]
    prof = read_fleet(str(out)).profiles[""]["cpu"]
    served = LIVE["decode_launch"] + LIVE["decode_seq"] * 32 + LIVE["kv_token"] * 32 * 100
    prompt = LIVE["prefill_launch"] + LIVE["prefill_token"] * 40
    if live >= MIN_LIVE_STEPS:  # the formulas of the live steps, within their spread
        assert prof.decode_step_s(32, 100) == pytest.approx(served, rel=0.05)
        assert prof.prefill_s(1, 40) == pytest.approx(prompt, rel=0.05)
        assert f"{live} live steps" in prof.source
    else:  # too few to tell: the profile as the workers measured it
        assert prof.decode_step_s(32, 100) != pytest.approx(served, rel=0.05)
        assert "live steps" not in prof.source


def _entry(pool: str, first: int, n: int) -> tuple[bytes, dict[bytes, bytes]]:
    steps = tuple(p.StepRecord(i, 1, 10, 2.0) for i in range(first, first + n))
    fields = p.encode_telemetry(p.Telemetry("w1", pool, 32, 0, 1, 0, 64, steps))
    return b"0-0", {k.encode(): v for k, v in fields.items()}


def test_the_live_steps_are_each_pool_s_latest_oldest_first() -> None:
    per_entry = p.TELEMETRY_MAX_STEPS
    newest_first = [_entry("cpu", i * per_entry, per_entry) for i in reversed(range(LIVE_STEPS // per_entry + 2))]
    newest_first.insert(3, (b"0-0", {b"junk": b"not telemetry"}))  # (an entry this version cannot read)
    newest_first.append(_entry("gpu", 0, 3))
    steps = live_steps(newest_first)
    assert len(steps["cpu"]) == LIVE_STEPS and [r[0] for r in steps["gpu"]] == [0, 1, 2]
    prefills = [r[0] for r in steps["cpu"]]
    assert prefills == sorted(prefills) and prefills[-1] == (LIVE_STEPS // per_entry + 2) * per_entry - 1
    assert steps["cpu"][0][1:] == (1, 10, 0.002)  # (seqs, KV, seconds)
