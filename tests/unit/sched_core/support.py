"""Helpers for the sched_core tests."""

from __future__ import annotations

from sched_core import BatchTimings, Dispatch, PathConfig, Request


def req(rid: str, *, tenant: str = "t", weight: float = 1000.0, prompt: int = 100,
        max_tokens: int = 64, arrival: float = 0.0, out: int = 32, **more: object) -> Request:
    """A request with defaults that keep the tests short."""
    return Request(id=rid, tenant=tenant, weight=weight, prompt_tokens=prompt,
                   max_tokens=max_tokens, arrival=arrival, expected_output_tokens=out,
                   **more)  # type: ignore[arg-type]


def timings(d: Dispatch, outputs: tuple[int, ...] | None = None, prompt: int = 128,
            prefill_s: float = 0.05, decode_s: float = 0.2) -> BatchTimings:
    """A worker's report for ``d``; every request produces 8 tokens unless told."""
    outs = outputs if outputs is not None else (8,) * len(d.request_ids)
    return BatchTimings(batch_id=d.batch_id, path=d.path, batch_size=len(d.request_ids),
                        prompt_tokens=prompt, prefill_s=prefill_s,
                        decode_steps=max(outs, default=0), decode_s=decode_s, output_tokens=outs)


def batch_line(c: PathConfig, bound: int, nbar: float, running: float = 0.0,
               kv: float = 0.0) -> tuple[float, float]:
    """The documented batch line ``S(B) = F + m·B`` of a path for a bucket of ``bound``
    prompt tokens and ``nbar`` output tokens, next to ``running`` sequences holding ``kv``
    KV tokens on one worker: the prompt prefills in chunks of the step budget less the
    running sequences (at least a quarter of it), each chunk a step that also decodes them
    (in one pass when nothing runs); then ``nbar`` decode steps of everything."""
    step = c.decode_launch + c.decode_seq * running + c.kv_token * kv
    fixed = c.prefill_launch + (step if running > 0 else 0.0)
    chunk = max(c.step_tokens - running, 0.25 * c.step_tokens)
    share = fixed / chunk if running > 0 else 0.0
    f = fixed + nbar * step
    m = bound * (share + c.prefill_token) + nbar * (
        c.decode_seq + c.kv_token * (bound + 0.5 * nbar))
    return f, m
