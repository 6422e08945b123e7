"""What the operator console shows (docs/operations.md, "The operator console").

Every gateway publishes its own part each ``PUBLISH_S`` under ``wire.console_key`` with a
TTL of ``STALE_S``: its role, its counters since it started (admissions, generation responses by
status, budget waits, tokens, contract outcomes per path) and, on the scheduler, its queues and
policy, and its recent traffic (``Traffic``: its admissions, refusals and budget waits as
they stood at each of its last ``HISTORY_S`` seconds of parts). ``GET /admin/cluster`` on any
gateway merges the live parts with the workers' heartbeats (``cluster``), so the page shows
the cluster, not the replica it talks to, and turns the gateways' recent traffic into the
traffic chart's rates (``traffic``), so the chart shows the last two minutes as soon as the
page opens. Pure: the I/O (publishing, reading) is in ``gateway.http.console``.
"""

from __future__ import annotations

import bisect
from collections import defaultdict, deque
from collections.abc import Iterator
from typing import Any

from prometheus_client.samples import Sample

from common import protocol as p
from gateway.metrics import Metrics

PUBLISH_S = 1.0  # how often each gateway rewrites its part
STALE_S = 3.0  # a part not rewritten for this long is gone (its TTL): the gateway is down
GENERATION_ROUTES = ("chat", "completions")  # ``Instrument``'s labels of the two generation routes
CLIENT_LEFT = "499"  # the status of a request whose client went away: not a refusal
HISTORY_S = 120  # the traffic chart's span: one point per PUBLISH_S (the page's HISTORY)
RATE_S = 5.0  # each point of the traffic chart is a rate over (at least) this window
TRAFFIC = ("admitted", "refused", "budget_waits")  # the traffic chart's series, in a sample's order
# the scheduler's snapshot, less what grows with the tenants (fairness) or only the CLI reads
_SNAPSHOT_KEYS = ("queued", "buckets", "paths", "policy", "placed", "tail_cut", "priors", "saved_state", "backlog")
_PATH_KEYS = ("capacity", "in_flight", "slot_limit", "workers", "max_batch", "kv_tokens", "pending_prefill",
              "step_s", "step_tokens", "fitted_steps", "drift")


def _samples(metric: Any, suffix: str, model: str) -> Iterator[Sample]:
    """A Prometheus metric's samples of ``model`` whose name ends in ``suffix`` (``_total``,
    ``_sum``, ``_count``; "" for a gauge's)."""
    return (s for family in metric.collect() for s in family.samples
            if s.name.endswith(suffix) and s.labels.get("model") == model)


def counters(metrics: Metrics, model: str) -> dict[str, Any]:
    """This gateway's counters for ``model`` since it started, from its Prometheus metrics (one
    source)."""
    statuses: dict[str, int] = defaultdict(int)
    for s in _samples(metrics.requests, "_total", model):
        if s.labels["route"] in GENERATION_ROUTES:
            statuses[s.labels["status"]] += int(s.value)
    contracts: dict[str, dict[str, dict[str, float]]] = {}

    def cell(labels: dict[str, str]) -> dict[str, float]:
        return contracts.setdefault(labels["path"], {}).setdefault(
            labels["component"], {"inside": 0, "outside": 0, "error_sum": 0.0, "errors": 0})

    for s in _samples(metrics.contract_inside, "_total", model):
        cell(s.labels)["inside" if s.labels["within_p99"] == "true" else "outside"] += int(s.value)
    for suffix, key in (("_sum", "error_sum"), ("_count", "errors")):
        for s in _samples(metrics.contract_error, suffix, model):
            if s.labels["prediction"] == "calibrated":
                cell(s.labels)[key] += s.value if key == "error_sum" else int(s.value)
    return {"admitted": sum(int(s.value) for s in _samples(metrics.admitted, "_total", model)),
            "responses": dict(statuses),
            "budget_waits": sum(int(s.value) for s in _samples(metrics.budget_wait, "_count", model)),
            "tokens": {s.labels["kind"]: int(s.value) for s in _samples(metrics.tokens, "_total", model)},
            "contracts": contracts}


def _live(path: dict[str, Any]) -> bool:
    """Whether a path has slots (a live worker) or still holds requests."""
    return bool(path.get("capacity", 0) or path.get("in_flight", 0) or path.get("pending_prefill", 0))


def scheduler_view(snapshot: dict[str, Any]) -> dict[str, Any]:
    """The parts of ``Dispatcher.snapshot()`` the console draws. The scheduler keeps both
    paths, and counts at least one worker on each for its arithmetic (``fleet.capacity_share``):
    a path without slots (no worker of its pool, or only ones that say they are down) and
    without requests is left out (a CPU-only box shows no ``gpu`` path); one that still holds
    requests shows its workers as 0. The backlog per pool stays whole (an empty pool's is 0)."""
    view = {k: snapshot[k] for k in _SNAPSHOT_KEYS if k in snapshot}
    paths = snapshot.get("paths")
    if isinstance(paths, dict):
        view["paths"] = {name: {k: v for k, v in path.items() if k in _PATH_KEYS}
                         | ({} if path.get("capacity", 0) else {"workers": 0})
                         for name, path in paths.items() if _live(path)}
    fairness = snapshot.get("fairness")
    if isinstance(fairness, dict) and isinstance(fairness.get("tenants"), dict):
        view["tenants_queued"] = len(fairness["tenants"])
    return view


class Traffic:
    """A gateway's recent traffic: its admissions, refusals and budget waits since it started,
    as they stood at each of its parts over the last ``HISTORY_S + RATE_S`` seconds (about
    125 samples of 4 numbers: 4 KB of JSON in each part). Held in the gateway's memory: a
    restarted gateway's history starts again with it."""

    def __init__(self) -> None:
        self.samples: deque[list[float]] = deque()

    def add(self, at: float, own: dict[str, Any]) -> list[list[float]]:
        """Record ``own`` counters taken at ``at``; the samples kept, oldest first."""
        self.samples.append([round(at, 3), own["admitted"], refused(own["responses"]), own["budget_waits"]])
        while self.samples and self.samples[0][0] < at - HISTORY_S * PUBLISH_S - RATE_S - PUBLISH_S:
            self.samples.popleft()
        return list(self.samples)


def part(snapshot: dict[str, Any], metrics: Metrics, started: int, now: float,
         traffic: Traffic | None = None) -> dict[str, Any]:
    """A gateway's part of the cluster view for one model (a gateway serving several models
    publishes one part per model), from that model's scheduler snapshot and the gateway's
    metrics of it, with its recent traffic where it keeps one."""
    model = snapshot["model"]
    own = counters(metrics, model)
    return {
        "gateway": snapshot["gateway"],
        "model": model,
        "role": snapshot["role"],
        "at": now,
        "started": started,
        "in_flight": sum(int(s.value) for s in _samples(metrics.in_flight, "", model)),
        "counters": own,
        "scheduler": scheduler_view(snapshot) if snapshot["role"] == "scheduler" else None,
        "traffic": traffic.add(now, own) if traffic is not None else [],
    }


def traffic(samples: list[list[list[float]]], now: float) -> dict[str, Any]:
    """The traffic chart: for each of the last ``HISTORY_S`` points, ``PUBLISH_S`` apart and
    ending at ``now``, each series' rate per second summed over the gateways. A gateway's rate
    at a point comes from its own samples (``Traffic``): from the last one taken by then back
    to the last one taken ``RATE_S`` before that (or its first, younger), so counters are only
    ever compared within one gateway's clock and life. None where no gateway had two samples
    within ``RATE_S`` of the point (before any started, or while none published)."""
    points = [now - (HISTORY_S - 1 - i) * PUBLISH_S for i in range(HISTORY_S)]
    series: list[list[float | None]] = [[None] * HISTORY_S for _ in TRAFFIC]
    for own in samples:
        at = [s[0] for s in own]
        for i, t in enumerate(points):
            b = bisect.bisect_right(at, t) - 1
            if b < 1 or t - at[b] > RATE_S:
                continue
            a = max(0, bisect.bisect_right(at, at[b] - RATE_S) - 1)
            dt = at[b] - at[a]
            if dt <= 0:
                continue
            for j, values in enumerate(series):
                values[i] = (values[i] or 0.0) + max(0.0, own[b][j + 1] - own[a][j + 1]) / dt
    return {"step_s": PUBLISH_S, "window_s": RATE_S, **dict(zip(TRAFFIC, series, strict=True))}


def worker_view(hb: p.Heartbeat, beat: float | None, now: float) -> dict[str, Any]:
    """One worker as the console lists it: slots in use, heartbeat age, the device and what
    it measured of itself at start (``workers.selfprofile``; absent for engines that do not
    profile)."""
    facts, summary = hb.profile_part("facts"), hb.profile_part("summary")
    return {
        "worker": hb.worker, "pool": hb.pool, "engine": hb.engine, "model": hb.model,
        "device": hb.device, "dtype": hb.dtype, "choice": hb.choice,
        "slots": hb.slots, "free": hb.free, "running": hb.running, "down": hb.down,
        "heartbeat_age_s": None if beat is None else max(0.0, now - beat),
        "up_s": max(0.0, now - hb.started),
        "tokens_per_s": hb.tokens_per_s,
        "cpu": facts.get("cpu", ""), "amx": facts.get("amx"), "amx_used": facts.get("amx_used"),
        "gpu": facts.get("gpu", ""), "threads": facts.get("threads"),
        "prefill_tokens_per_s": summary.get("prefill_tokens_per_s"),
        "decode_step_ms": summary.get("decode_step_ms"),
        "profile_how": hb.profile.get("how"),
        "profile_starved": hb.profile.get("starved"),
        "cpu_starved": hb.cpu_starved,
        "threads_now": hb.threads or None,
    }


def _add(into: dict[str, Any], more: dict[str, Any]) -> None:
    for k, v in more.items():
        if isinstance(v, dict):
            _add(into.setdefault(k, {}), v)
        else:
            into[k] = into.get(k, 0) + v


def cluster(me: str, parts: list[dict[str, Any]], workers: list[dict[str, Any]], now: float,
            holder: str | None = None, model: str | None = None) -> dict[str, Any]:
    """The cluster view from the gateways' live parts: every gateway with its role and its
    own totals, stamped with the time it took them (``at``: rates come from one gateway's
    successive parts, never from parts read at different moments), the counters summed (and
    the traffic chart's last ``HISTORY_S`` points: ``counters.traffic``; the response's shape,
    ``shapes.Cluster``, takes any key in ``counters``), the scheduler's queues and policy (None
    while no gateway schedules). The scheduler is the lease's ``holder`` ('' none; None: not
    read): a part published before its gateway lost the lease (paused, cut off) says scheduler
    for up to ``STALE_S`` more, and is read as a follower's. ``model``: the answering gateway's;
    only the gateways of that model (its scheduling domain) are shown and summed, where several
    models share the Redis (a part from a release without models counts as this model's)."""
    if model is not None:
        parts = [doc for doc in parts if doc.get("model", model) == model]
    total: dict[str, Any] = {"admitted": 0, "responses": {}, "budget_waits": 0, "tokens": {}, "contracts": {}}
    gateways = []
    scheduler = None
    for doc in sorted(parts, key=lambda d: str(d.get("gateway"))):
        own = doc.get("counters") or {}
        _add(total, own)
        schedules = doc.get("role") == "scheduler" and (holder is None or doc.get("gateway") == holder)
        role = "scheduler" if schedules else "follower"
        gateways.append({"gateway": doc.get("gateway"), "model": doc.get("model", model or ""), "role": role,
                         "at": doc["at"],
                         "age_s": max(0.0, now - doc["at"]), "in_flight": doc.get("in_flight", 0),
                         "started": doc.get("started"), "admitted": own.get("admitted", 0),
                         "refused": refused(own.get("responses", {})), "budget_waits": own.get("budget_waits", 0)})
        if schedules and doc.get("scheduler") is not None:
            scheduler = {"gateway": doc.get("gateway"), **doc["scheduler"]}
    return {
        "object": "cluster", "at": now, "gateway": me, "model": model or "", "gateways": gateways,
        "scheduler": scheduler,
        "workers": sorted(workers, key=lambda w: (w["pool"], w["worker"])),
        "counters": {**total, "refused": refused(total["responses"]),
                     "traffic": traffic([doc.get("traffic") or [] for doc in parts], now)},
    }


def refused(responses: dict[str, int]) -> int:
    """Error answers on the generation routes (a refusal, or rarely a failure after admission)."""
    return sum(n for status, n in responses.items() if int(status) >= 400 and status != CLIENT_LEFT)
