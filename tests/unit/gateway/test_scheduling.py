"""The gateway's translation to and from the scheduling core (pure: no Redis, no clock)."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from importlib import resources
from pathlib import Path

import pytest

from common import protocol as p
from gateway.dispatch.fleet import capacity_share, scheduler_config
from gateway.dispatch.scheduling import Origin, SchedulerShell
from sched_core import Contract, Reject, SchedulerConfig
from sched_core.contracts import CHECK_OUTCOMES
from sched_core.types import DEFAULT_PROFILES

WHO = Origin(tenant="t1", weight=1000.0)


def _hb(wid: str, pool: str, slots: int) -> p.Heartbeat:
    return p.Heartbeat(wid, pool, "cpu", "float32", "echo", "m", slots, slots, 0.0, 0.0)


def _seq(rid: str, n: int = 20, max_tokens: int = 8) -> p.SeqJob:
    return p.SeqJob(rid, tuple(range(1, n + 1)), p.SamplingParams(max_tokens))


def _shell(**kw: object) -> SchedulerShell:
    shell = SchedulerShell("gw1", "tg:replies:gw1", **kw)  # type: ignore[arg-type]
    shell.capacity({"w": _hb("w", "cpu", 8)}, now=0.0)
    return shell


def test_capacity_is_every_live_worker_of_each_pool() -> None:
    workers = {"a": _hb("a", "cpu", 32), "b": _hb("b", "cpu", 32), "g": _hb("g", "gpu", 5)}
    assert capacity_share(workers) == {"cpu": (64, 2), "gpu": (5, 1)}
    assert capacity_share({}) == {"cpu": (0, 1), "gpu": (0, 1)}


def test_a_worker_that_says_it_is_down_adds_no_capacity() -> None:
    down = replace(_hb("b", "cpu", 32), down="upstream http://h:1 does not answer")
    assert capacity_share({"a": _hb("a", "cpu", 8), "b": down})["cpu"] == (8, 1)
    assert capacity_share({"b": down})["cpu"] == (0, 1)


def test_admitted_requests_leave_as_stream_jobs_in_dispatch_order() -> None:
    shell = _shell()
    contracts = [shell.arrive(_seq(f"r{i}"), WHO, now=0.0) for i in range(3)]
    assert all(isinstance(c, Contract) for c in contracts)
    sends: list = []
    t = 0.0
    while len(shell):
        t += 0.05
        more, rejects = shell.tick(t)
        sends += more
        assert not rejects
    rids = [s.rid for send in sends for s in send.job.seqs]
    assert sorted(rids) == ["r0", "r1", "r2"]
    for send in sends:
        assert send.pool == "cpu"  # the only pool with capacity
        assert send.job.reply_to == "tg:replies:gw1"
        assert send.job.batch_id.startswith("gw1:")


def test_completed_feeds_own_batches_and_ignores_foreign_ones() -> None:
    shell = _shell()
    shell.arrive(_seq("r"), WHO, now=0.0)
    t, sends = 0.0, []
    while not sends:
        t += 0.05
        sends, _ = shell.tick(t)
    job = sends[0].job
    before = shell.driver.policy.snapshot()["paths"]["cpu"]["in_flight"]
    foreign = p.BatchReport("other:1", "cpu", "w", 1, 20, 0.01, 8, 0.1, (8,))
    shell.completed(foreign, t + 1)
    handoff = p.BatchReport(job.batch_id + "/r", "gpu", "w", 1, 20, 0.0, 8, 0.1, (8,))
    shell.completed(handoff, t + 1)
    assert shell.driver.policy.snapshot()["paths"]["cpu"]["in_flight"] == before == 1
    shell.completed(p.BatchReport(job.batch_id, "cpu", "w", 1, 20, 0.01, 8, 0.1, (8,)), t + 1)
    assert shell.driver.policy.snapshot()["paths"]["cpu"]["in_flight"] == 0


def test_cancel_while_queued_means_never_dispatched() -> None:
    shell = _shell()
    shell.capacity({}, now=0.0)  # no capacity: everything waits
    shell.arrive(_seq("gone"), WHO, now=0.0)
    assert shell.cancel("gone", 0.1)
    assert not shell.cancel("gone", 0.2)  # repeated cancel is harmless
    shell.capacity({"w": _hb("w", "cpu", 8)}, now=0.3)
    sends, rejects = shell.tick(1.0)
    assert not sends and not rejects


def test_a_deadline_the_contract_cannot_meet_is_rejected_at_once() -> None:
    shell = _shell()
    decision = shell.arrive(_seq("hurry", n=2000, max_tokens=500), Origin("t1", 100.0, deadline_s=0.001), 0.0)
    assert isinstance(decision, Reject) and decision.reason == "deadline"
    assert decision.estimate_s > 0.001


def test_long_prompts_are_handed_to_the_gpu_pool_when_asked() -> None:
    shell = SchedulerShell("gw1", "tg:replies:gw1", handoff_min_prompt=10)
    shell.capacity({"c": _hb("c", "cpu", 8), "g": _hb("g", "gpu", 1)}, 0.0)
    shell.driver.policy.worker_capacity("gpu", 0, 0.0)  # keep the batch on the cpu path
    shell.arrive(_seq("long", n=40), WHO, 0.0)
    shell.arrive(_seq("short", n=5), WHO, 0.0)
    t, sends = 0.0, []
    while len(shell):
        t += 0.05
        more, _ = shell.tick(t)
        sends += more
    handoffs = {s.rid: s.handoff for send in sends for s in send.job.seqs}
    assert handoffs == {"long": "gpu", "short": None}


def test_ignore_eos_makes_the_output_length_known_to_the_contract() -> None:
    """Without stop strings, ignore_eos means exactly max_tokens tokens: the decode part of the
    contract scales with it instead of with the scheduler's default estimate."""

    def decode_s(params: p.SamplingParams) -> float:
        contract = _shell().arrive(p.SeqJob("r", tuple(range(1, 21)), params), WHO, now=0.0)
        assert isinstance(contract, Contract)
        return contract.total_s - contract.ttft_s

    exact = [decode_s(p.SamplingParams(n, ignore_eos=True)) for n in (2, 200)]
    assert exact[1] > 50 * exact[0]
    assert decode_s(p.SamplingParams(200, ignore_eos=True, stop=("x",))) == decode_s(p.SamplingParams(200))


def test_cost_priors_from_a_file_seed_the_paths_and_bad_files_name_the_problem(tmp_path: Path) -> None:
    good = tmp_path / "priors.json"
    good.write_text('{"priors": {"cpu": {"decode_launch": 0.05, "decode_seq": 0.006, "max_batch": 16}}}')
    config = scheduler_config(str(good))
    assert (config.cpu.decode_launch, config.cpu.decode_seq, config.cpu.max_batch) == (0.05, 0.006, 16)
    assert config.cpu.kv_token == SchedulerConfig().cpu.kv_token and config.gpu == SchedulerConfig().gpu
    assert scheduler_config(None) == SchedulerConfig()
    # A profile written by bench/cost_profile.py seeds the path its pool names with its step model;
    # the packaged ones are the defaults.
    for pool in ("cpu", "gpu"):
        profile = json.loads(resources.files("sched_core").joinpath("profiles", DEFAULT_PROFILES[pool]).read_text())
        good.write_text(json.dumps(profile))
        assert scheduler_config(str(good)) == SchedulerConfig()
        good.write_text(json.dumps(profile | {"step_model": profile["step_model"] | {"max_batch": 3}}))
        assert getattr(scheduler_config(str(good)), pool).max_batch == 3
    cases = {
        '{"tpu": {}}': "keys among",
        '{"cpu": {"decode_x": 1}}': "unknown decode_x",
        '{"cpu": {"decode_seq": -1}}': "must be >= 0",
        '{"name": "x", "step_model": {}}': "needs a pool",
        '{"pool": "gpu", "step_model": {"prefill_a": 1}}': "gpu: unknown prefill_a",
        "not json": "priors.json",
    }
    for text, message in cases.items():
        good.write_text(text)
        with pytest.raises(ValueError, match=message):
            scheduler_config(str(good))
    with pytest.raises(ValueError, match="missing.json"):
        scheduler_config(str(tmp_path / "missing.json"))


def _dispatched(shell: SchedulerShell, rids: list[str], start: float = 0.0) -> tuple[list, float]:
    for rid in rids:
        assert isinstance(shell.arrive(_seq(rid), WHO, now=start), Contract)
    t, sends = start, []
    while len(shell):
        t += 0.05
        sends += shell.tick(t)[0]
    return sends, t


def _used(shell: SchedulerShell) -> int:
    return sum(int(path["in_flight"]) for path in shell.driver.policy.snapshot()["paths"].values())


def _report(send, shell: SchedulerShell) -> p.BatchReport:  # type: ignore[no-untyped-def]
    n = len(send.job.seqs)
    return p.BatchReport(send.job.batch_id, send.pool, "w", n, 20, 0.01, 8, 0.08, (8,) * n)


def test_a_batch_that_could_not_be_sent_gives_its_slots_back_at_once() -> None:
    shell = _shell()
    sends, t = _dispatched(shell, ["a", "b"])
    assert shell.leases == len(sends) and _used(shell) == 2
    stranded = [rid for send in sends for rid in shell.abort(send.batch, t)]
    assert sorted(stranded) == ["a", "b"] and shell.leases == 0 and _used(shell) == 0
    for send in sends:  # a late report of an aborted batch changes nothing
        shell.completed(_report(send, shell), t)
        assert shell.abort(send.batch, t) == []
    assert _used(shell) == 0


def test_a_report_that_never_comes_expires_after_its_requests_ended() -> None:
    from sched_core.driver import REPORT_GRACE_S

    shell = _shell()
    sends, t = _dispatched(shell, ["a"])
    assert shell.expire(t + 60) == [] and _used(shell) == 1  # the request still waits: the lease holds
    shell.request_ended("a", t + 60)
    assert shell.expire(t + 60 + REPORT_GRACE_S - 0.01) == [] and _used(shell) == 1
    assert shell.expire(t + 60 + REPORT_GRACE_S) == [] and _used(shell) == 0 and shell.leases == 0


def test_every_lease_ends_at_the_latest_after_lease_s_failing_what_still_waits() -> None:
    shell = _shell(lease_s=30.0)
    sends, t = _dispatched(shell, ["a", "b"])
    assert sorted(shell.expire(t + 31)) == ["a", "b"] and _used(shell) == 0


def test_a_reported_batch_ends_its_lease_once() -> None:
    shell = _shell()
    sends, t = _dispatched(shell, ["a"])
    shell.completed(_report(sends[0], shell), t + 1)
    assert shell.leases == 0 and _used(shell) == 0
    shell.request_ended("a", t + 1)
    assert shell.expire(t + 1000) == [] and _used(shell) == 0


def test_losing_everything_in_flight_frees_every_slot() -> None:
    shell = _shell()
    _sends, t = _dispatched(shell, ["a", "b", "c"])
    shell.request_ended("c", t)
    assert sorted(shell.abort_all(t)) == ["a", "b"] and _used(shell) == 0 and shell.leases == 0


def _profiled(wid: str, slots: int, prefill_token: float, fingerprint: str) -> p.Heartbeat:
    model = {"decode_launch": 0.01, "decode_seq": 1e-3, "kv_token": 1e-6, "prefill_launch": 0.02,
             "prefill_token": prefill_token, "max_batch": slots, "step_tokens": 64}
    return replace(_hb(wid, "cpu", slots), profile={"fingerprint": fingerprint, "step_model": model})


def test_the_workers_measured_profiles_seed_their_pools_step_model() -> None:
    shell = _shell()
    packaged = shell.snapshot()["paths"]["cpu"]["step_model"]  # type: ignore[index]
    assert shell.snapshot()["priors"] == {"cpu": "packaged profile", "gpu": "packaged profile"}
    # two workers, 8 and 24 slots: the prior is their slot-weighted mean
    workers = {"a": _profiled("a", 8, 1e-3, "fa"), "b": _profiled("b", 24, 3e-3, "fb")}
    shell.capacity(workers, now=1.0)
    snap = shell.snapshot()
    model = snap["paths"]["cpu"]["step_model"]  # type: ignore[index]
    assert model["prefill_token"] == pytest.approx((8 * 1e-3 + 24 * 3e-3) / 32)
    assert model["decode_launch"] == pytest.approx(0.01) != packaged["decode_launch"]
    assert snap["priors"] == {"cpu": "a=fa b=fb", "gpu": "packaged profile"}
    # the same profiles again change nothing; a worker gone re-seeds from the one left
    shell.capacity(workers, now=2.0)
    shell.capacity({"b": workers["b"]}, now=3.0)
    assert shell.snapshot()["paths"]["cpu"]["step_model"]["prefill_token"] == pytest.approx(3e-3)  # type: ignore[index]


def test_an_unreadable_profile_keeps_the_prior_it_has() -> None:
    shell = _shell()
    before = shell.snapshot()["paths"]["cpu"]["step_model"]  # type: ignore[index]
    bad = replace(_hb("a", "cpu", 8), profile={"fingerprint": "x", "step_model": {"prefill_token": "fast"}})
    shell.capacity({"a": bad}, now=1.0)
    assert shell.snapshot()["paths"]["cpu"]["step_model"] == before  # type: ignore[index]


def test_baseline_policies_take_no_prior() -> None:
    shell = _shell(policy="fcfs")
    shell.capacity({"a": _profiled("a", 8, 1e-3, "fa")}, now=1.0)
    assert shell.snapshot()["priors"]["cpu"] == "packaged profile"  # type: ignore[index]


def test_the_backlog_counts_queued_work_for_the_pool_it_would_go_to() -> None:
    """Queued (not yet ticked) work counts for the cpu pool that would run it now, and, by the
    cost lines' crossover, for the gpu pool that has no worker: the demand that scales it up
    from zero. With no worker at all it counts where the scheduler would prefer it. Dispatched
    work is no longer backlog."""
    shell = SchedulerShell("gw1", "tg:replies:gw1")
    shell.capacity({}, now=0.0)
    assert shell.backlog() == {"cpu": (0, 0), "gpu": (0, 0)}
    for i in range(64):
        shell.arrive(_seq(f"long{i}", n=3000, max_tokens=64), WHO, now=0.0)
    backlog = shell.backlog()
    assert backlog["cpu"] == (0, 0) and backlog["gpu"][0] == 64 and backlog["gpu"][1] >= 64 * 3000
    shell.capacity({"w": _hb("w", "cpu", 128)}, now=0.0)
    assert shell.backlog() == {"cpu": backlog["gpu"], "gpu": backlog["gpu"]}
    shell.capacity({"w": _hb("w", "cpu", 128), "g": _hb("g", "gpu", 8)}, now=0.0)
    assert shell.backlog() == {"cpu": (0, 0), "gpu": backlog["gpu"]}  # the gpu pool, staffed, takes it
    t = 0.0
    for _ in range(10_000):  # each dispatched request finishes at once: the queue drains
        if not len(shell):
            break
        t += 0.05
        for send in shell.tick(t)[0]:
            for s in send.job.seqs:
                shell.finished(s.rid, 64, t)
    assert shell.backlog() == {"cpu": (0, 0), "gpu": (0, 0)}


def test_a_baseline_counts_its_queue_for_the_pool_it_fills_first() -> None:
    shell = SchedulerShell("gw1", "tg:replies:gw1", policy="fcfs")
    shell.capacity({"w": _hb("w", "cpu", 1)}, now=0.0)
    for i in range(3):
        shell.arrive(_seq(f"r{i}", n=10, max_tokens=5), WHO, now=0.0)
    # fcfs fills gpu first: with no gpu worker the queue goes to cpu, and is gpu demand too
    assert shell.backlog() == {"cpu": (3, 45), "gpu": (3, 45)}


# -- one scheduler for several gateways (docs/scheduling.md §15) ------------------------------


def _forwarded_batch(shell: SchedulerShell) -> tuple[list, float]:
    """One batch mixing this gateway's request "own" with two forwarded from gw2 and gw3."""
    shell.capacity({}, now=0.0)  # held until all three are queued: one batch
    assert isinstance(shell.arrive(_seq("own"), WHO, now=0.0), Contract)
    assert isinstance(shell.arrive(_seq("f2"), WHO, now=0.0, forwarded=("tg:replies:gw2", "1-0")), Contract)
    assert isinstance(shell.arrive(_seq("f3"), WHO, now=0.0, forwarded=("tg:replies:gw3", "2-0")), Contract)
    shell.capacity({"w": _hb("w", "cpu", 8)}, now=0.01)
    t, sends = 0.01, []
    while len(shell):
        t += 0.05
        sends += shell.tick(t)[0]
    return sends, t


def test_a_batch_goes_out_as_one_job_per_gateway_its_requests_came_from() -> None:
    shell = _shell()
    sends, _ = _forwarded_batch(shell)
    by_stream = {send.job.reply_to: send for send in sends}
    assert set(by_stream) == {"tg:replies:gw1", "tg:replies:gw2", "tg:replies:gw3"}
    assert [s.rid for s in by_stream["tg:replies:gw2"].job.seqs] == ["f2"]
    assert by_stream["tg:replies:gw2"].acks == ("1-0",) and by_stream["tg:replies:gw3"].acks == ("2-0",)
    assert by_stream["tg:replies:gw1"].acks == ()  # this gateway's own request has no arrival entry
    assert len({send.batch for send in sends}) == 1 and len({send.job.batch_id for send in sends}) == 3


def test_a_split_batch_ends_when_its_last_job_reports() -> None:
    shell = _shell()
    sends, t = _forwarded_batch(shell)
    assert shell.leases == 1 and _used(shell) == 3
    for i, send in enumerate(sends):
        shell.completed(_report(send, shell), t + i)
        assert _used(shell) == 2 - i  # each job's requests give their slots back as it reports
    assert shell.leases == 0


def test_a_gone_gateway_s_queued_requests_leave_and_its_jobs_give_their_slots_back() -> None:
    shell = _shell()
    sends, t = _forwarded_batch(shell)
    shell.capacity({}, now=t)
    assert isinstance(shell.arrive(_seq("late"), WHO, now=t, forwarded=("tg:replies:gw2", "3-0")), Contract)
    assert shell.origin_gone("tg:replies:gw2", t) == ["3-0"]  # its queued arrival, to acknowledge
    assert len(shell) == 0 and _used(shell) == 2  # f2's slot came back; own and f3 still run
    shell.capacity({"w": _hb("w", "cpu", 8)}, now=t)
    assert not shell.tick(t + 1)[0]


def test_a_new_scheduler_leaves_the_previous_one_s_sequences_their_slots_until_they_end() -> None:
    shell = _shell()
    busy = {"w": replace(_hb("w", "cpu", 8), running=6)}
    shell.take_over(busy)
    shell.capacity(busy, now=0.0)
    assert shell.driver.free("cpu") == 2
    shell.capacity({"w": replace(_hb("w", "cpu", 8), running=1)}, now=1.0)  # five of them ended
    assert shell.driver.free("cpu") == 7
    shell.capacity({"w": replace(_hb("w", "cpu", 8), running=3)}, now=2.0)  # never grows back
    assert shell.driver.free("cpu") == 7
    shell.capacity({"w": _hb("w", "cpu", 8)}, now=3.0)
    assert shell.driver.free("cpu") == 8


def test_its_own_requests_taken_up_from_the_arrivals_are_acknowledged_when_sent() -> None:
    """A follower that becomes the scheduler takes up the requests it forwarded itself: their
    job answers on its own stream and still acknowledges their arrival entries."""
    shell = _shell()
    assert isinstance(shell.arrive(_seq("mine"), WHO, now=0.0, forwarded=("tg:replies:gw1", "7-0")), Contract)
    t, sends = 0.0, []
    while not sends:
        t += 0.05
        sends = shell.tick(t)[0]
    assert [(s.job.reply_to, s.acks) for s in sends] == [("tg:replies:gw1", ("7-0",))]


# -- a restart on saved state (issue 36) --------------------------------------------------------

# The AMD VM's measured profile, quiet (decode step ~31 ms, ~1.7 ms per prompt token), and the
# same machine measured while the test suite ran beside it: every term 17x slower (525 ms).
QUIET = {"decode_launch": 0.028, "decode_seq": 1e-3, "kv_token": 5e-6, "prefill_launch": 0.03,
         "prefill_token": 1.7e-3, "prefill_attention": 0.0, "max_batch": 32, "step_tokens": 64}
BUSY = {k: (17 * v if k not in ("max_batch", "step_tokens") else v) for k, v in QUIET.items()}
SLO = Origin(tenant="t1", weight=1000.0, slo_ttft_s=2.0)


def _worker(model: dict[str, float], measured_at: float) -> p.Heartbeat:
    """The serve worker, with the profile it measured at ``measured_at`` (same machine, same
    fingerprint: a re-measure is another profile)."""
    profile = {"fingerprint": "0aaef8be1c7d474c", "measured_at": measured_at, "step_model": model}
    return replace(_hb("vm-1", "cpu", 32), engine="transformers", model="SmolLM2-135M-Instruct", profile=profile)


def _served(shell: SchedulerShell, rid: str, prompt: int, now: float, ttft: float, total: float) -> object:
    """A request admitted at ``now`` (SLO or not), run, and ended after ``ttft``/``total``."""
    decision = shell.arrive(_seq(rid, n=prompt, max_tokens=16), WHO, now=now)
    if not isinstance(decision, Contract):
        return decision
    t = now
    while len(shell):
        t += 0.002
        shell.tick(t)
    shell.finished(rid, 16, now + total)
    shell.outcome(rid, ttft, total, 16, now + total)
    return decision


def _steps(model: dict[str, float], n: int) -> p.Telemetry:
    """A worker's decode steps of one sequence at the speed ``model`` says."""
    step = p.StepRecord(0, 1, 200, 1000 * (model["decode_launch"] + model["decode_seq"] + 200 * model["kv_token"]))
    return p.Telemetry("vm-1", "cpu", 32, 31, 1, 0, 64, (step,) * n)


def _busy_run() -> dict[str, object]:
    """`make run` while the machine is busy: the worker measured BUSY, the machine's speed
    came and went (some requests took the quiet time, most the busy one give or take half, a
    few were stuck behind the neighbours 8x longer), and the gateway saved what it learnt on
    Ctrl-C."""
    rng = random.Random(1)
    shell = _shell()
    shell.capacity({"vm-1": _worker(BUSY, 1000.0)}, now=0.0)
    shell.telemetry(_steps(BUSY, 32), 0.0)
    busy_ttft = BUSY["prefill_launch"] + 300 * BUSY["prefill_token"]
    for i in range(300):
        stretch = 8.0 if i % 40 == 0 else 1 / 17 if i % 3 == 0 else rng.lognormvariate(0.0, 0.5)
        _served(shell, f"b{i}", 300, 100.0 * i, busy_ttft * stretch, busy_ttft * stretch * 2)
    state = shell.model_state()
    assert state is not None
    return state


def test_a_restart_on_a_busy_run_s_saved_state_refuses_nothing_an_idle_worker_serves() -> None:
    """Issue 36: `make run` on a busy machine, Ctrl-C, `make run` on a quiet one. The worker
    measures itself again (17x faster); the saved calibration was learnt against the busy
    profile and would bound a 300-token prompt's first token at many seconds, refusing every
    request with the default 2 s SLO. It belongs to the other profile: it is dropped."""
    state = _busy_run()
    restarted = _shell()
    restarted.load_model_state(state)
    notes = restarted.capacity({"vm-1": _worker(QUIET, 2000.0)}, now=0.0)
    assert any("learnt on other workers or profiles" in note for note in notes), notes
    assert restarted.snapshot()["saved_state"] == {"cpu": "dropped: learnt on other workers or profiles",
                                                   "outputs": "restored"}
    restarted.telemetry(_steps(QUIET, 17), 0.0)  # the worker's warm-up
    quiet_ttft = QUIET["prefill_launch"] + 300 * QUIET["prefill_token"]
    for i in range(20):
        c = restarted.arrive(_seq(f"q{i}", n=300, max_tokens=16), SLO, now=10.0 * i)
        assert isinstance(c, Contract), c
        assert c.ttft_p99_s <= 3.0 * c.ttft_s + 1e-9 and c.ttft_p99_s < 2.0
        assert c.ttft_s == pytest.approx(quiet_ttft, rel=0.5)
        restarted.cancel(f"q{i}", 10.0 * i)
        restarted.outcome(f"q{i}", None, None, 0, 10.0 * i)


def test_a_restart_on_the_same_profile_restores_the_saved_state_and_checks_it() -> None:
    """The same profile, reused (its re-check passed): the saved model and calibration are
    restored, and the idle worker still serves an SLO request its bound would have refused;
    its first outcomes re-anchor the calibration they contradict, level and spread."""
    state = _busy_run()
    restarted = _shell()
    restarted.load_model_state(state)
    notes = restarted.capacity({"vm-1": _worker(BUSY, 1000.0)}, now=0.0)
    assert restarted.snapshot()["saved_state"]["cpu"] == "restored" and notes
    restarted.telemetry(_steps(QUIET, 17), 0.0)  # ...but the machine runs quietly now
    c = restarted.arrive(_seq("first", n=300, max_tokens=16), SLO, now=0.0)
    assert isinstance(c, Contract)  # an idle worker's step model serves it within 2 s
    restarted.cancel("first", 0.0)
    restarted.outcome("first", None, None, 0, 0.0)
    quiet_ttft = QUIET["prefill_launch"] + 300 * QUIET["prefill_token"]
    for i in range(CHECK_OUTCOMES):  # the busy run's tail (8x, 1/17x) is gone once they checked it
        _served(restarted, f"q{i}", 300, 10.0 * i, quiet_ttft * (1 + 0.05 * (i % 5)), 2 * quiet_ttft)
    c = restarted.arrive(_seq("later", n=300, max_tokens=16), WHO, now=10.0 * CHECK_OUTCOMES)
    assert isinstance(c, Contract)
    assert c.ttft_s == pytest.approx(quiet_ttft, rel=0.5) and c.ttft_p99_s < 4 * quiet_ttft


def test_a_state_saved_by_another_engine_or_an_older_release_is_not_restored() -> None:
    state = _busy_run()
    echo = _shell()
    echo.load_model_state(state)
    echo.capacity({"w": replace(_hb("w", "cpu", 8), engine="echo")}, now=0.0)  # no profile: its engine
    assert echo.snapshot()["saved_state"] == {"cpu": "dropped: learnt on other workers or profiles",
                                              "outputs": "dropped: learnt on other engines or models"}
    assert echo.driver.contracts.state() == {"ratios": [], "outputs": []}
    old = _shell()
    old.load_model_state({"step_model": state["step_model"], "contracts": state["contracts"]})
    old.capacity({"vm-1": _worker(BUSY, 1000.0)}, now=0.0)
    assert old.driver.contracts.state() == {"ratios": [], "outputs": []}
    assert old.snapshot()["saved_state"]["cpu"] == "dropped: saved by an older release"


def test_a_machine_that_slows_down_is_followed_once_not_twice() -> None:
    """Another program takes the CPU: every step takes 3x as long. The step-time model sees it
    in the steps and re-anchors; the calibration sees it in the outcomes of requests promised
    before. Each alone would follow it; the promises must move 3x, not 9x, and come back."""
    shell = _shell()
    shell.capacity({"vm-1": _worker(QUIET, 1000.0)}, now=0.0)
    quiet_ttft = QUIET["prefill_launch"] + 300 * QUIET["prefill_token"]
    t = 0.0
    for i in range(150):  # the quiet machine, learnt (outcomes within 10 % of the model)
        t += 2.0
        shell.telemetry(_steps(QUIET, 4), t)
        jitter = 1.0 + 0.05 * (i % 5 - 2)
        _served(shell, f"q{i}", 300, t, quiet_ttft * jitter, 2 * quiet_ttft * jitter)
    before = shell.arrive(_seq("before", n=300, max_tokens=16), WHO, now=t)
    assert isinstance(before, Contract) and before.ttft_s == pytest.approx(quiet_ttft, rel=0.3)
    shell.cancel("before", t)
    shell.outcome("before", None, None, 0, t)
    slow = {k: (3 * v if k not in ("max_batch", "step_tokens") else v) for k, v in QUIET.items()}
    # twenty requests queued or running when it starts: promised quiet, they end 3x late
    promised = {}
    for i in range(20):
        c = promised[f"f{i}"] = shell.arrive(_seq(f"f{i}", n=300, max_tokens=16), WHO, now=t)
        assert isinstance(c, Contract)
    shell.telemetry(_steps(slow, 20), t)
    start = t
    while True:
        sends, _ = shell.tick(t)
        running = [s.rid for send in sends for s in send.job.seqs]
        if not running:
            break
        for rid in running:
            c = promised[rid]
            t = max(t, start + 3 * c.total_s)
            shell.finished(rid, 16, t)
            jitter = 1.0 + 0.05 * (int(rid[1:]) % 5 - 2)
            shell.outcome(rid, 3 * c.ttft_s * jitter, 3 * c.total_s * jitter, 16, t)
    at_once = shell.arrive(_seq("at once", n=300, max_tokens=16), WHO, now=t)  # the in-flight ones learnt
    assert isinstance(at_once, Contract) and at_once.ttft_s == pytest.approx(3 * before.ttft_s, rel=0.3)
    shell.cancel("at once", t)
    shell.outcome("at once", None, None, 0, t)
    for i in range(60):  # and later ones
        t += 2.0
        shell.telemetry(_steps(slow, 4), t)
        jitter = 1.0 + 0.05 * (i % 5 - 2)
        _served(shell, f"s{i}", 300, t, 3 * quiet_ttft * jitter, 6 * quiet_ttft * jitter)
    during = shell.arrive(_seq("during", n=300, max_tokens=16), WHO, now=t)
    assert isinstance(during, Contract)
    assert during.ttft_s == pytest.approx(3 * before.ttft_s, rel=0.3)
    assert during.ttft_p99_s < 3.5 * during.ttft_s
    shell.cancel("during", t)
    shell.outcome("during", None, None, 0, t)
    for i in range(60):  # the other program left
        t += 2.0
        shell.telemetry(_steps(QUIET, 4), t)
        jitter = 1.0 + 0.05 * (i % 5 - 2)
        _served(shell, f"b{i}", 300, t, quiet_ttft * jitter, 2 * quiet_ttft * jitter)
    after = shell.arrive(_seq("after", n=300, max_tokens=16), WHO, now=t)
    assert isinstance(after, Contract) and after.ttft_s == pytest.approx(before.ttft_s, rel=0.3)


def test_the_requests_in_flight_when_a_worker_gives_up_a_thread_teach_nothing() -> None:
    """A neighbour starts: the steps in flight stall for seconds before the worker gives up a
    thread. Those requests end 20x late; they are the change's, not the path's: the next
    promises keep their bounds, however many of them there were."""
    shell = _shell()
    hb = replace(_worker(QUIET, 1000.0), threads=2)
    shell.capacity({"vm-1": hb}, now=0.0)
    quiet_ttft = QUIET["prefill_launch"] + 300 * QUIET["prefill_token"]
    t = 0.0
    for i in range(120):
        t += 2.0
        jitter = 1.0 + 0.05 * (i % 5 - 2)
        _served(shell, f"q{i}", 300, t, quiet_ttft * jitter, 2 * quiet_ttft * jitter)
    before = shell.arrive(_seq("before", n=300, max_tokens=16), WHO, now=t)
    assert isinstance(before, Contract)
    shell.cancel("before", t)
    shell.outcome("before", None, None, 0, t)
    stalled = [f"s{i}" for i in range(6)]
    for rid in stalled:
        assert isinstance(shell.arrive(_seq(rid, n=300, max_tokens=16), WHO, now=t), Contract)
    while len(shell):
        t += 0.002
        shell.tick(t)
    shell.capacity({"vm-1": replace(hb, threads=1)}, now=t + 1.0)  # its heartbeat: one thread now
    for rid in stalled:
        t += 0.5
        shell.finished(rid, 16, t)
        shell.outcome(rid, 20 * quiet_ttft, 21 * quiet_ttft, 16, t)
    after = shell.arrive(_seq("after", n=300, max_tokens=16), WHO, now=t)
    assert isinstance(after, Contract)
    assert after.ttft_s == pytest.approx(before.ttft_s, rel=0.05)
    assert after.ttft_p99_s == pytest.approx(before.ttft_p99_s, rel=0.05)
