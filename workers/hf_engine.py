"""A `transformers` causal LM behind iteration-level (continuous) batching.

Running sequences share one left-padded KV cache (a ``DynamicCache``). Each ``step``:
one decode forward for the running batch, then at most one prefill forward, whose
sequences' cache rows are padded on the left and concatenated to the running batch.
Finished or cancelled rows are dropped with ``batch_select_indices``; all-padding columns
on the left are trimmed. Every running sequence gets exactly one token per step.

With a per-step token budget (``step_tokens``) a step prefills at most
``prefill_budget(running)`` prompt tokens (padding counted): waiting prompts that fit
together are prefilled whole in one padded forward; a prompt longer than the budget is
prefilled in chunks, one per step, in its own cache, and joins the running batch when its
last chunk is done. So one long prompt no longer stalls every running sequence for the
whole of its prefill. With no sequence decoding the budget is ``max_prefill_tokens``.
Without a budget (``step_tokens=0``) prompts are prefilled whole.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from common.protocol import Delta, Finished, SeqJob
from common.steps import IDLE_PREFILL_TOKENS, prefill_room
from workers.devices import DeviceChoice
from workers.engine import Handoff, Prefill, StepResult
from workers.text import IncrementalText

log = logging.getLogger("tokengate.engine")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class _Seq:
    job: SeqJob
    generator: torch.Generator | None
    text: IncrementalText
    out_ids: list[int] = field(default_factory=list)
    cancelled: bool = False
    finished: bool = False
    eos: bool = False  # ended by an end-of-sequence token (counted, not shown)
    kv: dict[str, torch.Tensor] | None = None  # a handed-over prefill: skip our own
    cache: DynamicCache | None = None  # its own cache while its prompt is prefilled in chunks
    prefilled: int = 0  # prompt tokens in that cache

    @property
    def inputs(self) -> tuple[int, ...]:
        """What prefill runs on: the prompt and the tokens generated before a resume."""
        return self.job.prompt_ids + self.job.resume_ids


class HFEngine:
    name = "transformers"
    down = ""
    metrics: dict[str, float] = {}
    context_tokens = 0  # the model's own, as the gateway reads it from the same config
    prefix_cache_tokens = 0  # every sequence prefills its whole prompt: nothing is reused (docs/scheduling.md §15)

    def __init__(self, model_dir: Path, choice: DeviceChoice, slots: int = 32,
                 max_prefill_tokens: int = IDLE_PREFILL_TOKENS, step_tokens: int = 0) -> None:
        self.slots = slots
        self.step_tokens = step_tokens  # 0: no per-step budget, prompts prefilled whole
        self.device = choice.device
        self.dtype = choice.dtype
        self.choice = choice.reason
        self.max_prefill_tokens = max_prefill_tokens
        self.max_threads = torch.get_num_threads()  # what --threads or torch chose: one per core
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=_DTYPES[choice.dtype])
        model.eval()
        torch.nn.Module.to(model, choice.device)  # transformers' wrapper of `to` mistypes its argument
        if choice.ipex:
            import intel_extension_for_pytorch as ipex  # optional extra

            model = ipex.optimize(model, dtype=_DTYPES[choice.dtype])
        self.model = model
        self._kv = cache_keyword(model)
        self.max_len = int(getattr(model.config, "max_position_embeddings", 8192))
        eos = model.generation_config.eos_token_id
        eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer.eos_token_id is not None:
            eos_ids.add(self.tokenizer.eos_token_id)
        self.eos_ids = frozenset(eos_ids)
        self.pad_id = self.tokenizer.pad_token_id or 0
        self._waiting: deque[_Seq] = deque()
        self._chunking: _Seq | None = None  # the prompt being prefilled in chunks (holds a slot)
        self._running: list[_Seq] = []
        self._cache: DynamicCache | None = None
        self._mask: torch.Tensor | None = None  # [B, T] 1 = real token

    # -- interface ----------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        return bool(self._waiting or self._running or self._chunking)

    @property
    def free_slots(self) -> int:
        return max(0, self.slots - self._occupied() - len(self._waiting))

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def queued_prefill(self) -> int:
        queued = sum(len(s.inputs) for s in self._waiting if s.kv is None and not s.cancelled)
        if self._chunking is not None:
            queued += len(self._chunking.inputs) - self._chunking.prefilled
        return queued

    def prefill_budget(self, decoding: int) -> int:
        """Prompt tokens one step may prefill beside ``decoding`` decode tokens
        (``common.steps.prefill_room``)."""
        return prefill_room(self.step_tokens, decoding, self.max_prefill_tokens)

    def add(self, job: SeqJob, kv: dict[str, Any] | None = None) -> None:
        generator = None
        if not job.params.greedy:
            generator = torch.Generator(device="cpu")
            if job.params.seed is not None:
                generator.manual_seed(job.params.seed)
            else:
                generator.seed()
        seq = _Seq(job, generator, IncrementalText(job.params.stop), out_ids=list(job.resume_ids), kv=kv)
        seq.text.sent = job.resume_chars
        self._waiting.append(seq)

    def cancel(self, rid: str) -> bool:
        for seq in self._waiting:
            if seq.job.rid == rid and not seq.cancelled:
                seq.cancelled = True
                return True
        for seq in [*self._running, *([self._chunking] if self._chunking else [])]:
            if seq.job.rid == rid and not seq.cancelled:
                seq.cancelled = True
                return True
        return False

    def set_threads(self, n: int) -> None:
        torch.set_num_threads(max(1, min(n, self.max_threads)))

    def reset(self) -> None:
        self._waiting.clear()
        self._chunking = None
        self._running = []
        self._cache, self._mask = None, None

    @torch.inference_mode()
    def step(self) -> StepResult:
        started = time.perf_counter()
        result = StepResult()
        self._drop_cancelled(result)
        if self._running:
            assert self._mask is not None
            result.kv_tokens = int(self._mask.sum())
            t0 = time.perf_counter()
            logits = self._decode()
            result.decode_s = time.perf_counter() - t0
            result.decode_rids = tuple(s.job.rid for s in self._running)
            result.decode_seqs = len(self._running)
            self._advance(self._running, logits, result)
        self._prefill_step(self.prefill_budget(result.decode_seqs), result)
        self._drop_finished()
        for seq in self._running:
            if seq.job.stream:
                result.progress[seq.job.rid] = (tuple(seq.out_ids), seq.text.sent)
        result.step_s = time.perf_counter() - started
        return result

    # -- batching -----------------------------------------------------------------------

    def _occupied(self) -> int:
        return len(self._running) + (self._chunking is not None)

    def _prefill_step(self, budget: int, result: StepResult) -> None:
        """At most one prefill forward: the next chunk of the prompt in chunked prefill, or
        the waiting prompts (first come, first served) that fit the budget together, or
        else the first chunk of the next prompt."""
        if self._chunking is not None:
            self._chunk(self._chunking, budget, result)
            return
        carried, whole, chunked = self._admit(budget)
        for seq in carried:  # decoding continues here from a peer's prefill
            cache, mask = self._from_kv(seq)
            self._merge([seq], cache, mask)
        if whole:
            self._prefill_whole(whole, result)
        elif chunked is not None:
            self._chunking = chunked
            self._chunk(chunked, budget, result)

    def _prefill_whole(self, seqs: list[_Seq], result: StepResult) -> None:
        """Prefill whole prompts in one padded pass. If the pass raises (a prompt the model
        cannot take: more reads at once put more prompts in one pass), each is prefilled
        alone, and one that fails alone is dropped and named in ``result.failed``: the
        others go on instead of falling with it."""
        t0 = time.perf_counter()
        try:
            logits, cache, mask = self._prefill(seqs)
        except Exception:
            if len(seqs) == 1:
                log.exception("prefill of %s failed: dropping it", seqs[0].job.rid)
                seqs[0].finished = True
                result.failed.append(seqs[0].job.rid)
                return
            log.warning("a prefill pass of %d sequences failed: prefilling each alone", len(seqs))
            for seq in seqs:
                self._prefill_whole([seq], result)
            return
        result.prefills.append(Prefill(tuple(s.job.rid for s in seqs), mask.shape[1], time.perf_counter() - t0))
        result.prefill_tokens += sum(len(s.inputs) for s in seqs)
        self._advance(seqs, logits, result)
        self._hand_off(seqs, cache, mask, result)
        self._merge(seqs, cache, mask)

    def _admit(self, budget: int) -> tuple[list[_Seq], list[_Seq], _Seq | None]:
        """Take waiting sequences in order while slots last: carried-KV ones (no prefill),
        prompts that fit ``budget`` together once padded, and, with a step budget, a first
        prompt that does not fit (to prefill in chunks). Without one, the first prompt is
        taken whole whatever its length."""
        carried: list[_Seq] = []
        whole: list[_Seq] = []
        longest = 0
        while self._waiting and self._occupied() + len(carried) + len(whole) < self.slots:
            seq = self._waiting[0]
            if seq.cancelled:
                self._waiting.popleft()
                continue
            if seq.kv is not None:
                carried.append(self._waiting.popleft())
                continue
            n = len(seq.inputs)
            if max(longest, n) * (len(whole) + 1) > budget and (whole or self.step_tokens):
                if not whole:
                    return carried, whole, self._waiting.popleft()
                break
            longest = max(longest, n)
            whole.append(self._waiting.popleft())
        return carried, whole, None

    def _chunk(self, seq: _Seq, budget: int, result: StepResult) -> None:
        """Prefill the next ``budget`` tokens of ``seq`` into its own cache; after the last
        chunk, sample its first token and let it join the running batch."""
        inputs = seq.inputs
        start = seq.prefilled
        end = min(len(inputs), start + budget)
        last = end == len(inputs)
        ids = torch.tensor([inputs[start:end]], dtype=torch.long, device=self.device)
        mask = torch.ones((1, end), dtype=torch.long, device=self.device)
        positions = torch.arange(start, end, dtype=torch.long, device=self.device).unsqueeze(0)
        kwargs: dict[str, Any] = dict(
            input_ids=ids, attention_mask=mask, position_ids=positions,
            use_cache=True, **{self._kv: seq.cache if seq.cache is not None else DynamicCache()},
        )
        t0 = time.perf_counter()
        # an inner chunk needs no logits: the base model skips the LM head altogether
        try:
            out = self.model(**kwargs, logits_to_keep=1) if last else self.model.base_model(**kwargs)
        except Exception:
            log.exception("prefill of %s failed: dropping it", seq.job.rid)
            self._chunking, seq.cache, seq.finished = None, None, True
            result.failed.append(seq.job.rid)
            return
        seq.cache, seq.prefilled = getattr(out, self._kv), end
        result.prefills.append(Prefill((seq.job.rid,), end, time.perf_counter() - t0))
        result.prefill_tokens += end - start
        if not last:
            return
        cache = seq.cache
        self._chunking, seq.cache = None, None
        self._advance([seq], out.logits[:, -1, :], result)
        self._hand_off([seq], cache, mask, result)
        self._merge([seq], cache, mask)

    def _prefill(self, seqs: list[_Seq]) -> tuple[torch.Tensor, DynamicCache, torch.Tensor]:
        inputs = [s.inputs for s in seqs]
        length = max(len(x) for x in inputs)
        ids = torch.full((len(seqs), length), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), length), dtype=torch.long)
        for row, x in enumerate(inputs):
            ids[row, length - len(x) :] = torch.tensor(x, dtype=torch.long)
            mask[row, length - len(x) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **{self._kv: cache},
        )
        return out.logits[:, -1, :], getattr(out, self._kv), mask

    def _hand_off(self, seqs: list[_Seq], cache: DynamicCache, mask: torch.Tensor, result: StepResult) -> None:
        """Prefill-only sequences leave with their KV rows (left padding stripped)."""
        for row, seq in enumerate(seqs):
            if seq.job.handoff is None or seq.finished:
                continue
            n = int(mask[row].sum())
            kv: dict[str, Any] = {}
            for i, layer in enumerate(cache.layers):
                keys, values = _kv(layer)
                kv[f"k{i}"] = keys[row : row + 1, :, -n:, :].contiguous().cpu()
                kv[f"v{i}"] = values[row : row + 1, :, -n:, :].contiguous().cpu()
            job = replace(seq.job, handoff=None, resume_ids=tuple(seq.out_ids), resume_chars=seq.text.sent)
            result.handoffs.append(Handoff(job, kv))
            seq.finished = True

    def _from_kv(self, seq: _Seq) -> tuple[DynamicCache, torch.Tensor]:
        assert seq.kv is not None
        dtype = _DTYPES[self.dtype]
        layers = [
            (seq.kv[f"k{i}"].to(self.device, dtype), seq.kv[f"v{i}"].to(self.device, dtype))
            for i in range(len(seq.kv) // 2)
        ]
        seq.kv = None
        n = layers[0][0].shape[-2]
        return DynamicCache(ddp_cache_data=layers), torch.ones((1, n), dtype=torch.long, device=self.device)

    def _decode(self) -> torch.Tensor:
        assert self._cache is not None and self._mask is not None
        last = torch.tensor([[s.out_ids[-1]] for s in self._running], dtype=torch.long)
        ones = torch.ones((len(self._running), 1), dtype=self._mask.dtype, device=self.device)
        self._mask = torch.cat([self._mask, ones], dim=1)
        positions = self._mask.sum(-1, keepdim=True) - 1
        out = self.model(
            input_ids=last.to(self.device),
            attention_mask=self._mask,
            position_ids=positions,
            use_cache=True,
            **{self._kv: self._cache},
        )
        self._cache = getattr(out, self._kv)
        return out.logits[:, -1, :]

    def _merge(self, seqs: list[_Seq], cache: DynamicCache, mask: torch.Tensor) -> None:
        """Add the rows of ``seqs`` to the running batch. A sequence that already finished
        (at its first token, or handed off) is left out: it must not widen every running
        row to its prompt's length for nothing."""
        keep = [i for i, s in enumerate(seqs) if not s.finished]
        if not keep:
            return
        if len(keep) < len(seqs):
            index = torch.tensor(keep, dtype=torch.long, device=self.device)
            cache.batch_select_indices(index)
            mask = _trim_left(cache, mask[index])
            seqs = [seqs[i] for i in keep]
        if self._cache is None or self._mask is None or not self._running:
            self._cache, self._mask, self._running = cache, mask, list(seqs)
            return
        width = max(self._mask.shape[1], mask.shape[1])
        # the layers take the new tensors as they are: DynamicCache(ddp_cache_data=...) would
        # copy every one again (seconds, once a long prompt widens the batch)
        for old, new in zip(self._cache.layers, cache.layers, strict=True):
            (old_k, old_v), (new_k, new_v) = _kv(old), _kv(new)
            old.keys = _stack_left_padded(old_k, new_k, width)  # type: ignore[union-attr]
            old.values = _stack_left_padded(old_v, new_v, width)  # type: ignore[union-attr]
        self._mask = torch.cat([_left_pad_mask(self._mask, width), _left_pad_mask(mask, width)], dim=0)
        self._running.extend(seqs)

    def _drop_cancelled(self, result: StepResult) -> None:
        for seq in list(self._waiting):
            if seq.cancelled:
                self._waiting.remove(seq)
                result.events.append(self._finish(seq, "cancelled"))
        if self._chunking is not None and self._chunking.cancelled:
            result.events.append(self._finish(self._chunking, "cancelled"))
            self._chunking = None
        for seq in self._running:
            if seq.cancelled and not seq.finished:
                result.events.append(self._finish(seq, "cancelled"))
        self._drop_finished()

    def _drop_finished(self) -> None:
        keep = [i for i, s in enumerate(self._running) if not s.finished]
        if len(keep) == len(self._running):
            return
        self._running = [self._running[i] for i in keep]
        if not keep:
            self._cache, self._mask = None, None
            return
        assert self._cache is not None and self._mask is not None
        index = torch.tensor(keep, dtype=torch.long, device=self.device)
        self._cache.batch_select_indices(index)
        self._mask = _trim_left(self._cache, self._mask[index])

    # -- sampling and text --------------------------------------------------------------

    def _advance(self, seqs: list[_Seq], logits: torch.Tensor, result: StepResult) -> None:
        tokens = self._sample(seqs, logits)
        for seq, token in zip(seqs, tokens, strict=True):
            if seq.finished:
                continue
            reason: str | None = None
            if token in self.eos_ids and not seq.job.params.ignore_eos:
                reason = "stop"
                seq.eos = True
            else:
                seq.out_ids.append(token)
            text = str(self.tokenizer.decode(seq.out_ids, skip_special_tokens=True))
            total = len(seq.job.prompt_ids) + len(seq.out_ids)
            if reason is None and (
                len(seq.out_ids) >= seq.job.params.max_tokens or total >= self.max_len
            ):
                reason = "length"
            delta = seq.text.update(text, final=reason is not None)
            if seq.text.stopped:
                reason = "stop"
            if seq.job.stream and delta:
                result.events.append(Delta(seq.job.rid, delta, len(seq.out_ids)))
            if reason is not None:
                result.events.append(self._finish(seq, reason, text))

    def _finish(self, seq: _Seq, reason: str, text: str = "") -> Finished:
        seq.finished = True
        if seq.job.stream:
            text = ""  # already sent as deltas
        elif seq.text.stopped:
            text = text[: seq.text.sent]
        generated = len(seq.out_ids) + int(seq.eos)
        return Finished(seq.job.rid, text, reason, len(seq.job.prompt_ids), generated)

    def _sample(self, seqs: list[_Seq], logits: torch.Tensor) -> list[int]:
        greedy = logits.argmax(dim=-1).tolist()
        out: list[int] = []
        for row, seq in enumerate(seqs):
            p = seq.job.params
            if p.greedy or seq.generator is None:
                out.append(int(greedy[row]))
                continue
            probs = torch.softmax(logits[row].float() / p.temperature, dim=-1).cpu()
            if p.top_p < 1.0:
                sorted_p, order = probs.sort(descending=True)
                keep = sorted_p.cumsum(0) - sorted_p < p.top_p
                sorted_p = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
                probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
            out.append(int(torch.multinomial(probs, 1, generator=seq.generator)))
        return out


def cache_keyword(model: Any) -> str:
    """The keyword a model's forward takes its KV cache by, and its output returns it under:
    ``cache`` from transformers 5.2x (where ``past_key_values`` still works but warns at every
    start), ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _kv(layer: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """A dynamic cache layer's key and value tensors (set once the layer has seen a token)."""
    keys, values = layer.keys, layer.values
    assert isinstance(keys, torch.Tensor) and isinstance(values, torch.Tensor)
    return keys, values


def _stack_left_padded(old: torch.Tensor, new: torch.Tensor, width: int) -> torch.Tensor:
    """``old`` rows above ``new`` rows, each left-padded with zeros to ``width`` positions:
    one allocation (a merge into a long cache copies every row once, not three times)."""
    rows = old.shape[0]
    out = old.new_empty((rows + new.shape[0], *old.shape[1:-2], width, old.shape[-1]))
    for part, t in ((out[:rows], old), (out[rows:], new)):
        pad = width - t.shape[-2]
        part[..., :pad, :].zero_()
        part[..., pad:, :].copy_(t)
    return out


def _trim_left(cache: DynamicCache, mask: torch.Tensor) -> torch.Tensor:
    """Drop the columns on the left that are padding in every row; the trimmed mask."""
    first = int(mask.any(dim=0).long().argmax())
    if first == 0:
        return mask
    for layer in cache.layers:
        keys, values = _kv(layer)
        layer.keys = keys[..., first:, :]  # type: ignore[union-attr]
        layer.values = values[..., first:, :]  # type: ignore[union-attr]
    return mask[:, first:]


def _left_pad_mask(mask: torch.Tensor, width: int) -> torch.Tensor:
    pad = width - mask.shape[1]
    if pad == 0:
        return mask
    return torch.cat([mask.new_zeros((mask.shape[0], pad)), mask], dim=1)
