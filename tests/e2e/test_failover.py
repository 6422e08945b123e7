"""kill -9 of the gateway that schedules for all, under load (issue 26; ``bench.failover``),
and the same scheduler killed or paused under `tokengate serve --gateways 3` (issue 37;
``bench.role_changes``).

Real processes: Redis, two echo workers, two gateways. The one holding the scheduling lease
is killed twice; every request sent through a gateway that lived must be answered, no request
may reach the workers twice, and jobs must flow again within 2 s. Under `serve`, a kill -9 of
the scheduler is a failover (serve lives on), and a scheduler paused past its lease hands its
queue on: nothing fails, one scheduler at a time."""

from __future__ import annotations

import json

import pytest

from bench import failover, role_changes


def test_killing_the_scheduler_loses_nothing_sends_nothing_twice_and_resumes_within_2_s() -> None:
    result = failover.run(duration=24.0, every_s=8.0, gateways=2, clients=12)  # a restart takes ~8 s here
    print(json.dumps(result, indent=1))  # whole (an assertion's message is cut short): shown when it fails
    assert not result["stuck"], "a killed scheduler nobody took over from: the gateways' logs are printed above"
    assert result["kills"] >= 2, result
    assert result["answered"] > 100, result
    assert result["lost"] == 0, result
    assert result["duplicated"] == 0, result
    assert max(result["takeover_s"]) <= 2.0, result
    assert result["gap_s"] <= 2.0, result


@pytest.mark.parametrize("fault", ["kill", "stop3"])
def test_under_serve_a_killed_or_paused_scheduler_fails_nothing_and_serve_lives_on(fault: str) -> None:
    result = role_changes.run_fault(fault, clients=10, warm_s=3.0, after_s=4.0)
    print(json.dumps(result, indent=1))  # whole (an assertion's message is cut short): shown when it fails
    assert result["serve_alive"], result
    assert result["answered"] > 20, result
    assert result["failed"] == 0 and result["duplicated"] == 0, result
    assert result["schedulers"] == 1, result  # the console never lists two
    assert result["moved_s"] is not None and result["stall_s"] is not None and result["stall_s"] <= 2.0, result
