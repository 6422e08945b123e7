import orjson
import pytest

from common import protocol as p
from common import wire

VERSION = str(p.VERSION).encode()


def _job() -> p.BatchJob:
    return p.BatchJob(
        batch_id="gw:1",
        reply_to=wire.replies_stream("m", "gw"),
        bucket=2,
        seqs=(
            p.SeqJob("r1", (1, 2, 3), p.SamplingParams(8, 0.0, 1.0, None, ()), stream=True),
            p.SeqJob("r2", (4,), p.SamplingParams(5, 0.7, 0.9, 42, ("\n", "END"))),
        ),
    )


def _wire(fields: dict[str, bytes]) -> dict[bytes, bytes]:
    return {k.encode(): v for k, v in fields.items()}


def test_job_round_trip() -> None:
    job = _job()
    assert p.decode_job(_wire(p.encode_job(job))) == job


def test_optional_sequence_fields_round_trip_and_stay_off_the_wire_when_unset() -> None:
    seq = p.SeqJob("r", (1,), p.SamplingParams(4), resume_ids=(5, 6), resume_chars=3, handoff="gpu", kv_key="tg:kv:r")
    job = p.BatchJob("b", "tg:replies:g", 0, (seq,))
    assert p.decode_job(_wire(p.encode_job(job))) == job
    assert job.handoff_pool("r") == "gpu"
    plain = p.encode_job(_job())["m"]
    assert b"handoff" not in plain and b"resume_ids" not in plain
    assert b"messages" not in plain and b"text" not in plain


def test_the_prompt_as_sent_travels_for_an_upstream_engine() -> None:
    chat = p.SeqJob("c", (1, 2), p.SamplingParams(4), messages=(("system", "be brief"), ("user", "hi")))
    text = p.SeqJob("t", (3,), p.SamplingParams(4), text="Once upon")
    job = p.BatchJob("b", "tg:replies:g", 0, (chat, text))
    assert p.decode_job(_wire(p.encode_job(job))) == job


def test_events_round_trip() -> None:
    events: list[p.Event] = [
        p.Delta("r1", "he", 1),
        p.Finished("r1", "", "length", 3, 8),
        p.Failed("r2", "poison", "failed 3 deliveries"),
        p.BatchReport("gw:1", "cpu", "w1", 2, 3, 0.01, 7, 0.2, (8, 5)),
    ]
    assert p.decode_events(_wire(p.encode_events(events))) == events


def test_a_finished_event_carries_the_workers_decode_time_and_fields_a_newer_worker_adds_are_ignored() -> None:
    done = p.Finished("r1", "hello", "stop", 3, 8, decode_s=0.25)
    assert p.decode_events(_wire(p.encode_events([done]))) == [done]
    newer = {"events": [{**{f: getattr(done, f) for f in done.__slots__}, "from_the_future": 1}]}
    assert p.decode_events({b"v": VERSION, b"m": orjson.dumps(newer)}) == [done]
    assert p.Finished("r", "", "stop", 1, 1).decode_s is None  # an older worker's: not measured


def test_heartbeat_round_trip() -> None:
    hb = p.Heartbeat("w1", "cpu", "cpu", "float32", "echo", "m", 32, 30, 12.5, 1.0, "no AMX")
    assert p.decode_heartbeat(p.encode_heartbeat(hb)) == hb


def test_wrong_version_is_refused() -> None:
    fields = _wire(p.encode_job(_job()))
    fields[b"v"] = b"99"
    with pytest.raises(p.ProtocolError, match="version"):
        p.decode_job(fields)


@pytest.mark.parametrize(
    "body",
    [b"not json", b"[1, 2]", orjson.dumps({"batch_id": "x"}), orjson.dumps({"events": [{"kind": "nope"}]})],
)
def test_malformed_entries_raise_protocol_error(body: bytes) -> None:
    with pytest.raises(p.ProtocolError):
        p.decode_job({b"v": VERSION, b"m": body})
    with pytest.raises(p.ProtocolError):
        p.decode_events({b"v": VERSION, b"m": body})


def test_stream_names() -> None:
    assert wire.jobs_stream("m", "gpu") == "{tg:m:m}:jobs:gpu"
    assert wire.replies_stream("m", "g1") == "{tg:m:m}:replies:g1"


def test_heartbeat_carries_in_flight_work() -> None:
    hb = p.Heartbeat("w1", "cpu", "cpu", "float32", "echo", "m", 32, 29, 1.0, 1.0, running=3, batches=("g:1", "g:2"))
    back = p.decode_heartbeat(p.encode_heartbeat(hb))
    assert back == hb and back.batches == ("g:1", "g:2")


def test_heartbeat_without_the_later_fields_still_decodes() -> None:
    old = {"v": p.VERSION, "worker": "w1", "pool": "cpu", "device": "cpu", "dtype": "float32", "engine": "echo",
           "model": "m", "slots": 32, "free": 32, "tokens_per_s": 0.0, "started": 1.0}
    hb = p.decode_heartbeat(orjson.dumps(old))
    assert (hb.choice, hb.running, hb.batches, hb.down, hb.upstream) == ("", 0, (), "", {})


def test_heartbeat_says_why_a_worker_is_down_and_carries_its_upstream_gauges() -> None:
    hb = p.Heartbeat("w1", "cpu", "remote", "upstream", "upstream", "m", 8, 0, 0.0, 1.0,
                     down="upstream http://h:1 does not answer: ConnectError", upstream={"running": 3.0})
    assert p.decode_heartbeat(p.encode_heartbeat(hb)) == hb
    doc = orjson.loads(p.encode_heartbeat(hb))
    doc["upstream"] = {"running": "many"}
    with pytest.raises(p.ProtocolError, match="malformed"):
        p.decode_heartbeat(orjson.dumps(doc))


def test_heartbeat_fields_a_newer_worker_adds_are_ignored() -> None:
    hb = p.Heartbeat("w1", "cpu", "cpu", "float32", "echo", "m", 32, 32, 0.0, 1.0)
    doc = orjson.loads(p.encode_heartbeat(hb))
    doc["from_the_future"] = [1, 2]
    assert p.decode_heartbeat(orjson.dumps(doc)) == hb
    del doc["worker"]
    with pytest.raises(p.ProtocolError, match="malformed"):
        p.decode_heartbeat(orjson.dumps(doc))


def _telemetry(**kw: object) -> p.Telemetry:
    steps = (p.StepRecord(512, 16, 4096, 231.25), p.StepRecord(0, 17, 4625, 80.5))
    fields: dict[str, object] = dict(
        worker="w1", pool="cpu", slots=32, free=15, running=17, queued_prefill=700, step_tokens=256, steps=steps
    )
    fields.update(kw)
    return p.Telemetry(**fields)  # type: ignore[arg-type]


def test_telemetry_round_trip_with_compact_steps() -> None:
    t = _telemetry(dropped=3)
    fields = p.encode_telemetry(t)
    assert p.decode_telemetry(_wire(fields)) == t
    assert fields["v"] == VERSION
    assert orjson.loads(fields["m"])["steps"] == [[512, 16, 4096, 231.25], [0, 17, 4625, 80.5]]


def test_telemetry_versions_and_caps() -> None:
    assert p.VERSION == 2
    assert wire.telemetry_stream("m") == "{tg:m:m}:steps"
    full = _telemetry(steps=(p.StepRecord(1, 1, 1, 1.0),) * p.TELEMETRY_MAX_STEPS)
    assert p.decode_telemetry(_wire(p.encode_telemetry(full))) == full
    fields = _wire(p.encode_telemetry(full))
    fields[b"v"] = b"1"
    with pytest.raises(p.ProtocolError, match="version"):
        p.decode_telemetry(fields)


def _body(**change: object) -> bytes:
    doc = orjson.loads(p.encode_telemetry(_telemetry())["m"])
    doc.update(change)
    return orjson.dumps({k: v for k, v in doc.items() if v is not None})


@pytest.mark.parametrize(
    "body",
    [
        b"not json",
        b"[1]",
        _body(worker=None),
        _body(steps=None),
        _body(free="3"),
        _body(free=-1),
        _body(running=True),
        _body(steps=[[1, 2, 3]]),
        _body(steps=[[1, 2, 3, "4"]]),
        _body(steps=[[1, 2, 3, -4.0]]),
        _body(steps={"a": 1}),
        _body(steps=[[1, 1, 1, 1.0]] * (p.TELEMETRY_MAX_STEPS + 1)),
        _body(pool=7),
    ],
)
def test_malformed_telemetry_raises_protocol_error(body: bytes) -> None:
    with pytest.raises(p.ProtocolError):
        p.decode_telemetry({b"v": VERSION, b"m": body})


def test_heartbeat_carries_the_measured_profile() -> None:
    profile = {"fingerprint": "ab12", "step_model": {"prefill_token": 1e-3}, "facts": {"amx": True}}
    hb = p.Heartbeat("w1", "cpu", "cpu", "bfloat16", "transformers", "m", 8, 8, 0.0, 1.0, profile=profile)
    assert p.decode_heartbeat(p.encode_heartbeat(hb)).profile == profile
    doc = orjson.loads(p.encode_heartbeat(hb))
    doc["profile"] = "fast"
    with pytest.raises(p.ProtocolError, match="malformed"):
        p.decode_heartbeat(orjson.dumps(doc))
