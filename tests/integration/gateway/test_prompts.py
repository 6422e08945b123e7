"""Tokenizing is bounded by the limit, not by the body (the real tokenizer)."""

from __future__ import annotations

import pytest

from gateway.api.openai_protocol import parse_chat, parse_completion
from gateway.dispatch.prompts import PREFIX_CHARS_PER_TOKEN, PromptBuilder, PromptTooLong


class Spy:
    def __init__(self, prompts: PromptBuilder) -> None:
        self.lengths: list[int] = []
        self._encode = prompts._encode

    def __call__(self, text: str) -> list[int]:
        self.lengths.append(len(text))
        return self._encode(text)


@pytest.fixture
def spy(prompts: PromptBuilder, monkeypatch: pytest.MonkeyPatch) -> Spy:
    s = Spy(prompts)
    monkeypatch.setattr(prompts, "_encode", s)
    return s


def _completion(text: str):  # type: ignore[no-untyped-def]
    return parse_completion({"model": "m", "prompt": text})


def test_a_text_no_tokenization_could_fit_is_refused_untokenized(prompts: PromptBuilder, spy: Spy) -> None:
    limit = 100
    with pytest.raises(PromptTooLong) as info:
        prompts.token_ids(_completion("x" * (limit * prompts.longest_token_chars + 1)), limit)
    assert spy.lengths == [] and info.value.tokens >= limit and not info.value.exact


def test_a_long_text_is_refused_after_tokenizing_a_prefix_only(prompts: PromptBuilder, spy: Spy) -> None:
    limit = 400
    text = "hello world " * 2000  # 24,000 characters, about 4,000 tokens
    assert len(text) < limit * prompts.longest_token_chars  # the character bound alone cannot tell
    with pytest.raises(PromptTooLong) as info:
        prompts.token_ids(_completion(text), limit)
    assert len(spy.lengths) == 1 and spy.lengths[0] <= limit * PREFIX_CHARS_PER_TOKEN + 10
    assert info.value.tokens > limit


def test_a_prompt_within_the_limit_gets_exactly_the_ids_of_the_whole_text(prompts: PromptBuilder, spy: Spy) -> None:
    text = "hello world " * 50
    ids = prompts.token_ids(_completion(text), 1000)
    assert list(ids) == spy._encode(text)
    chat = parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert list(prompts.token_ids(chat, 1000)) == spy._encode(str(prompts.text(chat)))
    with pytest.raises(PromptTooLong) as info:
        prompts.token_ids(_completion(text), len(ids) - 1)
    assert info.value.exact and info.value.tokens == len(ids)


def test_a_prompt_is_tokenized_once_and_a_long_one_is_not_kept(prompts: PromptBuilder, spy: Spy) -> None:
    from gateway.dispatch.prompts import PROMPT_CACHE_CHARS

    chat = parse_chat({"model": "m", "messages": [{"role": "user", "content": "cache me, once"}]})
    first = prompts.token_ids(chat, 1000)
    assert prompts.token_ids(chat, 1000) == first and len(spy.lengths) == 1  # the second is the cached ids
    other = parse_chat({"model": "m", "messages": [{"role": "user", "content": "cache me, twice"}]})
    assert prompts.token_ids(other, 1000) != first and len(spy.lengths) == 2
    text = _completion("cache me, once")  # a completion's text is kept apart from the conversation
    assert prompts.token_ids(text, 1000) != first and len(spy.lengths) == 3
    with pytest.raises(PromptTooLong):  # a cached prompt is still held to each request's limit
        prompts.token_ids(chat, len(first) - 1)
    assert len(spy.lengths) == 3
    long = parse_chat({"model": "m", "messages": [{"role": "user", "content": "x " * (PROMPT_CACHE_CHARS // 2 + 1)}]})
    prompts.token_ids(long, 100_000)
    prompts.token_ids(long, 100_000)
    assert len(spy.lengths) == 5  # too long to keep: tokenized each time
