"""What an upstream says of the context it serves: vLLM's ``/v1/models`` and llama-server's
``/props``; and the context travels in the heartbeat."""

from __future__ import annotations

from common import protocol as p
from workers.upstream_api import listed_context, props_context, request_body


def test_vllms_model_list_says_its_max_model_len() -> None:
    listed = {"object": "list", "data": [
        {"id": "other", "object": "model", "max_model_len": 2048},
        {"id": "meta-llama/Llama-3.1-8B-Instruct", "object": "model", "max_model_len": 32768},
    ]}
    assert listed_context(listed, "meta-llama/Llama-3.1-8B-Instruct") == 32768  # the model's own entry
    assert listed_context(listed, "unknown") == 2048  # else the first that says
    # llama-cpp-python's server and llama-server list no context (their meta's n_ctx_train is the training one)
    assert listed_context({"data": [{"id": "m", "object": "model", "owned_by": "me", "permissions": []}]}, "m") == 0
    assert listed_context({"data": [{"id": "m", "meta": {"n_ctx_train": 8192}}]}, "m") == 0
    assert listed_context({"data": "odd"}, "m") == listed_context([], "m") == 0


def test_llama_servers_props_say_a_slots_context() -> None:
    props = {"default_generation_settings": {"id": 0, "n_ctx": 4096, "params": {}}, "total_slots": 2}
    assert props_context(props) == 4096
    assert props_context({"detail": "Not Found"}) == props_context({"default_generation_settings": {}}) == 0
    assert props_context({"default_generation_settings": {"n_ctx": "4096"}}) == props_context(None) == 0


def test_the_context_travels_in_the_heartbeat_and_an_older_one_reads_as_unsaid() -> None:
    hb = p.Heartbeat("w", "cpu", "remote", "upstream", "upstream", "m", 1, 1, 0.0, 0.0, context=4096)
    assert p.decode_heartbeat(p.encode_heartbeat(hb)).context == 4096
    older = p.encode_heartbeat(p.Heartbeat("w", "cpu", "remote", "upstream", "upstream", "m", 1, 1, 0.0, 0.0))
    assert p.decode_heartbeat(older.replace(b',"context":0', b"")).context == 0


def test_a_chat_of_text_parts_reaches_the_upstream_as_one_string_per_message() -> None:
    from gateway.api.openai_protocol import parse_chat

    gen = parse_chat({"model": "m", "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "Name three "}, {"type": "text", "text": "colours."}]},
    ]})
    seq = p.SeqJob("r", (1, 2), p.SamplingParams(8, temperature=0.0), **gen.source())
    _path, body = request_body(seq, "m")
    assert body["messages"] == [{"role": "system", "content": "be brief"},
                                {"role": "user", "content": "Name three colours."}]
