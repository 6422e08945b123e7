"""What an OpenAI-compatible server is sent and what it says (``workers.upstream``'s engine
fronts it): the request body that runs a sequence, the figures of its Prometheus metrics, the
prompt tokens its usage says it found cached, and the context it serves."""

from __future__ import annotations

from typing import Any

from common.protocol import SeqJob

# vLLM's and llama-server's (``--metrics``) Prometheus names, as the heartbeat's upstream
# figures: requests running and waiting, KV-cache use (0-1), and llama-server's counters of the
# prompt tokens it prefilled and the ones it found cached; other upstreams export none of them
UPSTREAM_METRICS = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:gpu_cache_usage_perc": "kv_cache_usage",  # the older name
    "vllm:kv_cache_usage_perc": "kv_cache_usage",
    "llamacpp:requests_processing": "running",
    "llamacpp:requests_deferred": "waiting",
    "llamacpp:kv_cache_usage_ratio": "kv_cache_usage",  # older builds
    "llamacpp:prompt_tokens_total": "prompt_tokens_prefilled",  # computed: the cached ones are not in it
    "llamacpp:prompt_tokens_cached_total": "prompt_tokens_cached",
}


def request_body(seq: SeqJob, model: str) -> tuple[str, dict[str, Any]]:
    """The upstream path and JSON body that run ``seq``: its own chat or completion form."""
    params = seq.params
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": params.max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "stream": True,
        "stream_options": {"include_usage": True},  # the upstream's own counts, where it gives them
    }
    if params.seed is not None:
        body["seed"] = params.seed
    if params.stop:
        body["stop"] = list(params.stop)
    if params.ignore_eos:
        body["ignore_eos"] = True  # vLLM's and llama.cpp's extension; other upstreams ignore it
    if seq.messages:
        # one string per message: a client's list of text parts, joined (``Message.text``)
        body["messages"] = [{"role": role, "content": text} for role, text in seq.messages]
        return "/v1/chat/completions", body
    body["prompt"] = seq.text if seq.text is not None else list(seq.prompt_ids)
    return "/v1/completions", body


def cached_tokens(usage: dict[str, Any] | None) -> int | None:
    """The prompt tokens an upstream found in its prefix cache, as its usage says
    (``prompt_tokens_details.cached_tokens``: llama-server, vLLM); None where it does not say."""
    details = usage.get("prompt_tokens_details") if usage else None
    n = details.get("cached_tokens") if isinstance(details, dict) else None
    return n if isinstance(n, int) else None


def parse_metrics(text: str) -> dict[str, float]:
    """The upstream's figures (``UPSTREAM_METRICS``) from a Prometheus exposition, summed over
    label sets (one per model)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = UPSTREAM_METRICS.get(sample.name)
            if name is not None:
                out[name] = out.get(name, 0.0) + float(sample.value)
    return out


def listed_context(listed: object, model: str) -> int:
    """The context an upstream's ``/v1/models`` gives ``model`` (vLLM's ``max_model_len``), else 0."""
    data = listed.get("data") if isinstance(listed, dict) else None
    entries = [m for m in data if isinstance(m, dict)] if isinstance(data, list) else []
    said = [m.get("max_model_len") for m in sorted(entries, key=lambda m: m.get("id") != model)]  # its own first
    return next((n for n in said if isinstance(n, int) and n > 0), 0)


def props_context(props: object) -> int:
    """A llama-server slot's context from its ``/props`` (``default_generation_settings.n_ctx``:
    older builds give each of ``-np N`` slots its share of ``-c``, newer ones all), else 0."""
    settings = props.get("default_generation_settings") if isinstance(props, dict) else None
    n = settings.get("n_ctx") if isinstance(settings, dict) else None
    return n if isinstance(n, int) and n > 0 else 0
