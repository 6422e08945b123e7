"""Every Redis name tokengate uses on the wire: streams, consumer groups, keys, channels.

The one place that spells them (docs/protocol.md and docs/tenants.md describe what each
holds). Workers and gateways import this module; workers never import ``gateway``.

Names are laid out for a Redis Cluster (issue 39), each call tokengate makes in one slot:

* a model's scheduling state is under the model's own hash tag (``model_slot``: its jobs
  streams, workers' doorbells, its gateways' reply streams, arrivals, scheduler lease and
  term, telemetry, dead letters, fitted model, and each request's progress, KV hand-over,
  cancel and suspect keys), so that a cluster spreads models over shards while the workers'
  and the scheduler's scripts stay in one slot;
* what a request's budget scripts touch is its tenant's (``tenant_slot``: budget, leases,
  open requests, request records, key digests, usage), so that a cluster spreads tenants;
* the rest starts with ``NS``, whose hash tag ``{tg}`` keeps the catalog (tenants, names,
  API keys), liveness and the console in one slot.

Names before the hash tag started with ``LEGACY_NS``; a tenant's and a model's keys were under
``{tg}`` before they had their tags: ``gateway.keyspace`` renames them.
"""

from __future__ import annotations

NS = "{tg}:"  # the prefix of every name that is neither a model's nor a tenant's
LEGACY_NS = "tg:"  # the prefix before the hash tag (renamed at a gateway's start)


def model_slot(model: str) -> str:
    """The prefix of a model's own keys: its hash tag puts them in one cluster slot, the
    model's (``{tg:m:<model>}``)."""
    return f"{{tg:m:{model}}}:"


def slot_of(name: str) -> str:
    """The hash-tagged prefix a name starts with (``{…}:``): another key derived from it
    falls in its slot."""
    return name[: name.index("}") + 2]


# -- streams and groups -------------------------------------------------------------------

GROUP = "workers"  # the consumer group every jobs stream carries
TELEMETRY_MAXLEN = 10_000  # approximate MAXLEN of every XADD to a telemetry stream


def telemetry_stream(model: str) -> str:
    """The step records and live state of ``model``'s workers; its gateways XREAD it."""
    return model_slot(model) + "steps"


def dead_letter_stream(model: str) -> str:
    """``model``'s poison jobs, capped (see workers.fencing)."""
    return model_slot(model) + "dead"


def jobs_stream(model: str, pool: str) -> str:
    """One model's jobs for one pool: each model is a scheduling domain of its own (issue 39),
    whose workers read only its streams."""
    return model_slot(model) + f"jobs:{pool}"


def bell_stream(model: str, worker_id: str) -> str:
    """A worker's doorbell: a copy of each job the scheduler delivered to the worker itself,
    with its entry id (the job is already in the worker's pending entries of its pool's stream)."""
    return model_slot(model) + f"bell:{worker_id}"


BELL_MAXLEN = 1000  # approximate MAXLEN of a doorbell (a worker holds at most its slots' worth unread)


def replies_stream(model: str, gateway_id: str) -> str:
    """What ``model``'s workers write for one of its gateways (a gateway's domain)."""
    return model_slot(model) + f"replies:{gateway_id}"


REPLIES_TTL_MS = 60_000  # every write renews it: a dead gateway's reply stream expires

# -- the one scheduler (gateway.dispatch.election) ------------------------------------------

# each model's own: the gateways serving a model elect their scheduler among themselves


def scheduler_lease(model: str) -> str:
    """The id of the gateway that schedules ``model`` for all its gateways, with a TTL."""
    return model_slot(model) + "scheduler"


def scheduler_term(model: str) -> str:
    """Counts the lease's takings: a holder knows whether another held it between."""
    return model_slot(model) + "scheduler-term"


def arrivals_stream(model: str) -> str:
    """What the other gateways of ``model`` send its scheduler: admissions and their ends."""
    return model_slot(model) + "arrivals"


def traffic_stream(model: str) -> str:
    """The requests ``model``'s schedulers saw, one entry each, no content: a trace to tune on
    (``gateway/dispatch/traffic_log.py``)."""
    return model_slot(model) + "traffic"


def policy_key(model: str) -> str:
    """The SMDP table in force for ``model``'s scheduler once one was re-solved, with when and
    why it came in (JSON); a scheduler that takes over starts from it
    (``gateway/dispatch/tuning.py``)."""
    return model_slot(model) + "policy"


def policy_status_key(model: str) -> str:
    """What ``model``'s self-tuning is doing: a re-solve running, its last verdict, the watch
    of the last swap (JSON, written by the scheduling gateway, read by every gateway)."""
    return model_slot(model) + "policy:status"


def policy_changes_stream(model: str) -> str:
    """Every change of ``model``'s table in force: swapped in, rolled back (``POLICY_CHANGES_MAXLEN``)."""
    return model_slot(model) + "policy:changes"


def tune_asked_key(model: str) -> str:
    """Set by ``POST /admin/scheduler/tune``: the scheduling gateway re-solves at its next turn."""
    return model_slot(model) + "policy:tune"


POLICY_CHANGES_MAXLEN = 100

ARRIVALS_GROUP = "scheduler"  # its consumer group: an admission stays pending until dispatched or refused


def gone_key(reply_stream: str) -> str:
    """Set (with a TTL) once a dead gateway's requests were settled by a survivor: workers
    drop the jobs still queued for it instead of generating into a stream nobody reads. In
    the reply stream's slot (its model's)."""
    return slot_of(reply_stream) + "gone:" + reply_stream[len(slot_of(reply_stream)):]


# -- liveness -----------------------------------------------------------------------------

WORKERS_ZSET = f"{NS}workers"  # worker id -> last heartbeat (seconds)
GATEWAYS_ZSET = f"{NS}gateways"  # gateway id -> last refresh (Redis server time, seconds)
GATEWAY_REPLIES = f"{NS}gateway-replies"  # gateway id -> its reply stream (in its model's slot), for its sweep
PROFILES_HASH = f"{NS}profiles"  # machine fingerprint -> the step-time profile workers measured there (JSON)
BACKLOG_HASH = f"{NS}backlog"  # gateway id -> its queued work per pool, JSON (docs/operations.md, "Scaling on backlog")


def worker_key(worker_id: str) -> str:
    """The worker's heartbeat document, with a TTL."""
    return f"{NS}worker:{worker_id}"


def console_key(gateway_id: str) -> str:
    """The gateway's own counters and role (and, on the scheduler, its queues) as the operator
    console shows them, JSON, rewritten every second with a short TTL (``gateway.console.status``)."""
    return f"{NS}console:{gateway_id}"


# -- per request --------------------------------------------------------------------------

CANCEL_CHANNEL = f"{NS}cancel"  # pub/sub: request ids whose client went away


def cancel_prefix(model: str) -> str:
    """+ request id: a cancel that outlives the pub/sub message, in the model's slot (its
    workers' scripts read it beside the jobs stream)."""
    return model_slot(model) + "cancel:"


def cancel_key(model: str, rid: str) -> str:
    return cancel_prefix(model) + rid


def suspect_key(model: str, entry_id: str) -> str:
    """A job entry that was in an engine step that failed: whoever runs it next runs it alone."""
    return model_slot(model) + f"suspect:{entry_id}"


def tokenizer_key(digest: str) -> str:
    """A model's tokenizer files as a worker published them (``common/tokenizer_bundle.py``), by
    content digest: written once, never changed, no TTL (a few MB per model a fleet has served)."""
    return f"{NS}tokenizer:{digest}"


def kv_key(model: str, rid: str) -> str:
    """A handed-over KV cache (safetensors bytes), with a TTL."""
    return model_slot(model) + f"kv:{rid}"


def progress_key(model: str, rid: str) -> str:
    """A streaming sequence's progress (generated ids, characters delivered), with a TTL."""
    return model_slot(model) + f"progress:{rid}"


def model_key(model: str) -> str:
    """JSON: a gateway's fitted step-time model and contract calibration for ``model``, so
    that a restarted gateway or a second replica starts warm (docs/scheduling.md §14)."""
    return model_slot(model) + "model"


# -- tenants, keys, budgets, usage ----------------------------------------------------------


TENANT_IDS = f"{NS}tenants"  # set of tenant ids
TENANT_NAMES = f"{NS}tenant-names"  # hash: name -> tenant id
TENANT_PREFIX = f"{NS}tenant:"  # + id: the tenant's JSON document (string)
KEY_PREFIX = f"{NS}key:"  # + key prefix: hash {tenant, digest, name, created}


def tenant(tid: str) -> str:
    return TENANT_PREFIX + tid


def api_key(prefix: str) -> str:
    return KEY_PREFIX + prefix


# -- a tenant's own slot: what a request's budget scripts touch ------------------------------


def tenant_slot(tid: str) -> str:
    """The prefix of a tenant's own keys: its hash tag puts them in one cluster slot, the
    tenant's (``{tg:t:<id>}``)."""
    return f"{{tg:t:{tid}}}:"


def budget(tid: str) -> str:
    """The tenant's GCRA state: its theoretical arrival time (seconds, Redis clock)."""
    return tenant_slot(tid) + "budget"


def in_flight(tid: str) -> str:
    """Sorted set: request id -> lease expiry (seconds, Redis clock), under a concurrency limit."""
    return tenant_slot(tid) + "inflight"


def open_requests(tid: str) -> str:
    """Hash: request id -> "gateway rate reserved" for each of the tenant's requests admitted
    and not settled; a survivor settles a dead gateway's."""
    return tenant_slot(tid) + "open"


def request(tid: str, rid: str) -> str:
    """Hash: the owning tenant and the state of one admitted request."""
    return tenant_slot(tid) + "req:" + rid


def tenant_keys(tid: str) -> str:
    """Hash: the prefix of each of the tenant's API keys -> its digest (the admission script
    checks a key is live here, in the tenant's slot)."""
    return tenant_slot(tid) + "keys"


def usage(tid: str, minute: int) -> str:
    """Hash of counters for one tenant and one minute (``minute`` = unix time // 60)."""
    return tenant_slot(tid) + f"usage:{minute}"


def text(value: str | bytes) -> str:
    """A value as redis-py returns it (bytes unless the client decodes), as text."""
    return value if isinstance(value, str) else value.decode()
