"""What gateways send the elected scheduler, and its answers: encoded and read back."""

from __future__ import annotations

import pytest

from common import protocol as p
from gateway.dispatch import election
from gateway.dispatch.scheduling import Origin
from sched_core import Contract, Reject


def test_an_arrival_reads_back_whole() -> None:
    seq = p.SeqJob("r1", (1, 2, 3), p.SamplingParams(8, temperature=0.5, stop=("x",)), stream=True,
                   messages=(("user", "hi"),))
    who = Origin("t", 250.0, priority=2, budget_wait_s=0.1, deadline_s=3.0, slo_ttft_s=0.5, max_wait_s=None)
    back = election.decode_arrival(election.encode_arrival(seq, who, "tg:replies:g2"))
    assert back == election.Arrival(seq, who, "tg:replies:g2")


def test_decisions_read_back_whole_and_a_baseline_s_admission_carries_none() -> None:
    c = Contract("r", 2, "cpu", 0.1, 0.5, 0.9, 40, 0.0, 0.01, 16, 0.2, 0.02)
    r = Reject("r", "slo", "too slow", 2.0, 0.5, 0.3, 0.9)
    assert election.decode_decision(election.encode_decision("r", c)) == ("r", c)
    assert election.decode_decision(election.encode_decision("r", r)) == ("r", r)
    assert election.decode_decision(election.encode_decision("r", None)) == ("r", None)


def test_notes_name_their_request_and_unreadable_entries_are_protocol_errors() -> None:
    note = election.Note(election.END, "r", ttft_s=0.1, total_s=0.5, tokens=7)
    assert election.decode_entry(election.encode_note(note)) == note
    first = election.Note(election.FIRST, "r", ttft_s=0.1)
    assert election.decode_entry(election.encode_note(first)) == first
    assert election.decode_entry({b"k": b"z", b"m": b"{}"}) is None  # a newer gateway's kind: skipped
    for bad in ({b"m": b"{"}, {b"m": b"[]"}, {}):
        with pytest.raises(p.ProtocolError):
            election.decode_note(bad)
    with pytest.raises(p.ProtocolError):
        election.decode_arrival({b"m": b"{}", b"o": b"{}"})
    with pytest.raises(p.ProtocolError):
        election.decode_decision(b'{"contract": {}}')


def test_a_question_and_its_answer_read_back_and_a_question_names_where_to_answer() -> None:
    fields = election.encode_question(election.Question("r1", "a1", "tg:replies:g2"))
    assert fields[b"k"] == election.QUESTION
    assert election.decode_entry(fields) == election.Question("r1", "a1", "tg:replies:g2")
    explain = {"request_id": "r1", "state": "queued", "requests_ahead": 2}
    assert election.decode_explained(election.encode_explained("a1", explain)) == ("a1", explain)
    assert election.decode_explained(election.encode_explained("a1", None)) == ("a1", None)
    with pytest.raises(p.ProtocolError):
        election.decode_question({**fields, b"m": b'{"rid": "r1", "ask": "a1"}'})
    for raw in (b"{", b'{"ask": "a1"}', b'{"ask": "a1", "explain": [1]}'):
        with pytest.raises(p.ProtocolError):
            election.decode_explained(raw)
