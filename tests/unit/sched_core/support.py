"""Helpers for the sched_core tests."""

from __future__ import annotations

from sched_core import BatchTimings, Dispatch, Request


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
