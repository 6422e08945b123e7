"""Prompts to token ids with the model's own tokenizer and chat template."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gateway.errors import InvalidRequest
from gateway.openai_protocol import Generation


class PromptBuilder:
    def __init__(self, tokenizer: Any, context_tokens: int) -> None:
        self.tokenizer = tokenizer
        self.context_tokens = context_tokens
        self.vocab_size = len(tokenizer)
        self._encode_fast = getattr(tokenizer, "backend_tokenizer", None)
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the model's tokenizer has no chat template")

    @classmethod
    def load(cls, model_dir: Path) -> PromptBuilder:
        import json

        from transformers import AutoTokenizer

        config = json.loads((model_dir / "config.json").read_text())
        context = int(config.get("max_position_embeddings", 2048))
        return cls(AutoTokenizer.from_pretrained(model_dir), context)

    def _encode(self, text: str) -> list[int]:
        if self._encode_fast is not None:
            return list(self._encode_fast.encode(text, add_special_tokens=False).ids)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def token_ids(self, gen: Generation) -> list[int]:
        if gen.kind == "chat":
            messages = [{"role": role, "content": text} for role, text in gen.messages]
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            # the template already holds the special tokens; the Rust tokenizer encodes it
            # directly (about half the cost of tokenize=True)
            ids = self._encode(text)
        elif isinstance(gen.prompt, str):
            ids = self._encode(gen.prompt)
            if not ids:
                raise InvalidRequest("The prompt is empty.", param="prompt")
        else:
            ids = list(gen.prompt)
            bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise InvalidRequest(
                    f"Token id {bad} is outside the vocabulary (0..{self.vocab_size - 1}).", param="prompt"
                )
        return ids
