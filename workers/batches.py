"""The batches a worker holds: their state, what each step costs them, their reports, and a
prefill handed over to another pool."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from common import protocol as p
from common import wire
from workers.engine import Handoff, StepResult
from workers.fencing import HandoffWrite, Progress


@dataclass(slots=True)
class Batch:
    """A job the worker runs: its sequences not yet ended, and what it cost so far (for its report)."""

    entry_id: bytes
    job: p.BatchJob
    pending: set[str]
    prefill_s: float = 0.0
    padded_tokens: int = 0
    decode_steps: int = 0
    decode_s: float = 0.0
    running: int = 0  # sum over its decode steps of the sequences each step advanced
    output_tokens: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Admission:
    """A job read from the stream (fresh or reclaimed), before it enters the engine."""

    entry_id: bytes
    job: p.BatchJob
    progress: dict[str, Progress]


def account(result: StepResult, batches: dict[str, Batch], batch_of: dict[str, str]) -> int:
    """Charge one step to the batches whose sequences it ran; the tokens it finished."""
    finished = 0
    for pre in result.prefills:
        # a prefill pass may hold sequences of several batches: each pays its share
        mine: dict[str, int] = {}
        for r in pre.rids:
            if r in batch_of:
                mine[batch_of[r]] = mine.get(batch_of[r], 0) + 1
        for bid, n in mine.items():
            b = batches[bid]
            b.prefill_s += pre.seconds * n / len(pre.rids)
            b.padded_tokens = max(b.padded_tokens, pre.padded_tokens)
    running = len(result.decode_rids)
    for bid in {batch_of[r] for r in result.decode_rids if r in batch_of}:
        b = batches[bid]
        b.decode_steps += 1
        b.decode_s += result.decode_s
        b.running += running
    for ev in result.events:
        if isinstance(ev, p.Finished) and ev.rid in batch_of:
            finished += ev.completion_tokens
            batches[batch_of[ev.rid]].output_tokens[ev.rid] = ev.completion_tokens
    return finished


def report(b: Batch, pool: str, worker: str) -> p.BatchReport:
    return p.BatchReport(
        batch_id=b.job.batch_id,
        pool=pool,
        worker=worker,
        batch_size=len(b.job.seqs),
        prompt_tokens=b.padded_tokens,
        prefill_s=b.prefill_s,
        decode_steps=b.decode_steps,
        decode_s=b.decode_s,
        output_tokens=tuple(b.output_tokens.get(s.rid, 0) for s in b.job.seqs),
        mean_running=b.running / b.decode_steps if b.decode_steps else 0.0,
    )


def handoff_write(b: Batch, h: Handoff, model: str) -> HandoffWrite:
    """Prefill ran here; decoding continues on the handoff pool with this KV cache."""
    from safetensors.torch import save

    target = b.job.handoff_pool(h.seq.rid)
    b.output_tokens[h.seq.rid] = len(h.seq.resume_ids)
    key = wire.kv_key(model, h.seq.rid)
    job = p.BatchJob(f"{b.job.batch_id}/{h.seq.rid}", b.job.reply_to, b.job.bucket, (replace(h.seq, kv_key=key),))
    return HandoffWrite(h.seq.rid, key, save(h.kv), wire.jobs_stream(model, target), p.encode_job(job)["m"])


def leftovers(job: p.BatchJob, finished: list[str], model: str) -> list[str]:
    """The keys a batch's finished sequences leave to delete: a streamed one's progress (written
    as it streams, or by the worker it was reclaimed from) and a handed-over one's KV cache. A
    key none of them wrote is not named (a DEL of it would be a Redis command for nothing)."""
    seqs = {s.rid: s for s in job.seqs}
    keys = [wire.progress_key(model, rid) for rid in finished if rid in seqs and seqs[rid].stream]
    return keys + [kv for rid in finished if rid in seqs and (kv := seqs[rid].kv_key) is not None]
