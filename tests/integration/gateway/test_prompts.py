"""Tokenizing is bounded by the limit, not by the body (the real tokenizer)."""

from __future__ import annotations

import pytest

from gateway.openai_protocol import parse_chat, parse_completion
from gateway.prompts import PREFIX_CHARS_PER_TOKEN, PromptBuilder, PromptTooLong


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
    assert ids == spy._encode(text)
    chat = parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert prompts.token_ids(chat, 1000) == spy._encode(str(prompts.text(chat)))
    with pytest.raises(PromptTooLong) as info:
        prompts.token_ids(_completion(text), len(ids) - 1)
    assert info.value.exact and info.value.tokens == len(ids)


def test_a_conversation_is_rendered_once_and_a_long_one_is_not_kept(
    prompts: PromptBuilder, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gateway.prompts import TEMPLATE_CACHE_CHARS

    calls: list[int] = []
    render = prompts.tokenizer.apply_chat_template

    def counting(messages, **kw):  # type: ignore[no-untyped-def]
        calls.append(len(messages))
        return render(messages, **kw)

    monkeypatch.setattr(prompts.tokenizer, "apply_chat_template", counting)
    chat = parse_chat({"model": "m", "messages": [{"role": "user", "content": "cache me, once"}]})
    first = prompts.text(chat)
    assert prompts.text(chat) == first and calls == [1]  # the second is the cached text
    other = parse_chat({"model": "m", "messages": [{"role": "user", "content": "cache me, twice"}]})
    assert prompts.text(other) != first and calls == [1, 1]
    long = parse_chat({"model": "m", "messages": [{"role": "user", "content": "x" * (TEMPLATE_CACHE_CHARS + 1)}]})
    prompts.text(long)
    prompts.text(long)
    assert calls == [1, 1, 1, 1]  # too long to keep: rendered each time
