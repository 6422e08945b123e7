"""tick(): which path, release without holds for company, the TPOT hold, work conservation,
the tail cut, deadlines."""

from __future__ import annotations

import math

import pytest

from sched_core import Contract, Dispatch, PathConfig, Reject
from sched_core.types import HOLD_SLACK, LN100, RESCUE_AFTER

from .conftest import Factory
from .support import batch_line, req, timings


def dispatches(decisions: list[Dispatch | Reject]) -> list[Dispatch]:
    assert all(isinstance(d, Dispatch) for d in decisions)
    return decisions  # type: ignore[return-value]


def test_nothing_leaves_without_capacity(make: Factory) -> None:
    s = make()
    s.arrive(req("a"), 0.0)
    assert s.tick(1.0) == []
    s.worker_capacity("gpu", 4, 1.0)
    (d,) = dispatches(s.tick(1.0))
    assert d.path == "gpu" and d.request_ids == ("a",)


def test_single_path_deployment_takes_everything(make: Factory) -> None:
    s = make()
    s.worker_capacity("cpu", 4, 0.0)
    for i in range(6):
        s.arrive(req(f"r{i}", prompt=3000), 0.0)
    out = dispatches(s.tick(0.0))
    assert [d.path for d in out] == ["cpu"] and len(out[0].request_ids) == 4
    assert s.tick(0.0) == []  # the cpu path is full until its batch completes
    s.completed(timings(out[0]), 1.0)
    assert len(dispatches(s.tick(1.0))[0].request_ids) == 2


# A cpu that starts steps quickly but decodes each sequence slowly, beside a gpu with a
# costly launch: their batch lines cross between two and three requests.
QUICK_CPU = PathConfig(0.002, 0.004, 0.0, 0.002, 0.0, max_batch=32, step_tokens=128)
LAUNCH_GPU = PathConfig(0.01, 0.0002, 0.0, 0.01, 0.0, max_batch=64, step_tokens=512)


@pytest.mark.parametrize("n", [1, 2, 3, 10])
def test_small_batches_go_to_cpu_large_ones_to_gpu(make: Factory, n: int) -> None:
    s = make(cpu=QUICK_CPU, gpu=LAUNCH_GPU)
    s.worker_capacity("cpu", 32, 0.0)
    s.worker_capacity("gpu", 64, 0.0)
    for i in range(n):
        s.arrive(req(f"r{i}", prompt=100, out=10), 0.0)
    # Idle paths (prompts prefill in one pass), bucket of 128 tokens, 10 output tokens:
    # cpu F = 0.002 + 10·0.002 = 0.022, m = 10·0.004 = 0.040;
    # gpu F = 0.01 + 10·0.01 = 0.11, m = 10·0.0002 = 0.002.
    (f_cpu, m_cpu), (f_gpu, m_gpu) = batch_line(QUICK_CPU, 128, 10), batch_line(LAUNCH_GPU, 128, 10)
    b1 = (f_gpu - f_cpu) / (m_cpu - m_gpu)
    assert b1 == pytest.approx(0.088 / 0.038)
    assert s.snapshot()["buckets"][1]["b1"] == pytest.approx(b1)
    (d,) = dispatches(s.tick(0.0))
    assert (d.path, len(d.request_ids)) == ("cpu" if n < b1 else "gpu", n)


def test_batches_hold_one_bucket_and_respect_limits(make: Factory) -> None:
    s = make(prefill_queue_steps=math.inf)  # no prefill-queue gate (tested on its own below)
    s.worker_capacity("gpu", 100, 0.0)
    for i in range(70):
        s.arrive(req(f"s{i}", prompt=100), 0.0)
        s.arrive(req(f"l{i}", prompt=5000), 0.0)
    out = dispatches(s.tick(0.0))
    assert sum(len(d.request_ids) for d in out) == 100
    for d in out:
        assert len(d.request_ids) <= 64
        assert all(rid[0] == ("s" if d.bucket == 1 else "l") for rid in d.request_ids)
    assert s.snapshot()["paths"]["gpu"]["in_flight"] == 100


def test_a_lone_request_on_an_idle_path_leaves_at_the_first_tick(make: Factory) -> None:
    s = make()
    s.worker_capacity("gpu", 64, 0.0)
    s.arrive(req("alone"), 0.0)
    (d,) = dispatches(s.tick(0.0))
    assert (d.path, d.request_ids) == ("gpu", ("alone",))


def test_requests_are_never_held_for_company(make: Factory) -> None:
    s = make(rate_window_s=0.1)
    s.worker_capacity("gpu", 64, 0.0)
    sizes = []
    for i in range(60):
        now = i * 0.001
        s.arrive(req(f"r{i}", arrival=now), now)
        sizes += [len(d.request_ids) for d in dispatches(s.tick(now))]
        assert s.queued == 0
    # A burst at 1000 requests/s with free gpu slots: each request leaves on its own tick
    # (the running sequences' 10 ms steps stay far inside the 100 ms per-token SLO).
    assert sizes == [1] * 60


# A gpu whose step costs 50 ms plus 10 ms per sequence: up to five sequences meet the
# 100 ms per-token SLO; chunked prefill steps cost a further 50 ms.
TPOT_GPU = PathConfig(0.05, 0.01, 0.0, 0.05, 0.0, max_batch=64, step_tokens=512)


def four_running(make: Factory, **fields: object) -> object:
    """A gpu-only scheduler with four sequences running and ``late`` queued at 0.1; a TPOT
    SLO of 95 ms, which four running meet (0.09 s steps) and five do not (0.10 s)."""
    s = make(gpu=TPOT_GPU, tpot_slo_s=0.095, ttft_p99_slo_s=2.0, **fields)
    s.worker_capacity("gpu", 8, 0.0)
    for i in range(4):
        s.arrive(req(f"run{i}", prompt=100, out=32), 0.0)
    (d,) = dispatches(s.tick(0.0))  # nothing ran yet: never held
    assert len(d.request_ids) == 4
    s.arrive(req("late", prompt=100, out=32, arrival=0.1), 0.1)
    return s


def test_batch_is_held_while_it_would_break_the_running_tpot_then_leaves(make: Factory) -> None:
    s = four_running(make)
    # Four running: steps of 0.05 + 4·0.01 = 0.09 s meet the SLO. With late decoding
    # beside them, steps of 0.05 + 5·0.01 = 0.10 s would not: held, though three slots
    # are free.
    assert s.tick(0.1) == []  # type: ignore[attr-defined]
    assert s.snapshot()["paths"]["gpu"]["step_s"] == pytest.approx(0.09)  # type: ignore[attr-defined]
    reason = s.explain("late")["reason"]  # type: ignore[attr-defined]
    assert reason.startswith("held") and "95 ms per-token SLO" in reason
    # One finishes: three running, and with late four, 0.09 s steps: late leaves now.
    assert s.finished("run0", 32, 0.2) is True  # type: ignore[attr-defined]
    (d,) = dispatches(s.tick(0.2))  # type: ignore[attr-defined]
    assert (d.path, d.request_ids) == ("gpu", ("late",))


def test_held_batch_leaves_once_its_ttft_slack_is_gone(make: Factory) -> None:
    s = four_running(make)
    # Held while its wait, the prefill of the 400 prompt tokens sent before it (no step
    # record says they are done: one step of 0.14 s) and its own 0.14 s prefill stay under
    # HOLD_SLACK (half) of the 2 s TTFT SLO: until 0.1 + 1.0 − 0.28 = 0.82.
    assert HOLD_SLACK == 0.5
    assert s.tick(0.81) == []  # type: ignore[attr-defined]
    (d,) = dispatches(s.tick(0.83))  # type: ignore[attr-defined]
    assert (d.path, d.request_ids) == ("gpu", ("late",))


def test_no_hold_when_the_running_sequences_already_miss_the_slo(make: Factory) -> None:
    s = make(gpu=TPOT_GPU, tpot_slo_s=0.1)
    s.worker_capacity("gpu", 8, 0.0)
    for i in range(6):
        s.arrive(req(f"run{i}", prompt=100, out=32), 0.0)
    dispatches(s.tick(0.0))
    # Six running: 0.05 + 6·0.01 = 0.11 s per token already; holding would not help them.
    s.arrive(req("late", prompt=100, out=32, arrival=0.1), 0.1)
    (d,) = dispatches(s.tick(0.1))
    assert d.request_ids == ("late",)


@pytest.mark.parametrize(("cpu_launch", "path"), [(0.11, "cpu"), (0.3, None)])
def test_held_batch_goes_to_the_other_path_if_it_finishes_there_no_later(
        make: Factory, cpu_launch: float, path: str | None) -> None:
    cpu = PathConfig(cpu_launch, 0.0, 0.0, cpu_launch, 0.0, max_batch=32, step_tokens=128)
    s = four_running(make, cpu=cpu)
    s.worker_capacity("cpu", 8, 0.1)  # type: ignore[attr-defined]
    # gpu beside its four (one 512-token budget chunk less 4): F = 0.14 + 32·0.09 = 3.02,
    # m = 128·0.14/508 + 32·0.01, and its running batch ends 0.05 + 32·0.09 = 2.93 s after
    # 0 (2.83 s from now); idle cpu: F = launch·33, m = launch.
    (f_gpu, m_gpu), (f_cpu, m_cpu) = batch_line(TPOT_GPU, 128, 32, 4), batch_line(cpu, 128, 32)
    assert f_gpu == pytest.approx(3.02) and f_cpu == pytest.approx(33 * cpu_launch)
    assert f_cpu + m_cpu > f_gpu + m_gpu  # the gpu is the target, and it holds late
    leaves_on_cpu = f_cpu + m_cpu <= 2.83 + f_gpu + m_gpu
    assert leaves_on_cpu == (path == "cpu")
    out = dispatches(s.tick(0.1))  # type: ignore[attr-defined]
    assert [(d.path, d.request_ids) for d in out] == ([(path, ("late",))] if path else [])


def test_work_conservation_uses_cpu_when_gpu_is_busy_for_long(make: Factory) -> None:
    s = make()
    s.worker_capacity("cpu", 8, 0.0)
    s.worker_capacity("gpu", 2, 0.0)
    s.arrive(req("g1", prompt=8000, out=200, max_tokens=200), 0.0)
    s.arrive(req("g2", prompt=8000, out=200, max_tokens=200), 0.0)
    (busy,) = dispatches(s.tick(0.0))
    assert busy.path == "gpu" and busy.predicted_s > 1.0
    for rid in "abc":
        s.arrive(req(rid, prompt=100, out=8), 0.0)
    # With the default priors the gpu finishes a batch of any size sooner (B1 = 0) ...
    assert s.explain("a")["path"] == "gpu"  # type: ignore[index]
    # ... but the gpu is busy for longer than the cpu needs for them.
    (d,) = dispatches(s.tick(0.01))
    assert d.path == "cpu" and set(d.request_ids) == {"a", "b", "c"}


@pytest.mark.parametrize(("cpu_step", "path"), [(0.05, "cpu"), (0.15, None)])
def test_a_full_gpu_overflows_to_a_cpu_that_keeps_the_slo_though_it_finishes_later(
        make: Factory, cpu_step: float, path: str | None) -> None:
    # a gpu full past its predicted end (its batch runs longer than priced: the wait for its
    # next slot is unknown) and a cpu that decodes 5-15x slower: the cpu finishes a 200-token
    # answer later than the gpu would once free, so it takes the request only to keep its
    # SLO: its first token within 1 s and, at cpu_step a token, within the 0.1 s TPOT SLO
    cpu = PathConfig(cpu_step, 0.0, 0.0, 0.004, 4e-5, max_batch=8, step_tokens=1024)
    gpu = PathConfig(0.01, 0.0, 0.0, 0.01, 1e-5, max_batch=8, step_tokens=1024)
    s = make(cpu=cpu, gpu=gpu, ttft_p99_slo_s=1.0, tpot_slo_s=0.1)
    s.worker_capacity("cpu", 8, 0.0)
    s.worker_capacity("gpu", 1, 0.0)
    s.arrive(req("g1", prompt=100, out=10), 0.0)
    (busy,) = dispatches(s.tick(0.0))
    assert busy.path == "gpu"
    now = busy.predicted_s + 0.5  # still running
    s.arrive(req("a", prompt=100, out=200, arrival=now), now)
    out = dispatches(s.tick(now))
    assert [(d.path, d.request_ids) for d in out] == ([(path, ("a",))] if path else [])


def test_busy_gpu_is_awaited_when_it_frees_soon(make: Factory) -> None:
    s = make(ttft_p99_slo_s=100.0)
    s.worker_capacity("cpu", 8, 0.0)
    s.worker_capacity("gpu", 2, 0.0)
    s.arrive(req("g1", prompt=8000, out=1), 0.0)
    s.arrive(req("g2", prompt=8000, out=1), 0.0)
    (busy,) = dispatches(s.tick(0.0))
    s.arrive(req("a", prompt=8000, out=1), 0.0)
    s.arrive(req("b", prompt=8000, out=1), 0.0)
    assert s.tick(busy.predicted_s) == []  # the cpu would take far longer than the gpu
    s.completed(timings(busy, outputs=(1, 1), prompt=8000), busy.predicted_s)
    (d,) = dispatches(s.tick(busy.predicted_s))
    assert d.path == "gpu" and set(d.request_ids) == {"a", "b"}


def test_tail_cut_sends_overdue_requests_to_cpu(make: Factory) -> None:
    # a cpu fast enough to honour the SLO (the measured one of this machine is not)
    s = make(cpu=PathConfig(0.006, 0.0015, 0.0, 0.004, 4e-5, max_batch=8, step_tokens=1024))
    s.worker_capacity("cpu", 64, 0.0, workers=4)  # fast enough in all to honour the SLO
    s.worker_capacity("gpu", 2, 0.0)
    s.arrive(req("g1", prompt=1000, out=1), 0.0)
    s.arrive(req("g2", prompt=1000, out=1), 0.0)
    dispatches(s.tick(0.0))
    s.arrive(req("a", prompt=1000, out=1, arrival=0.5, budget_wait=0.25), 0.75)
    s.arrive(req("b", prompt=1000, out=1, arrival=0.5, budget_wait=0.25), 0.75)
    snap = s.snapshot()["tail_cut"]
    t_cut = snap["t_cut_s"]
    assert t_cut is not None and 0.0 < t_cut < snap["ttft_p99_slo_s"]
    assert math.isclose(t_cut, 2.0 - LN100 / (snap["mu_cpu"] - snap["lambda_cpu"]))
    # The gpu is full, and the cpu would finish them later than the gpu once it frees up;
    # the scheduler's own wait starts after the budget wait: due at 0.75 + T_cut.
    assert s.tick(0.75 + t_cut - 1e-3) == []
    (d,) = dispatches(s.tick(0.75 + t_cut + 1e-3))
    assert d.path == "cpu" and sorted(d.request_ids) == ["a", "b"]


def test_without_a_gpu_path_there_is_no_tail_cut_and_the_order_holds_for_old_requests(make: Factory) -> None:
    """On a cpu-only deployment the cut would hand the oldest requests to the same workers
    in arrival order; instead the order (shortest prompt, with aging) decides."""
    s = make(cpu=PathConfig(0.006, 0.0015, 0.0, 0.004, 4e-5, max_batch=8, step_tokens=1024))
    s.worker_capacity("cpu", 1, 0.0)
    s.arrive(req("first", out=1), 0.0)
    dispatches(s.tick(0.0))
    s.arrive(req("long", prompt=1000, out=1), 0.0)
    s.arrive(req("short", prompt=10, out=1, arrival=0.5), 0.5)
    t_cut = s.snapshot()["tail_cut"]["t_cut_s"]
    assert t_cut is not None and t_cut < 4.0  # both are overdue at 5 s
    assert s.tick(5.0) == []  # the only slot is busy
    s.finished("first", 1, 5.0)
    (d,) = dispatches(s.tick(5.0))
    assert d.request_ids == ("short",)  # key 10 + 1000·0.5 < 1000 + 0: not the older one


@pytest.mark.parametrize(("now", "first"), [(0.95, "short"), (1.05, "long")])
def test_a_request_late_by_a_share_of_its_slo_goes_first_while_it_can_still_make_it(
        make: Factory, now: float, first: str) -> None:
    """The late go first: once the long prompt has waited RESCUE_AFTER of the 2 s TTFT SLO
    (1 s) and still gets its first token in time if it starts now, it leaves ahead of the
    shorter one the order prefers; before that the order decides (10 + 1000·0.5 < 1000).
    One that can no longer make it is left to the order (the test above, at 5 s)."""
    s = make(cpu=PathConfig(0.006, 0.0015, 0.0, 0.004, 4e-5, max_batch=8, step_tokens=1024))
    assert RESCUE_AFTER * s.config.ttft_p99_slo_s == pytest.approx(1.0)
    s.worker_capacity("cpu", 1, 0.0)
    s.arrive(req("first", out=1), 0.0)
    dispatches(s.tick(0.0))
    s.arrive(req("long", prompt=1000, out=1), 0.0)
    s.arrive(req("short", prompt=10, out=1, arrival=0.5), 0.5)
    s.finished("first", 1, now)
    (d,) = dispatches(s.tick(now))
    assert d.request_ids == (first,)


def test_tail_cut_is_off_when_the_cpu_cannot_honour_the_slo(make: Factory) -> None:
    s = make(ttft_p99_slo_s=0.01)
    s.worker_capacity("cpu", 8, 0.0)
    assert s.snapshot()["tail_cut"]["t_cut_s"] is None
    s.worker_capacity("cpu", 0, 0.0)
    assert make().snapshot()["tail_cut"]["t_cut_s"] is None


def test_queued_request_is_rejected_once_its_deadline_cannot_be_met(make: Factory) -> None:
    s = make()
    c = s.arrive(req("a", deadline=10.0), 0.0)
    assert isinstance(c, Contract) and c.total_s < 10.0
    # It expires as soon as starting now would finish it after the deadline: its own prefill
    # and decode, which is the whole contract where a slot is free and nothing is ahead.
    idle = make()
    idle.worker_capacity("cpu", 8, 0.0)
    alone = idle.arrive(req("a", deadline=10.0), 0.0)
    assert isinstance(alone, Contract) and alone.total_s < c.total_s  # s has no slot: a wait
    due = 10.0 - alone.total_s
    assert s.tick(due - 1e-3) == []
    (r,) = s.tick(due + 1e-3)
    assert isinstance(r, Reject) and r.reason == "deadline"
    assert r.estimate_s == pytest.approx(due + 1e-3 + alone.total_s) and r.estimate_s > 10.0
    assert s.queued == 0 and s.cancel("a", due + 1e-3) is False


def test_capacity_is_validated(make: Factory) -> None:
    s = make()
    with pytest.raises(ValueError):
        s.worker_capacity("tpu", 1, 0.0)
    with pytest.raises(ValueError):
        s.worker_capacity("cpu", -1, 0.0)
    with pytest.raises(ValueError):
        s.worker_capacity("gpu", 4, 0.0, workers=-1)
    with pytest.raises(ValueError):
        s.worker_capacity("gpu", 4, 0.0, step_tokens=-1)


def test_a_busy_path_holds_new_work_while_its_workers_prefill_queue_is_full(make: Factory) -> None:
    """Prompt tokens dispatched and not yet prefilled (per the workers' step records) are
    capped at prefill_queue_steps steps of budget: beyond it work waits in the scheduler."""
    s = make(cpu=QUICK_CPU, tpot_slo_s=10.0, prefill_queue_steps=2.0)  # 2 steps of 128 tokens
    s.worker_capacity("cpu", 32, 0.0)
    for i in range(3):
        s.arrive(req(f"a{i}", prompt=100, out=10), 0.0)
    (d,) = dispatches(s.tick(0.0))  # nothing running: all of it leaves
    assert len(d.request_ids) == 3
    s.arrive(req("b", prompt=100, out=10), 0.1)
    assert s.tick(0.1) == []  # 300 tokens wait for prefill, >= 256
    assert s.snapshot()["paths"]["cpu"]["pending_prefill"] == 300.0
    s.observe_steps("cpu", [(40, 0, 0, 0.05)], 0.2)
    assert s.tick(0.2) == []  # 260 still wait
    s.observe_steps("cpu", [(64, 3, 300, 0.05)], 0.3)
    (e,) = dispatches(s.tick(0.3))  # 196 wait: it leaves
    assert e.request_ids == ("b",)
    assert s.snapshot()["paths"]["cpu"]["pending_prefill"] == 296.0
    for rid in ("a0", "a1", "a2", "b"):
        s.finished(rid, 10, 1.0)
    assert s.snapshot()["paths"]["cpu"]["pending_prefill"] == 0.0  # nothing runs: nothing waits
