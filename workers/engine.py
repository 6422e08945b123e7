"""The engine interface a worker drives, and the model-free echo engine used by benchmarks.

An engine runs iteration-level (continuous) batching: ``add`` queues a sequence, each
``step`` admits waiting sequences (prefill) and advances every running one by one token.
Engines do no I/O; the worker moves their events to Redis.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from common.protocol import Delta, Failed, Finished, SeqJob, StepRecord


@dataclass(frozen=True, slots=True)
class Prefill:
    """One prefill pass: whole prompts padded to one length, or one chunk of one prompt."""

    rids: tuple[str, ...]
    padded_tokens: int  # tokens per sequence after padding (a chunk: its prompt's tokens so far)
    seconds: float


@dataclass(frozen=True, slots=True)
class Handoff:
    """A sequence whose prefill ran here and whose decoding continues on another pool."""

    seq: SeqJob  # with resume_ids = the tokens generated here (the first one)
    kv: dict[str, Any]  # tensors "k{layer}"/"v{layer}", shape [1, heads, prompt_len, head_dim]


@dataclass(slots=True)
class StepResult:
    events: list[Delta | Finished | Failed] = field(default_factory=list)  # Failed: the request's own fault
    prefills: list[Prefill] = field(default_factory=list)
    decode_rids: tuple[str, ...] = ()  # sequences advanced by this step's decode pass
    decode_s: float = 0.0
    # streaming sequences still running after this step: (generated ids, characters sent),
    # recorded in Redis so a peer can resume them exactly if this worker dies
    progress: dict[str, tuple[tuple[int, ...], int]] = field(default_factory=dict)
    handoffs: list[Handoff] = field(default_factory=list)
    # sequences whose prefill raised on its own: dropped by the engine, their batches go
    # back to redelivery (and, failing again, to the dead-letter stream)
    failed: list[str] = field(default_factory=list)
    # the step's totals (the scheduler's view: workers publish them as telemetry)
    prefill_tokens: int = 0  # prompt tokens prefilled (chunks included), padding not counted
    decode_seqs: int = 0  # sequences that decoded one token
    kv_tokens: int = 0  # KV-cache tokens held by the running sequences when the step began
    step_s: float = 0.0  # the step's wall time
    # the step records this result stands for: None, it is one engine step (``record``); an
    # engine that cannot see its steps (an upstream server) infers them, any number per call
    observed: list[StepRecord] | None = None

    def record(self) -> StepRecord:
        return StepRecord(self.prefill_tokens, self.decode_seqs, self.kv_tokens, self.step_s * 1000)

    def records(self) -> list[StepRecord]:
        return [self.record()] if self.observed is None else self.observed


class Engine(Protocol):
    name: str
    slots: int
    device: str
    dtype: str
    choice: str  # why this device and dtype
    step_tokens: int  # per-step token budget: decode tokens plus prefill (0: none, whole prompts)
    down: str  # why the engine takes no work now (an upstream that does not answer); "" if it does
    metrics: dict[str, float]  # the gauges of the server an engine fronts (vLLM's); {} for a local one
    max_threads: int  # the intra-op threads it may run (0: it runs none of its own: echo, upstream)
    context_tokens: int  # the context window it serves, prompt plus completion (0: the model's own)

    @property
    def prefix_cache_tokens(self) -> int:
        """Prompt tokens it keeps for a later prompt with the same prefix (0: none)."""
        ...

    def add(self, seq: SeqJob, kv: dict[str, Any] | None = None) -> None:
        """Queue a sequence; with ``kv`` (a handed-over prefill) it skips prefill."""
        ...

    def cancel(self, rid: str) -> bool: ...

    def step(self) -> StepResult: ...

    def reset(self) -> None:
        """Drop every sequence (after an engine error)."""
        ...

    def set_threads(self, n: int) -> None:
        """Run ``n`` intra-op threads from the next step on (``workers.cpu.ThreadGovernor``)."""
        ...

    @property
    def busy(self) -> bool: ...

    @property
    def free_slots(self) -> int: ...

    @property
    def running(self) -> int:
        """Sequences decoding now."""
        ...

    @property
    def queued_prefill(self) -> int:
        """Prompt tokens of admitted sequences not yet prefilled."""
        ...


class EchoEngine:
    """Answers without a model, ``tokens`` tokens of fixed text per sequence.

    With ``step_s == 0`` every sequence is answered whole in one step: its own time is
    microseconds, which ``bench/overhead.py`` subtracts to isolate the gateway's cost.
    With ``step_s > 0`` it behaves like a decoding engine: one token per running sequence
    per step, each step taking ``step_s`` (for fault-injection tests and benchmarks), plus
    ``prefill_s`` per prompt token it prefills: a worker with a model's prefill cost.
    """

    name = "echo"
    device = "cpu"
    dtype = "none"
    choice = "echo engine: no model"
    piece = " echo"
    step_tokens = 0
    down = ""
    metrics: dict[str, float] = {}
    max_threads = 0
    context_tokens = 0
    prefix_cache_tokens = 0

    def __init__(self, tokens: int = 16, slots: int = 256, step_s: float = 0.0, prefill_s: float = 0.0) -> None:
        self.tokens = tokens
        self.slots = slots
        self.step_s = step_s
        self.prefill_s = prefill_s  # seconds per prompt token a step prefills (with step_s > 0)
        self._running: dict[str, tuple[SeqJob, int]] = {}  # rid -> (job, tokens generated)
        self._cancelled: list[tuple[SeqJob, int]] = []
        self._fresh: set[str] = set()  # added, not yet stepped ("prefilled" by the next step)

    def add(self, seq: SeqJob, kv: dict[str, Any] | None = None) -> None:
        self._running[seq.rid] = (seq, len(seq.resume_ids))
        if kv is None:
            self._fresh.add(seq.rid)

    def cancel(self, rid: str) -> bool:
        entry = self._running.pop(rid, None)
        if entry is None:
            return False
        self._cancelled.append(entry)
        self._fresh.discard(rid)
        return True

    @property
    def busy(self) -> bool:
        return bool(self._running or self._cancelled)

    @property
    def free_slots(self) -> int:
        return max(0, self.slots - len(self._running))

    @property
    def running(self) -> int:
        return len(self._running) - len(self._fresh)

    @property
    def queued_prefill(self) -> int:
        return sum(len(self._running[rid][0].prompt_ids) for rid in self._fresh)

    def set_threads(self, n: int) -> None:
        """No threads of its own."""

    def reset(self) -> None:
        self._running.clear()
        self._cancelled.clear()
        self._fresh.clear()

    def step(self) -> StepResult:
        started = time.perf_counter()
        result = StepResult()
        result.decode_seqs = self.running
        result.kv_tokens = sum(
            len(seq.prompt_ids) + done for rid, (seq, done) in self._running.items() if rid not in self._fresh
        )
        result.prefill_tokens = self.queued_prefill
        self._fresh.clear()
        for seq, done in self._cancelled:
            result.events.append(Finished(seq.rid, "", "cancelled", len(seq.prompt_ids), done))
        self._cancelled.clear()
        if self.step_s > 0:
            time.sleep(self.step_s + self.prefill_s * result.prefill_tokens)
        for rid, (seq, done) in list(self._running.items()):
            limit = min(self.tokens, seq.params.max_tokens)
            if done == len(seq.resume_ids):
                result.prefills.append(Prefill((rid,), len(seq.prompt_ids), 0.0))
            n = limit - done if self.step_s == 0 else min(1, limit - done)
            if seq.stream:
                for i in range(n):
                    result.events.append(Delta(rid, self.piece, done + i + 1))
            done += n
            if done < limit:
                self._running[rid] = (seq, done)
                result.progress[rid] = (tuple(range(done)), len(self.piece) * done)
                continue
            del self._running[rid]
            text = "" if seq.stream else self.piece * done
            reason = "length" if done == seq.params.max_tokens else "stop"
            result.events.append(Finished(rid, text, reason, len(seq.prompt_ids), done))
        if self.step_s > 0 and self._running:
            result.decode_rids = tuple(self._running)
            result.decode_s = self.step_s
        result.step_s = time.perf_counter() - started
        return result
