"""The context a request must fit in is the smallest its workers' engines serve (an upstream
started with a smaller context than the model's), and the 400 says so before anything is sent."""

from __future__ import annotations

import pytest

from common import protocol as p
from gateway.api.openai_protocol import parse_chat
from gateway.dispatch.fleet import served_context
from gateway.errors import InvalidRequest
from gateway.tenancy.limits import output_tokens, prompt_limit, prompt_too_long
from gateway.tenancy.tenants import Limits, Tenant

OWN = 8192  # the model's own context (its config's max_position_embeddings)


def hb(wid: str, context: int = 0, pool: str = "cpu", down: str = "") -> p.Heartbeat:
    return p.Heartbeat(wid, pool, "remote", "upstream", "upstream", "m", 1, 1, 0.0, 0.0, down=down,
                       context=context)


def tenant() -> Tenant:
    return Tenant("tn_0000000000000000", "t", 100.0, 100_000, limits=Limits())


def test_the_smallest_context_among_the_workers_is_the_fleets_and_an_unsaid_one_is_the_models() -> None:
    assert served_context({}, OWN) == OWN  # no worker: the model's own
    assert served_context({"a": hb("a")}, OWN) == OWN  # a worker that does not say (transformers)
    assert served_context({"a": hb("a", 4096)}, OWN) == 4096  # an upstream started with --n_ctx 4096
    assert served_context({"a": hb("a", 16384)}, OWN) == 16384  # the engine's word, larger too
    # a job may go to any worker of either pool (the pool's stream, a re-delivery): the smallest
    fleet = {"a": hb("a", 4096), "b": hb("b", 2048, pool="gpu"), "c": hb("c")}
    assert served_context(fleet, OWN) == 2048
    # a worker whose upstream is down now takes jobs again once it answers: it counts
    assert served_context({"a": hb("a", 4096), "b": hb("b", 512, down="upstream does not answer")}, OWN) == 512


def test_a_request_over_the_engines_context_is_refused_naming_it() -> None:
    context = served_context({"a": hb("a", 4096)}, OWN)
    chat = parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert output_tokens(chat, 4000, context, 256, tenant(), own=OWN) == 96  # the default trimmed to the room
    with pytest.raises(InvalidRequest) as info:
        output_tokens(chat, 5030, context, 256, tenant(), own=OWN)  # issue 38's prompt
    err = info.value
    assert (err.status, err.code, err.param) == (400, "context_length_exceeded", "messages")
    assert str(err).startswith("This model's maximum context length is 4096 tokens (as its engines serve it; "
                               "the model's own is 8192). However, you requested 5031 tokens")
    explicit = parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 200})
    with pytest.raises(InvalidRequest) as info:
        output_tokens(explicit, 4000, context, 256, tenant(), own=OWN)  # prompt plus max_tokens over
    assert (info.value.code, info.value.param) == ("context_length_exceeded", "max_tokens")


def test_a_prompt_too_long_for_the_engine_is_cut_short_at_its_context() -> None:
    assert prompt_limit(served_context({"a": hb("a", 512)}, OWN), tenant()) == 511
    chat = parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    err = prompt_too_long(chat, 600, False, 512, tenant(), own=OWN)
    assert err.code == "context_length_exceeded" and "512 tokens (as its engines serve it" in str(err)
    assert "at least 600 tokens" in str(err)
    same = prompt_too_long(chat, 9000, True, OWN, tenant(), own=OWN)  # the model's own: said as before
    assert str(same).startswith("This model's maximum context length is 8192 tokens. However")
