"""The upstream engine's pure parts: the request it sends for a sequence, and vLLM's gauges."""

from __future__ import annotations

from common import protocol as p
from workers.upstream_api import cached_tokens, parse_metrics, request_body

GREEDY = p.SamplingParams(12, temperature=0.0)


def test_a_chat_goes_to_chat_completions_with_its_messages_and_sampling() -> None:
    seq = p.SeqJob("r", (1, 2, 3), p.SamplingParams(20, 0.7, 0.9, seed=5, stop=("\n",)), stream=False,
                   messages=(("system", "be brief"), ("user", "hi")))
    path, body = request_body(seq, "smollm")
    assert path == "/v1/chat/completions"
    assert body["messages"] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert (body["model"], body["max_tokens"], body["temperature"], body["top_p"]) == ("smollm", 20, 0.7, 0.9)
    assert (body["seed"], body["stop"], body["stream"]) == (5, ["\n"], True)  # streamed upstream even so
    assert body["stream_options"] == {"include_usage": True}
    assert "prompt" not in body and "ignore_eos" not in body


def test_a_completion_goes_to_completions_with_its_text_or_its_token_ids() -> None:
    path, body = request_body(p.SeqJob("r", (7, 8), GREEDY, text="Once upon"), "m")
    assert (path, body["prompt"]) == ("/v1/completions", "Once upon")
    assert "seed" not in body and "stop" not in body
    _, body = request_body(p.SeqJob("r", (7, 8), p.SamplingParams(4, 0.0, ignore_eos=True)), "m")
    assert body["prompt"] == [7, 8] and body["ignore_eos"] is True


VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests currently running on GPU.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="meta-llama/Llama-3.1-8B-Instruct"} 2.0
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.25
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{model_name="meta-llama/Llama-3.1-8B-Instruct"} 1234.0
"""


def test_vllms_gauges_are_read_and_other_metrics_ignored() -> None:
    assert parse_metrics(VLLM_METRICS) == {"running": 3.0, "waiting": 2.0, "kv_cache_usage": 0.25}
    newer = VLLM_METRICS.replace("gpu_cache_usage_perc", "kv_cache_usage_perc")
    assert parse_metrics(newer)["kv_cache_usage"] == 0.25
    assert parse_metrics("# an upstream with other metrics\nprocess_cpu_seconds_total 4.5\n") == {}


#: llama-server 0.5.0-dev (the pinned llama-cpp-python 0.3.36's vendored source) with --metrics, abridged
LLAMA_SERVER_METRICS = """# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 33
# HELP llamacpp:prompt_tokens_cached_total Number of prompt tokens served from the cache.
# TYPE llamacpp:prompt_tokens_cached_total counter
llamacpp:prompt_tokens_cached_total 31
# HELP llamacpp:n_decode_total Total number of llama_decode() calls
# TYPE llamacpp:n_decode_total counter
llamacpp:n_decode_total 5
# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 2
# HELP llamacpp:requests_deferred Number of requests deferred.
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 1
"""


def test_llama_servers_metrics_are_read_under_the_same_names() -> None:
    assert parse_metrics(LLAMA_SERVER_METRICS) == {"running": 2.0, "waiting": 1.0, "prompt_tokens_prefilled": 33.0,
                                                   "prompt_tokens_cached": 31.0}


def test_the_cached_prompt_tokens_come_from_the_usage_where_it_says_them() -> None:
    assert cached_tokens({"prompt_tokens": 32, "prompt_tokens_details": {"cached_tokens": 31}}) == 31
    assert cached_tokens({"prompt_tokens": 32}) is None and cached_tokens(None) is None
