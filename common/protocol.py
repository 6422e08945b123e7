"""The stream message format shared by the gateway and the workers (see docs/protocol.md).

Every stream entry has two fields: ``v`` (the protocol version) and ``m`` (an orjson
document). Workers never import ``gateway``; the gateway imports this module.
Translation between these documents and the dataclasses below happens here and only here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

import orjson

VERSION = 2  # 2: the step telemetry stream (docs/protocol.md)



class ProtocolError(ValueError):
    """An entry that does not follow this module's format (wrong version, missing field)."""


TEMPERATURE_MAX = 2.0  # a temperature is within [0, this] and a top_p within (0, 1] (OpenAI's ranges)


def sampling_in_range(name: str, value: float) -> bool:
    """Whether ``value`` is a ``temperature`` or a ``top_p`` a request may send; a default
    (the gateway's, or a model's generation_config.json) is held to the same."""
    if name == "temperature":
        return 0.0 <= value <= TEMPERATURE_MAX
    return 0.0 < value <= 1.0


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # generate exactly max_tokens (benchmarks, trace replay)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True, slots=True)
class SeqJob:
    """One sequence of a batch: a tokenized prompt and how to sample its continuation."""

    rid: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    stream: bool = False
    # tokens already generated and characters of text already delivered: set when a
    # worker resumes a sequence (a dead peer's, or one handed over after prefill)
    resume_ids: tuple[int, ...] = ()
    resume_chars: int = 0
    handoff: str | None = None  # run prefill only, then hand the KV cache to this pool
    kv_key: str | None = None  # where a handed-over KV cache waits (Redis string)
    # the prompt as the client sent it, for an engine that fronts another server
    # (workers/upstream.py): a chat's messages (role, text), or a completion's text
    messages: tuple[tuple[str, str], ...] = ()
    text: str | None = None


@dataclass(frozen=True, slots=True)
class BatchJob:
    batch_id: str
    reply_to: str
    bucket: int
    seqs: tuple[SeqJob, ...]

    def handoff_pool(self, rid: str) -> str:
        for s in self.seqs:
            if s.rid == rid and s.handoff:
                return s.handoff
        raise KeyError(f"{rid} has no handoff pool in batch {self.batch_id}")


@dataclass(frozen=True, slots=True)
class Delta:
    """New text of a streaming sequence; ``tokens`` counts completion tokens so far."""

    rid: str
    text: str
    tokens: int
    kind: Literal["delta"] = "delta"


@dataclass(frozen=True, slots=True)
class Finished:
    rid: str
    text: str  # the whole completion for non-streaming sequences, the unsent tail otherwise
    finish_reason: str  # "stop" | "length" | "cancelled"
    prompt_tokens: int
    completion_tokens: int
    kind: Literal["done"] = "done"
    # seconds from the step that sampled its first token to this one, measured by the worker
    # (None: not measured): the gateway learns a non-streaming request's first token from it
    decode_s: float | None = None


@dataclass(frozen=True, slots=True)
class Failed:
    rid: str
    code: str
    message: str
    kind: Literal["error"] = "error"


@dataclass(frozen=True, slots=True)
class BatchReport:
    """Timings of a finished batch, fed back to the scheduler's cost model."""

    batch_id: str
    pool: str
    worker: str
    batch_size: int
    prompt_tokens: int  # padded tokens per sequence
    prefill_s: float
    decode_steps: int
    decode_s: float
    output_tokens: tuple[int, ...]
    mean_running: float = 0.0  # sequences decoding on the worker per step, all batches counted
    kind: Literal["batch"] = "batch"


Event = Delta | Finished | Failed | BatchReport


HEARTBEAT_MAX_BATCHES = 64  # a heartbeat names at most this many held batches


@dataclass(slots=True)
class Heartbeat:
    worker: str
    pool: str
    device: str
    dtype: str
    engine: str
    model: str
    slots: int
    free: int
    tokens_per_s: float
    started: float
    choice: str = ""  # why this device and dtype (AMX found or not, CUDA or not)
    # in-flight work, so gateways can reconcile their slot bookkeeping
    running: int = 0  # sequences in the engine (waiting or decoding)
    batches: tuple[str, ...] = ()  # ids of the batches this worker holds, at most HEARTBEAT_MAX_BATCHES
    down: str = ""  # why the worker takes no jobs now (its upstream does not answer); "" if it does
    upstream: dict[str, float] = dataclasses.field(default_factory=dict)  # the upstream's own gauges (vLLM)
    # the engine's step-time profile, measured at start (workers/selfprofile.py); {} if none
    profile: dict[str, Any] = dataclasses.field(default_factory=dict)
    # the share of the worker's thread time spent waiting for a CPU since its last heartbeat:
    # another program on its CPUs (0 on a quiet machine, or where the system does not say)
    cpu_starved: float = 0.0
    threads: int = 0  # the engine's intra-op threads now (0: none of its own); fewer while starved
    # the context window its engine serves, prompt plus completion tokens (an upstream's, as the
    # upstream says or --context-tokens); 0: the model's own (gateway/dispatch/fleet.served_context)
    context: int = 0
    # the digest of the model's tokenizer files it published (``wire.tokenizer_key``); "" if none
    tokenizer: str = ""
    # prompt tokens its engine keeps for reuse by a later prompt with the same prefix (0: none);
    # placement credits a prompt's prefill with what it expects found there (gateway/dispatch/placement.py)
    prefix_cache: int = 0

    def profile_part(self, name: str) -> dict[str, Any]:
        """``profile[name]`` (``facts``: the machine; ``summary``: what it measured) where it
        is an object, else {} (no profile, or one this version cannot read)."""
        part = self.profile.get(name)
        return part if isinstance(part, dict) else {}


#: A worker whose threads spent this share of their time waiting for a CPU (``Heartbeat.cpu_starved``,
#: a profile's ``starved``) was starved: another program on its CPUs slowed what it measured.
STARVED_SHARE = 0.1
TELEMETRY_MAX_STEPS = 64  # a telemetry entry carries at most this many step records


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One engine step, as the scheduler's cost model sees it."""

    prefill_tokens: int  # prompt tokens prefilled in the step (chunks included)
    decode_seqs: int  # sequences that decoded one token in the step
    kv_tokens: int  # KV-cache tokens held by the running sequences when the step began
    ms: float  # the step's wall time, milliseconds


@dataclass(frozen=True, slots=True)
class Telemetry:
    """A worker's recent steps and its state now: one entry of its model's ``wire.telemetry_stream``."""

    worker: str
    pool: str
    slots: int
    free: int  # free slots now
    running: int  # sequences decoding now
    queued_prefill: int  # prompt tokens admitted but not yet prefilled
    step_tokens: int  # the worker's per-step token budget (0: none, whole prompts)
    steps: tuple[StepRecord, ...]  # the latest, at most TELEMETRY_MAX_STEPS, oldest first
    dropped: int = 0  # step records left out since the last entry (cap reached)


# -- encoding ---------------------------------------------------------------------------


def _entry(doc: dict[str, Any]) -> dict[str, bytes]:
    return {"v": str(VERSION).encode(), "m": orjson.dumps(doc)}


def _doc(fields: dict[bytes, bytes]) -> dict[str, Any]:
    version = fields.get(b"v")
    if version != str(VERSION).encode():
        raise ProtocolError(f"unsupported protocol version {version!r}")
    try:
        doc = orjson.loads(fields[b"m"])
    except (KeyError, orjson.JSONDecodeError) as exc:
        raise ProtocolError(f"unreadable entry: {exc}") from exc
    if not isinstance(doc, dict):
        raise ProtocolError("entry body is not an object")
    return doc


def _encode_seq(s: SeqJob) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "rid": s.rid,
        "prompt_ids": list(s.prompt_ids),
        "stream": s.stream,
        "max_tokens": s.params.max_tokens,
        "temperature": s.params.temperature,
        "top_p": s.params.top_p,
        "seed": s.params.seed,
        "stop": list(s.params.stop),
    }
    # optional fields travel only when set
    if s.resume_ids:
        doc["resume_ids"] = list(s.resume_ids)
        doc["resume_chars"] = s.resume_chars
    if s.params.ignore_eos:
        doc["ignore_eos"] = True
    if s.handoff:
        doc["handoff"] = s.handoff
    if s.kv_key:
        doc["kv_key"] = s.kv_key
    if s.messages:
        doc["messages"] = [list(m) for m in s.messages]
    if s.text is not None:
        doc["text"] = s.text
    return doc


def encode_job(job: BatchJob) -> dict[str, bytes]:
    return _entry(
        {
            "batch_id": job.batch_id,
            "reply_to": job.reply_to,
            "bucket": job.bucket,
            "seqs": [_encode_seq(s) for s in job.seqs],
        }
    )


def decode_job(fields: dict[bytes, bytes]) -> BatchJob:
    doc = _doc(fields)
    try:
        return BatchJob(
            batch_id=str(doc["batch_id"]),
            reply_to=str(doc["reply_to"]),
            bucket=int(doc["bucket"]),
            seqs=tuple(
                SeqJob(
                    rid=str(s["rid"]),
                    prompt_ids=tuple(int(t) for t in s["prompt_ids"]),
                    stream=bool(s["stream"]),
                    params=SamplingParams(
                        max_tokens=int(s["max_tokens"]),
                        temperature=float(s["temperature"]),
                        top_p=float(s["top_p"]),
                        seed=None if s["seed"] is None else int(s["seed"]),
                        stop=tuple(str(x) for x in s["stop"]),
                        ignore_eos=bool(s.get("ignore_eos", False)),
                    ),
                    resume_ids=tuple(int(t) for t in s.get("resume_ids", ())),
                    resume_chars=int(s.get("resume_chars", 0)),
                    handoff=s.get("handoff"),
                    kv_key=s.get("kv_key"),
                    messages=tuple((str(role), str(text)) for role, text in s.get("messages", ())),
                    text=None if s.get("text") is None else str(s["text"]),
                )
                for s in doc["seqs"]
            ),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ProtocolError(f"malformed job: {exc!r}") from exc


def encode_events(events: list[Event]) -> dict[str, bytes]:
    out = []
    for ev in events:
        d = {f: getattr(ev, f) for f in ev.__slots__}
        out.append(d)
    return _entry({"events": out})


_EVENT_TYPES: dict[str, type] = {
    "delta": Delta,
    "done": Finished,
    "error": Failed,
    "batch": BatchReport,
}
_EVENT_FIELDS = {kind: frozenset(f.name for f in dataclasses.fields(cls)) for kind, cls in _EVENT_TYPES.items()}


def decode_events(fields: dict[bytes, bytes]) -> list[Event]:
    doc = _doc(fields)
    events: list[Event] = []
    try:
        for d in doc["events"]:
            cls = _EVENT_TYPES[d["kind"]]
            if cls is BatchReport:
                d["output_tokens"] = tuple(d["output_tokens"])
            known = _EVENT_FIELDS[d["kind"]]  # fields a newer worker added are ignored; later ones have defaults
            events.append(cls(**{k: v for k, v in d.items() if k in known}))
    except (KeyError, TypeError) as exc:
        raise ProtocolError(f"malformed reply: {exc!r}") from exc
    return events


_HEARTBEAT_FIELDS = tuple(f.name for f in dataclasses.fields(Heartbeat))


def encode_heartbeat(hb: Heartbeat) -> bytes:
    """A heartbeat is one string value (SET with a TTL), so it carries its version inside."""
    doc: dict[str, Any] = {f: getattr(hb, f) for f in _HEARTBEAT_FIELDS}
    doc["v"] = VERSION
    return orjson.dumps(doc)


def decode_heartbeat(raw: bytes) -> Heartbeat:
    """Fields added later have defaults (a heartbeat without them still decodes); fields
    this version does not know are ignored (a newer worker's heartbeat still decodes)."""
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ProtocolError(f"unreadable heartbeat: {exc}") from exc
    if not isinstance(doc, dict) or doc.pop("v", None) != VERSION:
        raise ProtocolError("heartbeat of an unsupported protocol version")
    known = {k: v for k, v in doc.items() if k in _HEARTBEAT_FIELDS}
    try:
        if "batches" in known:
            known["batches"] = tuple(str(b) for b in known["batches"])
        if "upstream" in known:
            known["upstream"] = {str(k): float(v) for k, v in known["upstream"].items()}
        if not isinstance(known.get("profile", {}), dict):
            raise TypeError("profile must be an object")
        return Heartbeat(**known)
    except (TypeError, ValueError, AttributeError) as exc:
        raise ProtocolError(f"malformed heartbeat: {exc!r}") from exc


def by_pool(profiles: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per pool, the most recently measured of ``profiles`` (a fleet's heartbeats, as the
    simulator replays it: one profile for each pool's workers)."""
    out: dict[str, dict[str, Any]] = {}
    for prof in profiles:
        pool = prof.get("pool")
        if isinstance(pool, str) and "fit" in prof and (
                pool not in out or prof.get("measured_at", 0) > out[pool].get("measured_at", 0)):
            out[pool] = prof
    return out


def by_model(profiles: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per model, ``by_pool`` of its profiles: a fleet that serves several models (issue 39)
    is a scheduling domain per model, each with its own pools."""
    models: dict[str, list[dict[str, Any]]] = {}
    for prof in profiles:
        models.setdefault(str(prof.get("model", "")), []).append(prof)
    return {model: pools for model, found in sorted(models.items()) if (pools := by_pool(found))}


_TELEMETRY_INTS = ("slots", "free", "running", "queued_prefill", "step_tokens", "dropped")


def encode_telemetry(t: Telemetry) -> dict[str, bytes]:
    """Steps travel as ``[prefill_tokens, decode_seqs, kv_tokens, ms]`` arrays, oldest first."""
    doc: dict[str, Any] = {"worker": t.worker, "pool": t.pool}
    doc.update({f: getattr(t, f) for f in _TELEMETRY_INTS})
    doc["steps"] = [[s.prefill_tokens, s.decode_seqs, s.kv_tokens, round(s.ms, 3)] for s in t.steps]
    return _entry(doc)


def decode_telemetry(fields: dict[bytes, bytes]) -> Telemetry:
    doc = _doc(fields)
    try:
        steps = tuple(_step_record(s) for s in doc["steps"])
        ints = {f: _int(doc[f]) for f in _TELEMETRY_INTS}
        worker, pool = doc["worker"], doc["pool"]
        if not isinstance(worker, str) or not isinstance(pool, str):
            raise TypeError("worker and pool must be strings")
        if len(steps) > TELEMETRY_MAX_STEPS:
            raise ValueError(f"{len(steps)} step records, more than {TELEMETRY_MAX_STEPS}")
        return Telemetry(worker=worker, pool=pool, steps=steps, **ints)
    except (KeyError, TypeError, ValueError) as exc:
        raise ProtocolError(f"malformed telemetry: {exc!r}") from exc


def _int(x: object) -> int:
    if not isinstance(x, int) or isinstance(x, bool) or x < 0:
        raise ValueError(f"expected a count, got {x!r}")
    return x


def _step_record(s: object) -> StepRecord:
    if not isinstance(s, list) or len(s) != 4:
        raise ValueError(f"a step record is [prefill, decode, kv, ms], got {s!r}")
    ms = s[3]
    if not isinstance(ms, int | float) or isinstance(ms, bool) or ms < 0:
        raise ValueError(f"step milliseconds must be a non-negative number, got {ms!r}")
    return StepRecord(_int(s[0]), _int(s[1]), _int(s[2]), float(ms))
