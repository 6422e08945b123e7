"""kill -9 of the gateway that schedules for all, under load (issue 26; ``bench.failover``).

Real processes: Redis, two echo workers, two gateways. The one holding the scheduling lease
is killed twice; every request sent through a gateway that lived must be answered, no request
may reach the workers twice, and jobs must flow again within 2 s."""

from __future__ import annotations

from bench import failover


def test_killing_the_scheduler_loses_nothing_sends_nothing_twice_and_resumes_within_2_s() -> None:
    result = failover.run(duration=16.0, every_s=5.0, gateways=2, clients=12)
    assert result["kills"] >= 2, result
    assert result["answered"] > 100, result
    assert result["lost"] == 0, result
    assert result["duplicated"] == 0, result
    assert max(result["takeover_s"]) <= 2.0, result
    assert result["gap_s"] <= 2.0, result
