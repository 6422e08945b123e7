"""OpenAI JSON in, internal dataclasses out (and back): the one place that knows both.

Unknown fields are ignored, as many clients send optional OpenAI fields; fields we cannot
honour (``n`` > 1, ``logprobs``, ``tools``, non-zero penalties) are rejected with 400 naming
the field. Every field is bounded before it costs anything (``docs/api.md`` lists the
bounds): numbers have ranges, strings and arrays have sizes, and types are strict (a
number sent as a string is refused, as OpenAI does).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from common.protocol import TEMPERATURE_MAX, SamplingParams
from gateway.api.shapes import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    FinishReason,
    ModelCard,
    ModelList,
    TextCompletion,
    TextCompletionChunk,
    Usage,
)
from gateway.errors import InvalidRequest

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_MESSAGES = 4096  # messages per chat request
MAX_PARTS = 1024  # content parts per message
MAX_PROMPT_IDS = 1 << 17  # token ids in one completion prompt
TOKEN_ID_MAX = INT32_MAX = 2**31 - 1

Short = Annotated[str, Field(max_length=256)]
StopString = Annotated[str, Field(max_length=256)]
Stop = StopString | Annotated[list[StopString], Field(max_length=4)] | None
Penalty = Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)]


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)


# The JSON schemas (``gateway.http.openapi``) of fields whose validators refuse values the type
# admits: the schema says what is accepted; validation is unchanged.
def _only_false_or_null(schema: dict[str, Any]) -> None:
    schema.pop("anyOf", None)
    schema["anyOf"] = [{"const": False}, {"type": "null"}]


def _only_empty_or_null(schema: dict[str, Any]) -> None:
    schema.pop("anyOf", None)
    schema["anyOf"] = [{"type": "array", "maxItems": 0}, {"type": "null"}]


ONLY_ZERO: dict[str, Any] = {"const": 0}
_DEFAULTED = ("Left out or null: the model's own default (its generation_config.json), else the gateway's "
              "(--default-temperature, --default-top-p).")


@dataclass(frozen=True, slots=True)
class SamplingDefaults:
    """What a request that leaves ``temperature`` or ``top_p`` out is sampled with: the
    model's own defaults where its ``generation_config.json`` sets them, else the gateway's
    settings (``--default-temperature``, ``--default-top-p``). Built once at start-up."""

    temperature: float
    top_p: float

    @classmethod
    def of(cls, model: dict[str, float], temperature: float, top_p: float) -> SamplingDefaults:
        """``model``: what the model ships (``model_store.generation_defaults``); the rest
        from the gateway's settings."""
        return cls(model.get("temperature", temperature), model.get("top_p", top_p))


class TextPart(_Model):
    type: Literal["text"]
    text: str


class Message(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[TextPart], Field(max_length=MAX_PARTS)] | None = None
    name: Short | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(_Model):
    include_usage: bool = False


class _Sampling(_Model):
    model: str = Field(min_length=1, max_length=256)
    # left out (or null): the model's own default, else the gateway's (``SamplingDefaults``)
    temperature: float | None = Field(default=None, ge=0.0, le=TEMPERATURE_MAX, allow_inf_nan=False,
                                      description=_DEFAULTED)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0, allow_inf_nan=False, description=_DEFAULTED)
    stop: Stop = None
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=1)
    logprobs: bool | None = Field(default=None, json_schema_extra=_only_false_or_null)
    presence_penalty: Penalty = Field(default=0.0, json_schema_extra=ONLY_ZERO)
    frequency_penalty: Penalty = Field(default=0.0, json_schema_extra=ONLY_ZERO)
    user: Short | None = None
    ignore_eos: bool = False  # vLLM's extension: keep generating until max_tokens

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v: bool | None) -> None:
        if v:
            raise ValueError("logprobs are not supported")
        return None

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalties(cls, v: float) -> float:
        if v != 0.0:
            raise ValueError("penalties are not supported; send 0 or leave the field out")
        return v

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        if isinstance(self.stop, str):
            return (self.stop,) if self.stop else ()
        return tuple(s for s in self.stop if s)


class ChatCompletionRequest(_Sampling):
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    tools: list[Any] | None = Field(default=None, json_schema_extra=_only_empty_or_null)

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, v: list[Any] | None) -> None:
        if v:
            raise ValueError("tool calls are not supported")
        return None


class CompletionRequest(_Sampling):
    prompt: (
        str
        | Annotated[list[str], Field(min_length=1, max_length=1)]
        | Annotated[list[Annotated[int, Field(ge=0, le=TOKEN_ID_MAX)]], Field(min_length=1, max_length=MAX_PROMPT_IDS)]
    )
    max_tokens: int | None = Field(default=16, ge=1, le=INT32_MAX)
    echo: bool = Field(default=False, json_schema_extra={"const": False})

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo is not supported")
        return v


@dataclass(frozen=True, slots=True)
class Generation:
    """A validated request, as the rest of the gateway sees it."""

    kind: Literal["chat", "completion"]
    model: str
    messages: tuple[tuple[str, str], ...]  # chat: (role, text)
    prompt: str | tuple[int, ...]  # completion: text or token ids
    max_tokens: int | None  # None: the gateway's default
    temperature: float | None  # None: the default (``SamplingDefaults``)
    top_p: float | None
    seed: int | None
    stop: tuple[str, ...]
    ignore_eos: bool
    stream: bool
    include_usage: bool
    user: str | None

    def sampling(self, max_tokens: int, defaults: SamplingDefaults) -> SamplingParams:
        """What the worker samples with: the one place a left-out field gets its default."""
        temperature = defaults.temperature if self.temperature is None else self.temperature
        top_p = defaults.top_p if self.top_p is None else self.top_p
        return SamplingParams(max_tokens, temperature, top_p, self.seed, self.stop, self.ignore_eos)

    def source(self) -> dict[str, Any]:
        """The prompt as sent, for the job (``SeqJob.messages``/``text``): an upstream
        engine forwards it in its own form (a completion of token ids needs none)."""
        if self.kind == "chat":
            return {"messages": self.messages}
        return {"text": self.prompt} if isinstance(self.prompt, str) else {}


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "function-after"})


def _param(loc: tuple[int | str, ...]) -> str | None:
    """The field path of a pydantic error, without union/type tags: messages.0.role."""
    parts: list[str] = []
    for x in loc:
        if isinstance(x, int):
            parts.append(str(x))
        elif x.isidentifier() and x not in _TYPE_TAGS:
            parts.append(x)
    return ".".join(parts) or None


def validation_error(exc: ValidationError) -> InvalidRequest:
    # in a union, the branch that got furthest explains best; bare type mismatches least
    err = min(exc.errors(), key=lambda e: (e["type"].endswith("_type"), -len(e["loc"])))
    param = _param(err["loc"])
    msg = err["msg"].removeprefix("Value error, ")
    return InvalidRequest(f"Invalid value for '{param}': {msg}" if param else msg, param=param)


R = TypeVar("R", bound=BaseModel)


def validated(model: type[R], body: Any) -> R:
    """``body`` as ``model`` validates it, or the 400 that names the first field at fault."""
    if not isinstance(body, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc) from None


def _generation(req: ChatCompletionRequest | CompletionRequest, kind: Literal["chat", "completion"],
                messages: tuple[tuple[str, str], ...], prompt: str | tuple[int, ...],
                max_tokens: int | None) -> Generation:
    return Generation(
        kind=kind,
        model=req.model,
        messages=messages,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        seed=req.seed,
        stop=req.stops(),
        ignore_eos=req.ignore_eos,
        stream=req.stream,
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        user=req.user,
    )


def parse_chat(body: Any) -> Generation:
    req = validated(ChatCompletionRequest, body)
    messages = tuple((m.role, m.text()) for m in req.messages)
    return _generation(req, "chat", messages, "", req.max_completion_tokens or req.max_tokens)


def parse_completion(body: Any) -> Generation:
    req = validated(CompletionRequest, body)
    prompt: str | tuple[int, ...]
    if isinstance(req.prompt, str):
        prompt = req.prompt
    elif isinstance(req.prompt[0], str):
        prompt = str(req.prompt[0])
    else:
        prompt = tuple(int(t) for t in req.prompt)
    return _generation(req, "completion", (), prompt, req.max_tokens)


# -- responses ---------------------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int) -> Usage:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def response_id(kind: str, rid: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + rid


def _reason(finish_reason: str) -> FinishReason:
    """A worker's finish reason as the shape declares it (any other reads as ``stop``)."""
    return "length" if finish_reason == "length" else "cancelled" if finish_reason == "cancelled" else "stop"


def completion_body(
    gen: Generation, rid: str, text: str, finish_reason: str, prompt_tokens: int, completion_tokens: int
) -> ChatCompletion | TextCompletion:
    created, reason = int(time.time()), _reason(finish_reason)
    if gen.kind == "chat":
        chat: ChatCompletion = {
            "id": response_id(gen.kind, rid),
            "object": "chat.completion",
            "created": created,
            "model": gen.model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                         "finish_reason": reason}],
            "usage": usage(prompt_tokens, completion_tokens),
        }
        return chat
    plain: TextCompletion = {
        "id": response_id(gen.kind, rid),
        "object": "text_completion",
        "created": created,
        "model": gen.model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": reason}],
        "usage": usage(prompt_tokens, completion_tokens),
    }
    return plain


def chunk_body(
    gen: Generation,
    rid: str,
    created: int,
    text: str | None,
    finish_reason: str | None = None,
    first: bool = False,
) -> ChatCompletionChunk | TextCompletionChunk:
    reason = None if finish_reason is None else _reason(finish_reason)
    if gen.kind == "chat":
        delta: ChatDelta = {}
        if first:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        chat: ChatCompletionChunk = {
            "id": response_id(gen.kind, rid),
            "object": "chat.completion.chunk",
            "created": created,
            "model": gen.model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}],
        }
        if gen.include_usage:
            chat["usage"] = None
        return chat
    plain: TextCompletionChunk = {
        "id": response_id(gen.kind, rid),
        "object": "text_completion",
        "created": created,
        "model": gen.model,
        "choices": [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}],
    }
    if gen.include_usage:
        plain["usage"] = None
    return plain


def usage_chunk(gen: Generation, rid: str, created: int, prompt_tokens: int,
                completion_tokens: int) -> ChatCompletionChunk | TextCompletionChunk:
    """The last event of a stream that asked for usage: no choices, the usage."""
    if gen.kind == "chat":
        chat: ChatCompletionChunk = {"id": response_id(gen.kind, rid), "object": "chat.completion.chunk",
                                     "created": created, "model": gen.model, "choices": [],
                                     "usage": usage(prompt_tokens, completion_tokens)}
        return chat
    plain: TextCompletionChunk = {"id": response_id(gen.kind, rid), "object": "text_completion",
                                  "created": created, "model": gen.model, "choices": [],
                                  "usage": usage(prompt_tokens, completion_tokens)}
    return plain


def model_card(model: str, created: int) -> ModelCard:
    return {"id": model, "object": "model", "created": created, "owned_by": "tokengate"}


def models_body(models: list[str], created: int) -> ModelList:
    return {"object": "list", "data": [model_card(m, created) for m in models]}

