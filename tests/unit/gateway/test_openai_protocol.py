from typing import Any

import pytest

from gateway.api.openai_protocol import SamplingDefaults, chunk_body, completion_body, parse_chat, parse_completion
from gateway.errors import InvalidRequest

MSG = [{"role": "user", "content": "hi"}]


def _chat(**kw: Any) -> dict[str, Any]:
    return {"model": "m", "messages": MSG, **kw}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "m"}, "messages"),
        (_chat(messages=[]), "messages"),
        (_chat(messages=[{"role": "robot", "content": "x"}]), "messages.0.role"),
        (_chat(temperature=3), "temperature"),
        (_chat(top_p=0), "top_p"),
        (_chat(max_tokens=0), "max_tokens"),
        (_chat(max_completion_tokens=-1), "max_completion_tokens"),
        (_chat(stop=["a", "b", "c", "d", "e"]), "stop"),
        (_chat(n=2), "n"),
        (_chat(logprobs=True), "logprobs"),
        (_chat(tools=[{"type": "function"}]), "tools"),
        (_chat(model=""), "model"),
        (_chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), "messages.0.content.0.type"),
    ],
)
def test_invalid_chat_names_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_chat(body)
    assert info.value.param == param
    assert info.value.status == 400
    assert param in info.value.message


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "m"}, "prompt"),
        ({"model": "m", "prompt": []}, "prompt"),
        ({"model": "m", "prompt": ["a", "b"]}, "prompt"),
        ({"model": "m", "prompt": "x", "echo": True}, "echo"),
    ],
)
def test_invalid_completion_names_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_completion(body)
    assert info.value.param == param


@pytest.mark.parametrize("body", [[], "x", 3, None])
def test_body_must_be_an_object(body: Any) -> None:
    with pytest.raises(InvalidRequest):
        parse_chat(body)
    with pytest.raises(InvalidRequest):
        parse_completion(body)


def test_chat_translation() -> None:
    gen = parse_chat(
        _chat(
            messages=[
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            ],
            max_tokens=7,
            max_completion_tokens=5,
            temperature=0,
            stop="END",
            seed=3,
            stream=True,
            stream_options={"include_usage": True},
            unknown_field="ignored",
        )
    )
    assert gen.messages == (("system", "be brief"), ("user", "ab"))
    assert gen.max_tokens == 5  # max_completion_tokens wins
    params = gen.sampling(5, SamplingDefaults(0.7, 0.8))
    assert (params.temperature, params.seed, params.stop, params.greedy) == (0.0, 3, ("END",), True)
    assert gen.stream and gen.include_usage


@pytest.mark.parametrize("parse", [parse_chat, parse_completion])
def test_a_left_out_sampling_field_gets_the_default_and_a_sent_one_is_kept(parse: Any) -> None:
    defaults = SamplingDefaults(0.2, 0.9)
    body = _chat(prompt="hi")
    for sent, wanted in [({}, (0.2, 0.9)), ({"temperature": None, "top_p": None}, (0.2, 0.9)),
                         ({"temperature": 1.0}, (1.0, 0.9)), ({"top_p": 1.0}, (0.2, 1.0)),
                         ({"temperature": 0, "top_p": 0.5}, (0.0, 0.5))]:
        params = parse({**body, **sent}).sampling(4, defaults)
        assert (params.temperature, params.top_p) == wanted, sent


def test_the_model_s_own_defaults_win_over_the_gateway_s() -> None:
    assert SamplingDefaults.of({}, 0.2, 0.9) == SamplingDefaults(0.2, 0.9)
    assert SamplingDefaults.of({"temperature": 0.6}, 0.2, 0.9) == SamplingDefaults(0.6, 0.9)
    assert SamplingDefaults.of({"temperature": 0.6, "top_p": 0.95}, 0.2, 0.9) == SamplingDefaults(0.6, 0.95)


def test_completion_prompt_forms() -> None:
    assert parse_completion({"model": "m", "prompt": "hi"}).prompt == "hi"
    assert parse_completion({"model": "m", "prompt": ["hi"]}).prompt == "hi"
    assert parse_completion({"model": "m", "prompt": [1, 2]}).prompt == (1, 2)
    assert parse_completion({"model": "m", "prompt": "hi"}).max_tokens == 16  # OpenAI's default


def test_bodies_have_openai_shape() -> None:
    gen = parse_chat(_chat(stream=True, stream_options={"include_usage": True}))
    body = completion_body(gen, "r1", "hello", "stop", 3, 2)
    assert body["object"] == "chat.completion" and body["id"] == "chatcmpl-r1"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "hello"}
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    chunk = chunk_body(gen, "r1", 0, "", first=True)
    assert chunk["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunk["usage"] is None
    comp = parse_completion({"model": "m", "prompt": "x"})
    assert completion_body(comp, "r2", "y", "length", 1, 1)["choices"][0]["text"] == "y"
