"""The keys a finished batch leaves to delete: only those its sequences wrote."""

from __future__ import annotations

from common import protocol as p
from common import wire
from workers.batches import leftovers

GREEDY = p.SamplingParams(8, temperature=0.0)


def test_only_a_streamed_sequences_progress_and_a_handed_over_ones_kv_cache_are_deleted() -> None:
    job = p.BatchJob("b", "replies", 0, (
        p.SeqJob("plain", (1, 2), GREEDY),
        p.SeqJob("streamed", (1, 2), GREEDY, stream=True),
        p.SeqJob("moved", (1, 2), GREEDY, kv_key=wire.kv_key("m", "moved")),
    ))
    assert leftovers(job, ["plain"], "m") == []
    assert leftovers(job, ["plain", "streamed", "moved"], "m") == [wire.progress_key("m", "streamed"),
                                                                   wire.kv_key("m", "moved")]
    assert leftovers(job, ["not-in-this-batch"], "m") == []
