"""The console's data: a gateway's counters read from its metrics, and the cluster merged
from the gateways' parts (``gateway.console.status``)."""

from __future__ import annotations

from typing import Any

from common import protocol as p
from gateway.console import status
from gateway.metrics import Metrics
from sched_core.contracts import Accuracy


def _metrics() -> Metrics:
    metrics = Metrics()
    m = metrics.of("m")
    metrics.requests.labels("m", "chat", "200").inc(3)
    metrics.requests.labels("m", "completions", "200").inc(2)
    metrics.requests.labels("m", "completions", "499").inc()
    metrics.requests.labels("m", "chat", "429").inc(4)
    metrics.requests.labels("m", "chat", "503").inc()
    metrics.requests.labels("m", "admin", "200").inc(50)  # not a generation: not counted
    m.admitted.inc(6)
    m.budget_wait.observe(0.2)
    m.budget_wait.observe(0.3)
    m.tokens(100, 40)
    metrics.of("other").tokens(7, 7)  # another model's: not counted as m's
    metrics.requests.labels("other", "chat", "200").inc(9)
    m.observe_contract(Accuracy("cpu", True, 0.1, 0.3, True, 0.2, 0.4))
    m.observe_contract(Accuracy("cpu", False, 0.5, 0.6, None, None, None))  # first token not seen apart
    m.observe_contract(Accuracy("gpu", True, 0.05, 0.1, False, 0.3, 0.5))
    return metrics


def test_a_gateway_s_counters_come_from_its_metrics() -> None:
    c = status.counters(_metrics(), "m")
    assert c["admitted"] == 6 and c["responses"] == {"200": 5, "499": 1, "429": 4, "503": 1}
    assert c["budget_waits"] == 2 and c["tokens"] == {"prompt": 100, "completion": 40}
    cpu, gpu = c["contracts"]["cpu"], c["contracts"]["gpu"]
    assert cpu["total"] == {"inside": 1, "outside": 1, "error_sum": 0.6, "errors": 2}
    assert cpu["ttft"] == {"inside": 1, "outside": 0, "error_sum": 0.2, "errors": 1}  # calibrated errors only
    assert gpu["ttft"]["outside"] == 1 and gpu["total"]["inside"] == 1


def _part(gid: str, role: str, at: float, counters: dict[str, Any], scheduler: dict[str, Any] | None = None
          ) -> dict[str, Any]:
    return {"gateway": gid, "role": role, "at": at, "started": 1, "in_flight": 2, "counters": counters,
            "scheduler": scheduler}


def test_the_cluster_sums_every_gateway_and_shows_the_scheduler_s_queues() -> None:
    one = status.counters(_metrics(), "m")
    other = {"admitted": 1, "responses": {"200": 1, "413": 2}, "budget_waits": 1, "tokens": {"prompt": 5},
             "contracts": {"cpu": {"total": {"inside": 3, "outside": 0, "error_sum": 0.3, "errors": 3}}}}
    parts = [_part("g2", "follower", 99.5, other), _part("g1", "scheduler", 99.0, one, {"queued": 7})]
    view = status.cluster("g2", parts, [], now=100.0)
    assert [g["gateway"] for g in view["gateways"]] == ["g1", "g2"]
    assert view["gateways"][0]["age_s"] == 1.0 and view["gateways"][1]["role"] == "follower"
    assert [(g["at"], g["admitted"], g["refused"], g["budget_waits"]) for g in view["gateways"]] == [
        (99.0, 6, 5, 2), (99.5, 1, 2, 1)]  # each gateway's own, stamped with when it took them
    assert view["scheduler"] == {"gateway": "g1", "queued": 7}
    k = view["counters"]
    assert k["responses"] == {"200": 6, "499": 1, "429": 4, "503": 1, "413": 2}
    assert k["admitted"] == 7 and k["refused"] == 7 and k["budget_waits"] == 3  # 499: its client left
    assert k["contracts"]["cpu"]["total"]["inside"] == 4 and k["tokens"]["prompt"] == 105
    assert status.cluster("g2", [parts[0]], [], now=100.0)["scheduler"] is None  # none schedules now


def test_only_the_lease_holder_shows_as_the_scheduler() -> None:
    """A gateway paused past its lease published "scheduler" before it stopped; its part lives
    on for a while beside the new scheduler's: the view names one scheduler, the holder."""
    parts = [_part("g1", "scheduler", 99.0, {}, {"queued": 7}), _part("g2", "scheduler", 99.8, {}, {"queued": 1})]
    view = status.cluster("g3", parts, [], now=100.0, holder="g2")
    assert [g["role"] for g in view["gateways"]] == ["follower", "scheduler"]
    assert view["scheduler"] == {"gateway": "g2", "queued": 1}
    nobody = status.cluster("g3", parts, [], now=100.0, holder="")  # the lease lapsed, none took it yet
    assert [g["role"] for g in nobody["gateways"]] == ["follower", "follower"] and nobody["scheduler"] is None


def test_where_several_models_share_the_redis_the_view_is_the_answering_gateway_s_model() -> None:
    """Each model is its own scheduling domain, with its own scheduler: the view of a gateway of
    ``a`` lists and sums the gateways of ``a`` only (and takes a part without a model as ``a``'s)."""
    parts = [{**_part("g1", "scheduler", 99.0, {"admitted": 3}, {"queued": 7}), "model": "a"},
             {**_part("g2", "scheduler", 99.0, {"admitted": 5}, {"queued": 2}), "model": "b"},
             _part("g3", "follower", 99.0, {"admitted": 1})]
    view = status.cluster("g3", parts, [], now=100.0, holder="g1", model="a")
    assert view["model"] == "a" and [(g["gateway"], g["model"]) for g in view["gateways"]] == [("g1", "a"), ("g3", "a")]
    assert view["scheduler"] == {"gateway": "g1", "queued": 7} and view["counters"]["admitted"] == 4


def test_the_scheduler_view_leaves_out_what_grows_with_the_tenants() -> None:
    snap = {"queued": 1, "buckets": [], "fairness": {"tenants": {"a": {}, "b": {}}, "min_counter": 0.0},
            "paths": {"cpu": {"capacity": 4, "in_flight": 1, "step_model": {"decode_seq": 1.0}}},
            "policy": {"spec": "smdp", "state": "queue"}, "role": "scheduler", "now": 3.0}
    view = status.scheduler_view(snap)
    assert view == {"queued": 1, "buckets": [], "paths": {"cpu": {"capacity": 4, "in_flight": 1}},
                    "policy": {"spec": "smdp", "state": "queue"}, "tenants_queued": 2}


def test_a_worker_shows_its_device_and_what_it_measured_of_itself() -> None:
    facts = {"cpu": "Xeon", "amx": True, "amx_used": True, "gpu": "", "threads": 8}
    profile = {"facts": facts, "summary": {"prefill_tokens_per_s": 900.0, "decode_step_ms": 12.5}}
    hb = p.Heartbeat("w1", "cpu", "cpu", "bfloat16", "transformers", "m", 8, 5, 30.0, 90.0, running=3,
                     profile=profile)
    w = status.worker_view(hb, beat=99.2, now=100.0)
    assert w["slots"] - w["free"] == 3 and round(w["heartbeat_age_s"], 3) == 0.8 and w["up_s"] == 10.0
    assert (w["cpu"], w["amx_used"], w["threads"]) == ("Xeon", True, 8)
    assert (w["prefill_tokens_per_s"], w["decode_step_ms"]) == (900.0, 12.5)
    bare = status.worker_view(p.Heartbeat("w2", "gpu", "cuda", "float16", "upstream", "m", 4, 4, 0.0, 99.0),
                              beat=None, now=100.0)
    assert bare["heartbeat_age_s"] is None and bare["cpu"] == "" and bare["prefill_tokens_per_s"] is None


def test_a_path_without_slots_or_requests_is_not_shown() -> None:
    """A CPU-only box: the scheduler keeps a gpu path and counts at least one worker on it
    for its arithmetic (``fleet.capacity_share``); the console lists only paths that have
    slots, or that still hold requests (then with no workers)."""
    cpu = {"capacity": 4, "in_flight": 1, "workers": 1, "pending_prefill": 0}
    empty = {"capacity": 0, "in_flight": 0, "workers": 1, "pending_prefill": 0}
    snap = {"paths": {"cpu": cpu, "gpu": empty}, "backlog": {"cpu": {"requests": 2, "tokens": 9},
                                                           "gpu": {"requests": 0, "tokens": 0}}}
    view = status.scheduler_view(snap)
    assert list(view["paths"]) == ["cpu"] and view["paths"]["cpu"]["workers"] == 1
    assert list(view["backlog"]) == ["cpu", "gpu"]  # the pools' queues: each, empty or not
    # the gpu workers went away with a request still on them: shown, with no workers
    gone = {**empty, "in_flight": 1}
    view = status.scheduler_view({"paths": {"cpu": cpu, "gpu": gone}})
    assert view["paths"]["gpu"]["workers"] == 0 and view["paths"]["gpu"]["in_flight"] == 1


def _counters(admitted: int, refused: int = 0, waits: int = 0) -> dict[str, Any]:
    return {"admitted": admitted, "responses": {"200": admitted, "429": refused}, "budget_waits": waits}


def test_a_gateway_keeps_its_recent_traffic_in_its_part() -> None:
    traffic = status.Traffic()
    for t in range(200):
        samples = traffic.add(1000.0 + t, _counters(t, t // 2))
    assert samples[-1] == [1199.0, 199, 99, 0]
    span = samples[-1][0] - samples[0][0]
    assert status.HISTORY_S + status.RATE_S <= span <= status.HISTORY_S + status.RATE_S + 2  # bounded
    part = status.part({"gateway": "g1", "model": "m", "role": "follower"}, _metrics(), 1, 1200.0, traffic)
    assert part["traffic"][-1] == [1200.0, 6, 5, 2]  # the counters it publishes, sampled


def test_the_traffic_chart_shows_the_recent_past_from_the_gateways_samples() -> None:
    """Opened after traffic, the chart is not empty: each point is a rate over the gateways'
    own samples (each gateway's counters compared only with its own), summed."""
    # g1: 2 admissions/s from 1000 to 1060, then nothing; g2: one refusal/s all along
    g1 = [[1000.0 + t, 2 * min(t, 60), 0, 0] for t in range(0, 100)]
    g2 = [[1000.5 + t, 5, t, 0] for t in range(0, 100)]
    view = status.cluster("g1", [_part("g1", "scheduler", 1099.0, {}) | {"traffic": g1},
                                 _part("g2", "follower", 1099.5, {}) | {"traffic": g2}], [], now=1100.0)
    chart = view["counters"]["traffic"]
    assert chart["step_s"] == status.PUBLISH_S and chart["window_s"] == status.RATE_S
    admitted, refused = chart["admitted"], chart["refused"]
    assert len(admitted) == len(refused) == len(chart["budget_waits"]) == status.HISTORY_S
    at = [1100.0 - (status.HISTORY_S - 1 - i) for i in range(status.HISTORY_S)]
    assert admitted[at.index(1030.0)] == 2.0 and refused[at.index(1030.0)] == 1.0
    assert admitted[-1] == 0.0 and refused[-1] == 1.0  # now: only refusals
    assert admitted[at.index(999.0)] is None  # before either gateway published
    assert admitted[at.index(1000.0)] is None  # one sample: no rate yet
    assert 0.0 < admitted[at.index(1063.0)] < 2.0  # the window spans the end of the admissions
    # a gateway that restarted starts its samples again: its old counters are never compared
    restarted = [[1095.0 + t, t, 0, 0] for t in range(5)]
    chart = status.cluster("g1", [_part("g1", "scheduler", 1099.0, {}) | {"traffic": restarted}], [],
                           now=1100.0)["counters"]["traffic"]
    assert chart["admitted"][-1] == 1.0 and chart["admitted"][at.index(1094.0)] is None
    bare = status.cluster("g1", [_part("g1", "follower", 99.0, {})], [], now=100.0)  # an older gateway's part
    assert bare["counters"]["traffic"]["admitted"] == [None] * status.HISTORY_S  # no samples: no points
