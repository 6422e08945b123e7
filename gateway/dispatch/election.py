"""One scheduler for every gateway: the lease that elects it, and what the others send it.

docs/scheduling.md §15 gives the design. One gateway holds ``wire.scheduler_lease`` (a key
with a ``LEASE_MS`` TTL, renewed every ``RENEW_S``) and runs the one scheduling core over
every queued request. The others (followers) keep their HTTP work, the budget and their
reply streams, and write what the scheduler needs to ``wire.arrivals_stream``:

* an **admission** (the tokenized request, who sent it, the follower's reply stream); it
  stays pending in ``wire.ARRIVALS_GROUP`` until the scheduler dispatches or refuses it, in
  the same fenced script (``DISPATCH``) that writes the job or the refusal, so that a new
  scheduler reclaims exactly what the old one left undone;
* what the follower learns about a forwarded request afterwards: the workers' final events
  and batch reports (slots come back), its first token, its end (the contracts calibrate),
  a cancel;
* a question: the scheduler's ``explain`` of one request, for the operator console on a
  follower (answered on the follower's reply stream, in an ``explained`` entry).

The scheduler answers each admission on the follower's reply stream with its contract or
its refusal (a ``decision`` entry); the workers reply to the follower directly.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from typing import Any

import orjson

from common import protocol as p
from common import wire
from gateway.dispatch.scheduling import Origin
from sched_core import Contract, Reject

LEASE_MS = 1000  # a scheduler silent this long has lost the lease
RENEW_S = 0.25  # how often the lease is renewed, or sought

# KEYS: the lease, its term; ARGV: this gateway's id, TTL ms. The term this gateway holds the
# lease in now (>= 1; a free lease taken is a new term), or 0: another gateway holds it
HOLD = """
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return tonumber(redis.call('GET', KEYS[2]) or redis.call('INCR', KEYS[2]))
end
if holder then
  return 0
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return redis.call('INCR', KEYS[2])
"""

# KEYS: the lease; ARGV: this gateway's id. A clean exit hands the lease on at once.
RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

# KEYS: 1 the lease, 2 the arrivals stream, then per entry its stream and a doorbell
# ARGV: 1 this gateway's id ('' = not fenced: this gateway's own requests), 2 the arrivals
#       group, 3 protocol version, 4 n entries, 5 the jobs' consumer group, 6 doorbell MAXLEN,
#       then per entry (field, payload, consumer: '' = none), then the arrival entry ids they
#       settle (XACK)
# An entry with a consumer is a job the scheduler chose that worker for: it is delivered to
# the worker's pending entries at once (the stream's oldest undelivered entry: this one, as
# every scheduled job is delivered this way) and the worker's doorbell rings with the job
# and its entry id, so the worker's blocking read gets it in one round trip.
# -1, and nothing written, when a fenced call's gateway no longer holds the lease.
DISPATCH = """
if ARGV[1] ~= '' and redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return -1
end
local n = tonumber(ARGV[4])
for i = 1, n do
  local stream, bell, a = KEYS[1 + 2 * i], KEYS[2 + 2 * i], 4 + 3 * i
  local id = redis.call('XADD', stream, '*', 'v', ARGV[3], ARGV[a], ARGV[a + 1])
  if ARGV[a + 2] ~= '' then
    redis.call('XREADGROUP', 'GROUP', ARGV[5], ARGV[a + 2], 'COUNT', 1, 'STREAMS', stream, '>')
    redis.call('XADD', bell, 'MAXLEN', '~', ARGV[6], '*', 'v', ARGV[3], 'j', id, ARGV[a], ARGV[a + 1])
  end
end
for i = 7 + 3 * n, #ARGV do
  redis.call('XACK', KEYS[2], ARGV[2], ARGV[i])
end
return 1
"""
DISPATCH_SHA = hashlib.sha1(DISPATCH.encode()).hexdigest()


def dispatch_args(model: str, gateway_id: str, writes: list[tuple[str, bytes, bytes]],
                  entries: list[str], worker: str = "") -> tuple[list[str], list[bytes | str | int]]:
    """``DISPATCH``'s KEYS and ARGV: write ``(stream, field, payload)`` entries (a job for
    ``worker``: delivered to it, its doorbell rung) and acknowledge the arrival ``entries`` (on
    ``model``'s arrivals stream) they answer, fenced by ``model``'s lease held by ``gateway_id``
    when there are entries."""
    keys = [wire.scheduler_lease(model), wire.arrivals_stream(model)]
    args: list[bytes | str | int] = [gateway_id if entries else "", wire.ARRIVALS_GROUP, p.VERSION, len(writes),
                                     wire.GROUP, wire.BELL_MAXLEN]
    bell = wire.bell_stream(model, worker)
    for stream, name, payload in writes:
        keys += [stream, bell if worker else stream]
        args += [name, payload, worker]
    return keys, args + list(entries)


#: the kind (``b"k"``) of an entry on the arrivals stream
ARRIVAL, EVENTS, NOTE, QUESTION = b"a", b"e", b"n", b"q"
#: the kind of a note (``Note``)
FIRST, END, CANCEL = "first", "end", "cancel"

DECISION = b"d"  # the field of a decision entry on a follower's reply stream (events use b"m")
EXPLAINED = b"x"  # the field of an answer to a question (``encode_question``) on a follower's reply stream
VERSION = str(p.VERSION).encode()  # every entry's b"v", as on the workers' streams


@dataclass(frozen=True, slots=True)
class Arrival:
    """An admission a follower forwarded: the request, who sent it, where to answer;
    ``promised``: its client already holds a contract (a scheduler that stepped down handed
    it on), so the scheduler takes it without a refusal."""

    seq: p.SeqJob
    who: Origin
    reply_to: str
    promised: bool = False


@dataclass(frozen=True, slots=True)
class Events:
    """Worker events about forwarded requests (final events, batch reports): slots come back."""

    events: tuple[p.Event, ...]


@dataclass(frozen=True, slots=True)
class Note:
    """What a follower learnt about a request it forwarded: ``FIRST`` (its first token came
    ``ttft_s`` after arrival), ``END`` (it ended where it was sent from: what it took; None:
    not seen), ``CANCEL`` (its client left)."""

    kind: str
    rid: str
    ttft_s: float | None = None
    total_s: float | None = None
    tokens: int = 0


@dataclass(frozen=True, slots=True)
class Question:
    """A follower asks for the scheduler's ``explain`` of ``rid``; ``ask`` names the question
    in the answer, written to ``reply_to``."""

    rid: str
    ask: str
    reply_to: str


Message = Arrival | Events | Note | Question


def encode_arrival(seq: p.SeqJob, who: Origin, reply_to: str, promised: bool = False) -> dict[bytes, bytes]:
    job = p.encode_job(p.BatchJob("arrival", reply_to, 0, (seq,)))
    fields = {b"k": ARRIVAL, b"v": VERSION, b"m": job["m"], b"o": orjson.dumps(dataclasses.asdict(who))}
    if promised:
        fields[b"p"] = b"1"
    return fields


def encode_events(events: list[p.Event]) -> dict[bytes, bytes]:
    """Worker events about forwarded requests (``Events``), for the scheduler."""
    return {b"k": EVENTS, b"v": VERSION, b"m": p.encode_events(events)["m"]}


def encode_note(note: Note) -> dict[bytes, bytes]:
    return {b"k": NOTE, b"v": VERSION, b"m": orjson.dumps(dataclasses.asdict(note))}


def encode_question(question: Question) -> dict[bytes, bytes]:
    return {b"k": QUESTION, b"v": VERSION, b"m": orjson.dumps(dataclasses.asdict(question))}


def decode_entry(fields: dict[bytes, bytes]) -> Message | None:
    """An arrivals-stream entry, typed by its kind; None: a kind this version does not know
    (a newer gateway's: acknowledged and skipped). Raises ``p.ProtocolError`` when malformed."""
    kind = fields.get(b"k")
    if kind == ARRIVAL:
        return decode_arrival(fields)
    if kind == EVENTS:
        return Events(tuple(p.decode_events(fields)))
    if kind == NOTE:
        return decode_note(fields)
    if kind == QUESTION:
        return decode_question(fields)
    return None


def encode_explained(ask: str, explain: dict[str, object] | None) -> bytes:
    return orjson.dumps({"ask": ask, "explain": explain})


def decode_explained(raw: bytes) -> tuple[str, dict[str, object] | None]:
    try:
        doc = orjson.loads(raw)
        explain = doc["explain"]
        if explain is not None and not isinstance(explain, dict):
            raise TypeError("explain must be an object")
        return str(doc["ask"]), explain
    except (KeyError, TypeError, orjson.JSONDecodeError) as exc:
        raise p.ProtocolError(f"malformed answer: {exc!r}") from exc


def decode_arrival(fields: dict[bytes, bytes]) -> Arrival:
    try:
        job = p.decode_job(fields)
        who = Origin(**orjson.loads(fields[b"o"]))
    except (KeyError, TypeError, orjson.JSONDecodeError) as exc:
        raise p.ProtocolError(f"malformed arrival: {exc!r}") from exc
    if len(job.seqs) != 1:
        raise p.ProtocolError("an arrival carries one request")
    return Arrival(job.seqs[0], who, job.reply_to, fields.get(b"p") == b"1")


def _doc(fields: dict[bytes, bytes], what: str) -> dict[str, Any]:
    try:
        doc = orjson.loads(fields[b"m"])
    except (KeyError, orjson.JSONDecodeError) as exc:
        raise p.ProtocolError(f"malformed {what}: {exc!r}") from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("rid"), str):
        raise p.ProtocolError(f"a {what} names a request")
    return doc


def decode_note(fields: dict[bytes, bytes]) -> Note:
    """A figure of the wrong type reads as not seen (None, or 0 tokens)."""
    doc = _doc(fields, "note")
    ttft, total, tokens = doc.get("ttft_s"), doc.get("total_s"), doc.get("tokens")
    return Note(str(doc.get("kind")), doc["rid"], ttft if isinstance(ttft, float) else None,
                total if isinstance(total, float) else None, tokens if isinstance(tokens, int) else 0)


def decode_question(fields: dict[bytes, bytes]) -> Question:
    doc = _doc(fields, "question")
    ask, reply_to = doc.get("ask"), doc.get("reply_to")
    if not (isinstance(ask, str) and isinstance(reply_to, str)):
        raise p.ProtocolError("a question names its answer's stream")
    return Question(doc["rid"], ask, reply_to)


def _known(cls: type, doc: dict[str, Any]) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in doc.items() if k in names}


def encode_decision(rid: str, decision: Contract | Reject | None) -> bytes:
    """The scheduler's answer: a contract, a refusal, or (a baseline policy) admitted without one."""
    if decision is None:
        return orjson.dumps({"rid": rid})
    kind = "contract" if isinstance(decision, Contract) else "reject"
    return orjson.dumps({"rid": rid, kind: dataclasses.asdict(decision)})


def decode_decision(raw: bytes) -> tuple[str, Contract | Reject | None]:
    """Fields this version does not know are ignored (a newer scheduler's contract still
    decodes); fields added later have defaults."""
    try:
        doc = orjson.loads(raw)
        if "contract" in doc:
            return str(doc["rid"]), Contract(**_known(Contract, doc["contract"]))
        if "reject" in doc:
            return str(doc["rid"]), Reject(**_known(Reject, doc["reject"]))
        return str(doc["rid"]), None
    except (KeyError, TypeError, orjson.JSONDecodeError) as exc:
        raise p.ProtocolError(f"malformed decision: {exc!r}") from exc
