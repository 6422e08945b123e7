"""Every Redis name tokengate uses on the wire: streams, consumer groups, keys, channels.

The one place that spells them (docs/protocol.md and docs/tenants.md describe what each
holds). Workers and gateways import this module; workers never import ``gateway``.

Every name starts with ``NS``, whose hash tag ``{tg}`` puts all of them in one Redis Cluster
slot: the scripts that touch several keys, and those that derive a key from another one
(a tenant's keys, budget and in-flight set; a request's record), stay valid on a cluster.
Names before the hash tag started with ``LEGACY_NS``; ``gateway.keyspace`` renames them.
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


def gateway_requests(gateway_id: str) -> str:
    """Hash: request id -> "tenant rate reserved" for every request the gateway admitted and
    has not settled; a survivor settles them when the gateway dies."""
    return f"{NS}gateway-requests:{gateway_id}"


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


def request(rid: str) -> str:
    """Hash: the owning tenant and the state of one admitted request."""
    return f"{NS}req:{rid}"


# -- tenants, keys, budgets, usage ----------------------------------------------------------

def model_key(model: str) -> str:
    """JSON: a gateway's fitted step-time model and contract calibration for ``model``, so
    that a restarted gateway or a second replica starts warm (docs/scheduling.md §14)."""
    return f"{NS}model:{model}"


TENANT_IDS = f"{NS}tenants"  # set of tenant ids
TENANT_NAMES = f"{NS}tenant-names"  # hash: name -> tenant id
TENANT_PREFIX = f"{NS}tenant:"  # + id: the tenant's JSON document (string)
TENANT_KEYS_PREFIX = f"{NS}tenant-keys:"  # + id: set of the prefixes of the tenant's keys
KEY_PREFIX = f"{NS}key:"  # + key prefix: hash {tenant, digest, name, created}


def tenant(tid: str) -> str:
    return TENANT_PREFIX + tid


def tenant_keys(tid: str) -> str:
    return TENANT_KEYS_PREFIX + tid


def api_key(prefix: str) -> str:
    return KEY_PREFIX + prefix


def budget(tid: str) -> str:
    """The tenant's GCRA state: its theoretical arrival time (seconds, Redis clock)."""
    return f"{NS}budget:{tid}"


def in_flight(tid: str) -> str:
    """Sorted set: request id -> lease expiry (seconds, Redis clock)."""
    return f"{NS}inflight:{tid}"


def usage(tid: str, minute: int) -> str:
    """Hash of counters for one tenant and one minute (``minute`` = unix time // 60)."""
    return f"{NS}usage:{tid}:{minute}"


def text(value: str | bytes) -> str:
    """A value as redis-py returns it (bytes unless the client decodes), as text."""
    return value if isinstance(value, str) else value.decode()
