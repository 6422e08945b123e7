"""The step budget's rule, which the engine runs by and the simulator models (pure)."""

from __future__ import annotations

from common.steps import IDLE_PREFILL_TOKENS, prefill_room


def test_nothing_decoding_or_no_budget_prefills_up_to_the_most() -> None:
    assert prefill_room(64, 0) == IDLE_PREFILL_TOKENS
    assert prefill_room(0, 12) == IDLE_PREFILL_TOKENS
    assert prefill_room(64, 0, most=512) == 512


def test_decoding_sequences_take_their_tokens_but_prefill_keeps_a_quarter() -> None:
    assert prefill_room(64, 8) == 56
    assert prefill_room(64, 60) == 16  # a quarter of the budget, whatever decodes
    assert prefill_room(256, 300) == 64
    assert prefill_room(3, 3) == 1  # never nothing
    assert prefill_room(16384, 8, most=8192) == 8192
