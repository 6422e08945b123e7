"""The official openai client against `tokengate serve` with the real model."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from tests.e2e.conftest import Served

pytestmark = [pytest.mark.e2e, pytest.mark.model]

HELLO = [{"role": "user", "content": "Say hello."}]


@pytest.fixture
def client(served: Served) -> openai.OpenAI:
    base = served.base_url + "/v1"
    return openai.OpenAI(base_url=base, api_key=served.key, max_retries=0, timeout=120)


def test_chat_non_streaming(client: openai.OpenAI, served: Served) -> None:
    r = client.chat.completions.create(model=served.model, messages=HELLO, max_tokens=8, temperature=0)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage is not None and r.usage.prompt_tokens > 5
    assert 1 <= r.usage.completion_tokens <= 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_streaming_matches_non_streaming(client: openai.OpenAI, served: Served) -> None:
    kw = {"model": served.model, "messages": HELLO, "max_tokens": 12, "temperature": 0}
    whole = client.chat.completions.create(**kw)  # type: ignore[call-overload]
    stream = client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_completions_with_stop_and_seed(client: openai.OpenAI, served: Served) -> None:
    r = client.completions.create(model=served.model, prompt="One, two, three,", max_tokens=10, temperature=0)
    assert r.object == "text_completion" and r.choices[0].text
    stopped = client.completions.create(
        model=served.model, prompt="One, two, three,", max_tokens=10, temperature=0, stop=[","]
    )
    assert "," not in stopped.choices[0].text and stopped.choices[0].finish_reason == "stop"
    a, b = (
        client.completions.create(model=served.model, prompt="Once upon", max_tokens=8, temperature=1.0, seed=11)
        for _ in range(2)
    )
    assert a.choices[0].text == b.choices[0].text


def test_completions_streaming(client: openai.OpenAI, served: Served) -> None:
    chunks = list(client.completions.create(model=served.model, prompt="Hello", max_tokens=5, stream=True))
    assert sum(len(c.choices[0].text) for c in chunks) > 0
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_models_list(client: openai.OpenAI, served: Served) -> None:
    assert [m.id for m in client.models.list()] == [served.model]


def test_models_retrieve(client: openai.OpenAI, served: Served) -> None:
    model = client.models.retrieve(served.model)
    assert (model.id, model.object, model.owned_by) == (served.model, "model", "tokengate")
    assert model == next(iter(client.models.list()))
    for unknown in ("gpt-17", "org/some-model"):  # the client sends a '/' as %2F
        with pytest.raises(openai.NotFoundError) as info:
            client.models.retrieve(unknown)
        assert info.value.code == "model_not_found" and info.value.body["param"] is None  # type: ignore[index]
        assert unknown in info.value.message


def test_invalid_request_raises_bad_request(client: openai.OpenAI, served: Served) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=served.model, messages=HELLO, temperature=5)
    assert info.value.body["param"] == "temperature"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=served.model, messages=[])
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=served.model, messages=HELLO, max_tokens=100_000)
    assert info.value.code == "context_length_exceeded"


def test_a_wrong_key_raises_authentication_error(served: Served) -> None:
    wrong = served.key[:-3] + "xyz"
    bad = openai.OpenAI(base_url=served.base_url + "/v1", api_key=wrong, max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        bad.chat.completions.create(model=served.model, messages=HELLO)
    assert info.value.code == "invalid_api_key" and served.key[12:] not in str(info.value)


def test_a_cut_stream_is_charged_what_was_generated(served: Served) -> None:
    body = {"model": served.model, "messages": HELLO, "max_tokens": 200, "stream": True}
    url = served.base_url + "/v1/chat/completions"
    with httpx.stream("POST", url, json=body, headers=served.auth()) as r:
        rid = r.headers["x-request-id"]
        for line in r.iter_lines():
            if '"content":"' in line and '"content":""' not in line:
                break  # the first generated text: hang up
    deadline = time.monotonic() + 30
    record: dict[str, object] = {}
    while time.monotonic() < deadline:
        record = httpx.get(f"{served.base_url}/v1/requests/{rid}", headers=served.auth()).json()
        if record["state"] != "admitted":
            break
        time.sleep(0.1)
    assert record["state"] == "cancelled"
    prompt = int(record["prompt_tokens"])  # type: ignore[call-overload]
    assert prompt < int(record["charged_tokens"]) < prompt + 200  # type: ignore[call-overload]


def test_unknown_model_raises_not_found(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-17", messages=HELLO)
    assert info.value.code == "model_not_found"


@pytest.mark.parametrize(
    ("content", "body", "status"),
    [
        ("application/json", b"{not json", 400),
        ("application/json", b"[]", 400),
        ("application/json", b'{"model": "x", "messages": "' + b"a" * 70_000 + b'"}', 413),
    ],
)
def test_bad_bodies_never_give_5xx(served: Served, content: str, body: bytes, status: int) -> None:
    headers = {"content-type": content, **served.auth()}
    r = httpx.post(served.base_url + "/v1/chat/completions", content=body, headers=headers)
    assert r.status_code == status
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_health_ready_metrics(served: Served) -> None:
    assert httpx.get(served.base_url + "/healthz").json() == {"status": "ok"}
    ready = httpx.get(served.base_url + "/readyz").json()
    assert ready["ready"] and ready["pools"] == ["cpu"]
    metrics = httpx.get(served.base_url + "/metrics").text
    assert f'tokengate_requests_total{{model="{served.model}",route="chat",status="200"}}' in metrics
    assert "tokengate_request_latency_seconds_bucket" in metrics
