"""Every Redis name tokengate uses on the wire: streams, consumer groups, keys, channels.

The one place that spells them (docs/protocol.md and docs/tenants.md describe what each
holds). Workers and gateways import this module; workers never import ``gateway``.

Names are laid out for a Redis Cluster (issue 39): what a request's budget scripts touch is
a tenant's, under the tenant's own hash tag (``tenant_slot``: its budget, leases, open
requests, request records, key digests and usage), so that a cluster spreads tenants over
shards while each script stays in one slot; everything else starts with ``NS``, whose hash
tag ``{tg}`` keeps the catalog (tenants, names, API keys), liveness and the streams in one
slot. Names before the hash tag started with ``LEGACY_NS``, and a tenant's keys were under
``{tg}`` before they had its tag; ``gateway.keyspace`` renames both.
"""

from __future__ import annotations

NS = "{tg}:"  # every name's prefix; the hash tag keeps all of them in one cluster slot
LEGACY_NS = "tg:"  # the prefix before the hash tag (renamed at a gateway's start)

# -- streams and groups -------------------------------------------------------------------

GROUP = "workers"  # the consumer group every jobs stream carries
DEAD_LETTER_STREAM = f"{NS}dead"  # poison jobs, capped (see workers.fencing)
TELEMETRY_STREAM = f"{NS}steps"  # every worker's step records and live state; gateways XREAD it
TELEMETRY_MAXLEN = 10_000  # approximate MAXLEN of every XADD to it


def jobs_stream(model: str, pool: str) -> str:
    """One model's jobs for one pool: each model is a scheduling domain of its own (issue 39),
    whose workers read only its streams."""
    return f"{NS}jobs:{model}:{pool}"


def bell_stream(worker_id: str) -> str:
    """A worker's doorbell: a copy of each job the scheduler delivered to the worker itself,
    with its entry id (the job is already in the worker's pending entries of its pool's stream)."""
    return f"{NS}bell:{worker_id}"


BELL_MAXLEN = 1000  # approximate MAXLEN of a doorbell (a worker holds at most its slots' worth unread)


def replies_stream(gateway_id: str) -> str:
    return f"{NS}replies:{gateway_id}"


REPLIES_TTL_MS = 60_000  # every write renews it: a dead gateway's reply stream expires

# -- the one scheduler (gateway.dispatch.election) ------------------------------------------

# each model's own: the gateways serving a model elect their scheduler among themselves


def scheduler_lease(model: str) -> str:
    """The id of the gateway that schedules ``model`` for all its gateways, with a TTL."""
    return f"{NS}scheduler:{model}"


def scheduler_term(model: str) -> str:
    """Counts the lease's takings: a holder knows whether another held it between."""
    return f"{NS}scheduler-term:{model}"


def arrivals_stream(model: str) -> str:
    """What the other gateways of ``model`` send its scheduler: admissions and their ends."""
    return f"{NS}arrivals:{model}"


ARRIVALS_GROUP = "scheduler"  # its consumer group: an admission stays pending until dispatched or refused


def gone_key(reply_stream: str) -> str:
    """Set (with a TTL) once a dead gateway's requests were settled by a survivor: workers
    drop the jobs still queued for it instead of generating into a stream nobody reads."""
    return f"{NS}gone:{reply_stream}"


# -- liveness -----------------------------------------------------------------------------

WORKERS_ZSET = f"{NS}workers"  # worker id -> last heartbeat (seconds)
GATEWAYS_ZSET = f"{NS}gateways"  # gateway id -> last refresh (Redis server time, seconds)
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
CANCEL_PREFIX = f"{NS}cancel:"  # + request id: a cancel that outlives the pub/sub message


def cancel_key(rid: str) -> str:
    return CANCEL_PREFIX + rid


def suspect_key(entry_id: str) -> str:
    """A job entry that was in an engine step that failed: whoever runs it next runs it alone."""
    return f"{NS}suspect:{entry_id}"


def tokenizer_key(digest: str) -> str:
    """A model's tokenizer files as a worker published them (``common/tokenizer_bundle.py``), by
    content digest: written once, never changed, no TTL (a few MB per model a fleet has served)."""
    return f"{NS}tokenizer:{digest}"


def kv_key(rid: str) -> str:
    """A handed-over KV cache (safetensors bytes), with a TTL."""
    return f"{NS}kv:{rid}"


def progress_key(rid: str) -> str:
    """A streaming sequence's progress (generated ids, characters delivered), with a TTL."""
    return f"{NS}progress:{rid}"


# -- tenants, keys, budgets, usage ----------------------------------------------------------

def model_key(model: str) -> str:
    """JSON: a gateway's fitted step-time model and contract calibration for ``model``, so
    that a restarted gateway or a second replica starts warm (docs/scheduling.md §14)."""
    return f"{NS}model:{model}"


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
