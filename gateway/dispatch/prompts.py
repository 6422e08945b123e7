"""Prompts to token ids with the model's own tokenizer and chat template.

Tokenizing is the one expensive thing the gateway does before a request is admitted, so it
is bounded: ``token_ids`` takes the most tokens the request may have (``limit``) and
refuses a text that certainly exceeds it without tokenizing all of it:

- a text longer than ``limit · longest token`` characters cannot fit (no token covers more
  characters than the vocabulary's longest), so it is refused before any tokenizing;
- otherwise a prefix of about ``PREFIX_CHARS_PER_TOKEN · limit`` characters is tokenized
  first; a prefix that alone exceeds the limit refuses the text;
- only a text that passes both is tokenized whole.

The work per refused request is therefore bounded by the limit, not by the body size.
Prompts of at most ``PROMPT_CACHE_CHARS`` characters skip the prefix: they are tokenized
whole, once, and kept (an LRU of ``PROMPT_CACHE_ENTRIES``), so a prompt sent again (a
client's fixed conversation, a retry, a benchmark's body) costs a dictionary lookup.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from gateway.api.openai_protocol import Generation
from gateway.errors import RETRY_AFTER_S, InvalidRequest, Overloaded, RateLimited
from gateway.tenancy.tenants import Tenant

PROMPT_CACHE_ENTRIES = 1024  # tokenized prompts (conversations, completion texts) kept per gateway process
PROMPT_CACHE_CHARS = 8192  # only prompts this short are kept: about 2 MiB of token ids at most
PREFIX_CHARS_PER_TOKEN = 8  # prose averages ~4 characters per token; code and digits fewer


class PromptTooLong(Exception):
    """The prompt has ``tokens`` tokens (at least that many unless ``exact``), more than the
    limit it was checked against; ``gateway.tenancy.limits.prompt_too_long`` words the 400."""

    def __init__(self, tokens: int, exact: bool = False) -> None:
        super().__init__(tokens)
        self.tokens = tokens
        self.exact = exact


class PromptBuilder:
    def __init__(self, tokenizer: Any, context_tokens: int) -> None:
        self.tokenizer = tokenizer
        self.context_tokens = context_tokens
        self.vocab_size = len(tokenizer)
        self._fast = getattr(tokenizer, "backend_tokenizer", None)
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the model's tokenizer has no chat template")
        self.longest_token_chars = max(
            1, max(len(tokenizer.convert_tokens_to_string([t])) for t in tokenizer.get_vocab())
        )
        # the same prompt (a client's fixed conversation, a retry, a benchmark's body) is rendered
        # and tokenized once: for a 1 KB chat that is ~200 us of template and tokenizer per request
        self._cached_ids = functools.lru_cache(maxsize=PROMPT_CACHE_ENTRIES)(self._ids)

    @classmethod
    def load(cls, model_dir: Path) -> PromptBuilder:
        import json

        from transformers import AutoTokenizer

        config = json.loads((model_dir / "config.json").read_text())
        context = int(config.get("max_position_embeddings", 2048))
        return cls(AutoTokenizer.from_pretrained(model_dir), context)

    def _encode(self, text: str) -> list[int]:
        if self._fast is not None:
            # encode_batch releases the GIL while the Rust tokenizer runs (encode does not)
            return list(self._fast.encode_batch([text], add_special_tokens=False)[0].ids)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _render(self, conversation: tuple[tuple[str, str], ...]) -> str:
        messages = [{"role": role, "content": text} for role, text in conversation]
        # the template already holds the special tokens; the Rust tokenizer encodes it
        # directly (about half the cost of tokenize=True)
        return str(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))

    def _ids(self, prompt: tuple[tuple[str, str], ...] | str) -> tuple[int, ...]:
        """A conversation's or a text's token ids, whole (only for prompts short enough to cache)."""
        return tuple(self._encode(prompt if isinstance(prompt, str) else self._render(prompt)))

    def text(self, gen: Generation) -> str | None:
        """The text to tokenize (the chat template applied), or None for token ids."""
        if gen.kind == "chat":
            return self._render(gen.messages)
        return gen.prompt if isinstance(gen.prompt, str) else None

    @staticmethod
    def chars(gen: Generation) -> int:
        """The prompt's characters (token ids count one each): cheap, before any template."""
        if gen.kind == "chat":
            return sum(len(text) for _role, text in gen.messages)
        return len(gen.prompt)

    def token_ids(self, gen: Generation, limit: int) -> tuple[int, ...]:
        """The prompt's token ids; PromptTooLong when it has more than ``limit`` tokens
        (see the module docstring for how little work that takes)."""
        if gen.kind == "completion" and not isinstance(gen.prompt, str):  # token ids
            ids = gen.prompt
            bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise InvalidRequest(
                    f"Token id {bad} is outside the vocabulary (0..{self.vocab_size - 1}).", param="prompt"
                )
        else:
            chars = self.chars(gen)
            if chars > limit * self.longest_token_chars:  # cannot fit, however it tokenizes
                raise PromptTooLong(chars // self.longest_token_chars)
            if chars <= PROMPT_CACHE_CHARS:
                ids = self._cached_ids(gen.messages if gen.kind == "chat" else gen.prompt)
            else:
                ids = self._bounded(str(self.text(gen)), limit)
            if gen.kind == "completion" and not ids:
                raise InvalidRequest("The prompt is empty.", param="prompt")
        if len(ids) > limit:
            raise PromptTooLong(len(ids), exact=True)
        return ids

    def _bounded(self, text: str, limit: int) -> tuple[int, ...]:
        """A long text's ids, refusing it with as little tokenizing as its length allows."""
        if len(text) > limit * self.longest_token_chars:
            raise PromptTooLong(len(text) // self.longest_token_chars)
        prefix = limit * PREFIX_CHARS_PER_TOKEN
        if len(text) > prefix:
            # cut at a space so the prefix tokenizes as the start of the whole text does
            cut = text.find(" ", prefix)
            head = self._encode(text[: cut if cut > 0 else prefix])
            if len(head) > limit + 1:  # +1: the cut may split one token in two
                raise PromptTooLong(len(head) - 1)
        return tuple(self._encode(text))


LARGE_PROMPT_CHARS = 4096  # prompts longer than this are tokenized off the event loop
LARGE_PROMPTS_PER_TENANT = 2  # ... at most this many at a time per tenant (429 beyond)
LARGE_PROMPTS_QUEUED = 16  # ... and this many in all (503 beyond)


class LongPrompts:
    """The thread long prompts are tokenized on, and how many each tenant has there: at most
    ``LARGE_PROMPTS_PER_TENANT`` at once per tenant, ``LARGE_PROMPTS_QUEUED`` in all, so one
    sender of huge prompts slows only itself. A request's life takes its place (``held``)."""

    def __init__(self) -> None:
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        self._held: dict[str, int] = {}  # tenant id -> long prompts being tokenized

    @contextlib.contextmanager
    def held(self, tenant: Tenant) -> Iterator[None]:
        """One place for ``tenant``'s long prompt, or the refusal: 429 for the tenant's own
        limit (with Retry-After), 503 for the gateway's."""
        busy = self._held.get(tenant.id, 0)
        if busy >= LARGE_PROMPTS_PER_TENANT:
            raise RateLimited(
                f"Rate limit reached for tenant '{tenant.name}': it already has {busy} long prompts (over "
                f"{LARGE_PROMPT_CHARS} characters) being tokenized, the limit per tenant "
                f"({LARGE_PROMPTS_PER_TENANT} at once, whatever its max_concurrent). Retry after {RETRY_AFTER_S} s, "
                "or when they are done.",
                headers={"retry-after": str(RETRY_AFTER_S)},
            )
        if sum(self._held.values()) >= LARGE_PROMPTS_QUEUED:
            raise Overloaded("Too many long prompts are being tokenized; retry shortly.")
        self._held[tenant.id] = busy + 1
        try:
            yield
        finally:
            left = self._held[tenant.id] - 1
            if left:
                self._held[tenant.id] = left
            else:
                del self._held[tenant.id]

    async def run(self, prompts: PromptBuilder, gen: Generation, limit: int) -> tuple[int, ...]:
        return await asyncio.get_running_loop().run_in_executor(self._thread, prompts.token_ids, gen, limit)

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)
