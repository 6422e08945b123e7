"""A worker measures its own engine at start: the step-time profile its gateways price with.

Before its first heartbeat a worker runs a few seconds of real engine steps (``measure``) and
fits them (``fit``) into a profile in the format ``bench/cost_profile.py`` writes and the simulator
reads (``sched_core.simulate.profile.CostProfile``):

* **prefill**, whole prompts on an idle engine (what a first request gets): one prompt of
  64, 256 and 1,024 tokens, then of 72, 264 and 2,048 (1,032 where the budget has no room
  for 2,048; each length new to the process, as a client's are), one of 512 and a batch of
  short prompts. Fitted as
  ``P(B, L) = a + b·B·L + b2·B·L²`` (``b2``: attention's quadratic part);
* **decode** steps of 1 sequence holding 512 KV tokens and of a batch of 32 and then 8
  short ones: ``D(n, K) = c + d·n + e·n·K``;
* **mixed** steps: a 256-token prompt prefilled in chunks of the step budget
  (``--step-tokens``) beside the 8 decoding sequences, the steps a loaded worker runs; they
  check the fit (``mixed_error``), they do not move it.

In that order of value: the prompts of 64, 256 and 1,024 tokens, the decode phases' first
pass (always, even past the budget), then the other prompts and a second, warm pass of the decode phases
where the budget has room.

The scheduler's step model takes the fit term for term: ``prefill_launch = a``,
``prefill_token = b``, ``prefill_attention = b2`` (attention's quadratic share of one
prompt, which the online fit leaves as measured), ``decode_launch, decode_seq, kv_token =
c, d, e``.

An engine that runs the whole pass in under a quarter of the budget (a GPU: ~0.6 s on an
H200) runs it twice and keeps the second: its first calls of each shape (CUDA kernels'
selection, lazy initialization) made the first pass 2-3x off.

The measurement times the engine, not its neighbours: while it runs, the share of its
threads' time spent runnable but waiting for a CPU (Linux's schedstat) is kept as the
profile's ``starved``. Another program on the CPUs makes the steps slower and that share
large (10-50 % with one or two CPU-bound programs on 2 cores, 1-3 % quiet); the log says so,
heartbeats carry it, and gateways hold such a profile loosely. Correcting the times by it
was tried and left: torch's threads wait for each other at every barrier, so a starved step
is 1.5-2.5x its quiet time whatever the share says.

A profile is stored per machine fingerprint (CPU model and its AMX/AVX-512 flags, torch
threads, GPU, dtype, torch version, engine, model and step budget) under the profile
directory; a restart with the same fingerprint re-checks it with two short prompts and a few
decode steps (well under a second) instead of measuring again, so a restart is ready in
seconds. A re-check more than ``RECHECK_TOLERANCE`` off re-anchors the stored fit (its
prefill terms by the prefill steps' ratio, its decode terms by the decode steps') and stores
that, unless the re-check itself was starved: then the machine is busy now, the stored profile
stays, and the gateways' step-time model follows the busy machine from its live steps.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import math
import os
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.protocol import STARVED_SHARE, SamplingParams, SeqJob
from common.stepmodel import decode_s, fit, mixed_error, prefill_s, step_model, summary
from workers import model_store
from workers.cpu import Starvation
from workers.devices import AMX_FLAGS, cpu_flags
from workers.engine import Engine

log = logging.getLogger("tokengate.worker")

PREFILL_LENGTHS = (64, 256, 1024)  # each measured twice (the longest: or LONG_PROMPT once)
#: the second time a length is measured it is this much longer: every prompt is a shape the
#: process has not run yet, as a client's prompts are (oneDNN's bf16 kernels and CUDA's are
#: chosen per shape on its first call: 30-80 ms more for a 250-token prompt on AMX and H200)
SHAPE_STEP = 8
LONG_PROMPT = 2048
LONG_DECODE_PROMPT = 512  # the sequence decoding alone holds this many KV tokens
LONG_DECODE_STEPS = 5
BATCH_PROMPT = 16  # tokens of each prompt of the decode batch
BATCH_SIZES = (32, 8)  # the decode batch, then what is left of it
BATCH_STEPS = 4  # decode steps at each batch size
MIXED_PROMPT = 256  # the prompt chunked beside the decoding batch
RECHECK_PROMPTS = (PREFILL_LENGTHS[1] - SHAPE_STEP // 2, PREFILL_LENGTHS[1] + SHAPE_STEP // 2)  # 252 and 260
RECHECK_TOLERANCE = 0.3  # a stored profile is reused as it is while the re-check is within 30 %
STARVED = STARVED_SHARE  # a measurement this starved of CPU timed the neighbours too
FORMAT = 1  # the profile document's format; a stored profile of another format is measured again


# -- the machine ---------------------------------------------------------------------------


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def machine_facts(engine: Engine) -> dict[str, Any]:
    """What the measurement depends on, beside the engine's own settings."""
    flags = cpu_flags()
    facts: dict[str, Any] = {
        "cpu": cpu_model(),
        "cores": os.cpu_count() or 1,
        "amx": AMX_FLAGS <= flags,
        "avx512": "avx512f" in flags,
        "device": engine.device,
        "dtype": engine.dtype,
        "engine": engine.name,
        "threads": 0,
        "gpu": "",
        "torch": "",
    }
    if engine.name == "transformers":  # the model engine: torch is loaded already
        import torch

        facts["threads"] = engine.max_threads  # the most it runs (fewer while a neighbour is busy)
        facts["torch"] = torch.__version__
        if engine.device == "cuda":
            facts["gpu"] = torch.cuda.get_device_name()
    # AMX is used where the CPU has it and the engine runs bf16 on the CPU
    facts["amx_used"] = bool(facts["amx"] and engine.device == "cpu" and engine.dtype == "bfloat16")
    return facts


def fingerprint(facts: dict[str, Any], setup: dict[str, Any]) -> str:
    """Same machine, same engine, same settings: same fingerprint."""
    doc = json.dumps({"format": FORMAT, **facts, **setup}, sort_keys=True)
    return hashlib.sha256(doc.encode()).hexdigest()[:16]


# -- measuring -----------------------------------------------------------------------------


def synthetic_prompt(length: int, salt: int) -> tuple[int, ...]:
    """Token ids valid in any real vocabulary, different per prompt (no prefix is shared)."""
    return tuple(100 + (i * 7919 + salt * 104729) % 30000 for i in range(length))


class Run:
    """Drives an engine with synthetic prompts and keeps each step's record."""

    def __init__(self, engine: Engine, deadline: float) -> None:
        self.engine = engine
        self.deadline = deadline
        self.salt = itertools.count()
        self.prefill: list[dict[str, float]] = []  # {"batch", "tokens", "seconds"}
        self.decode: list[dict[str, float]] = []  # {"running", "kv_tokens", "seconds"}
        self.mixed: list[list[float]] = []  # [prefill_tokens, decode_seqs, kv_tokens, seconds]

    def over(self) -> bool:
        return time.monotonic() >= self.deadline

    def add(self, n: int, length: int, max_tokens: int) -> None:
        params = SamplingParams(max_tokens, temperature=0.0, ignore_eos=True)
        for _ in range(n):
            i = next(self.salt)
            self.engine.add(SeqJob(f"profile-{i}", synthetic_prompt(length, i), params))

    def step(self, batch: int = 0, length: int = 0) -> None:
        """One engine step, filed by what it ran; ``batch``×``length``: the whole prompts it
        prefilled, when the caller knows them."""
        for r in self.engine.step().records():
            seconds = r.ms / 1000.0
            if r.prefill_tokens and not r.decode_seqs:
                if batch * length == r.prefill_tokens:
                    self.prefill.append({"batch": batch, "tokens": length, "seconds": seconds})
            elif r.decode_seqs and not r.prefill_tokens:
                self.decode.append({"running": r.decode_seqs, "kv_tokens": r.kv_tokens / r.decode_seqs,
                                    "seconds": seconds})
            elif r.decode_seqs:
                self.mixed.append([r.prefill_tokens, r.decode_seqs, r.kv_tokens, seconds])
            batch = length = 0  # only the first step prefills what was added

    def drain(self) -> None:
        while self.engine.busy:
            self.step()

    def points(self) -> dict[str, Any]:
        return {"prefill": self.prefill, "decode": self.decode, "mixed": self.mixed}


def measure(engine: Engine, budget_s: float, slots: int) -> dict[str, Any]:
    """Run the profile's steps on an idle engine, stopping between points once ``budget_s``
    is spent; the engine is idle again after. The points, and ``starved``: the share of the
    threads' time spent waiting for a CPU meanwhile."""
    t0 = time.monotonic()
    run = Run(engine, t0 + budget_s)
    starvation = Starvation()

    def prefill(length: int, max_tokens: int = 1) -> float:
        started = time.monotonic()
        run.add(1, length, max_tokens)
        run.step(1, length)
        run.drain()
        return time.monotonic() - started

    try:
        for length in PREFILL_LENGTHS:
            if run.over() and run.prefill:
                break
            longest = prefill(length)
        # the decode phases next, whatever is left of the budget: a profile without decode
        # steps would price decode by nothing it measured (on a slow CPU the prefills above
        # can take the whole budget: 8.4 of 10 s on an AMD EPYC of the first Zen generation)
        decoded_from = len(run.decode)
        started = time.monotonic()
        decode_phases(run, slots, first_pass=True)
        decode_took = time.monotonic() - started
        # attention's growth shows best on a long prompt: one of LONG_PROMPT tokens where the
        # budget leaves room for it (≈ 2.2x the longest so far), else the longest once more
        left = t0 + budget_s - time.monotonic()
        if not run.over():
            prefill(LONG_PROMPT if 2.2 * longest <= left else PREFILL_LENGTHS[-1] + SHAPE_STEP)
        for length in PREFILL_LENGTHS[:-1]:
            if not run.over():
                prefill(length + SHAPE_STEP)
        # decode widths recur in serving, prompt lengths hardly: the decode phases run again,
        # where the budget has room, and their second, warm pass is the one kept
        cold = run.decode[decoded_from:]
        if cold and decode_took < t0 + budget_s - time.monotonic():
            del run.decode[decoded_from:]
            if not decode_phases(run, slots, first_pass=False):
                run.decode[decoded_from:] = cold
    finally:
        engine.reset()
    return {**run.points(), "starved": starvation.share()}


def decode_phases(run: Run, slots: int, first_pass: bool) -> bool:
    """One sequence of ``LONG_DECODE_PROMPT`` tokens decoding alone, then a batch of 32 short
    ones decoding and, once 8 are left, a prompt prefilled in chunks beside them (where the
    budget has room). The first pass runs both widths whatever the budget: the decode fit needs
    more than one width to tell a step's launch from its per-sequence cost. The second pass
    files no prefill point (its prompt lengths were seen), runs no chunked prompt, and stops
    (False) if the budget runs out before the batch."""
    engine = run.engine
    filed = 1 if first_pass else 0  # prefills filed as points: the first pass's
    run.add(1, LONG_DECODE_PROMPT, LONG_DECODE_STEPS + 1)
    run.step(filed, LONG_DECODE_PROMPT)
    run.drain()
    if run.over() and not first_pass:  # the first pass's batch runs past the budget: one width fits nothing
        return False
    big, small = (min(n, slots) for n in BATCH_SIZES)
    first = BATCH_STEPS + 1
    rest = first + BATCH_STEPS + math.ceil(MIXED_PROMPT / max(1, engine.step_tokens or MIXED_PROMPT)) + 2
    run.add(big - small, BATCH_PROMPT, first)
    run.add(small, BATCH_PROMPT, rest)
    run.step(big * filed, BATCH_PROMPT)
    for _ in range(first + 1):
        run.step()
    if first_pass and small < slots and not run.over():
        run.add(1, MIXED_PROMPT, 1)
    run.drain()
    return True


@dataclass(frozen=True, slots=True)
class Recheck:
    """A stored profile against a few fresh steps: the largest relative error of its fit, the
    ratio of what the prefills and the decode steps took to what it predicts, and the share of
    the time the engine's threads waited for a CPU meanwhile."""

    error: float
    prefill: float
    decode: float
    starved: float


def recheck(engine: Engine, profile: dict[str, Any]) -> Recheck:
    """Two prompts prefilled (lengths the process has not run: a client's are new too), then
    decoded four steps."""
    run = Run(engine, math.inf)
    starvation = Starvation()
    try:
        for length in RECHECK_PROMPTS:
            run.add(1, length, 5)
            run.step(1, length)
            run.drain()
    finally:
        engine.reset()
    fit_ = profile["fit"]
    prefill = [p["seconds"] / prefill_s(fit_, 1, p["tokens"]) for p in run.prefill if p["seconds"] > 0]
    decode = [d["seconds"] / decode_s(fit_, d["running"], d["kv_tokens"]) for d in run.decode if d["seconds"] > 0]
    rp = statistics.median(prefill) if prefill else 1.0
    rd = statistics.median(decode) if decode else 1.0
    errors = [abs(r - 1.0) for r in (rp, rd)] if prefill else [math.inf]
    return Recheck(max(errors), rp, rd, starvation.share())


def reanchored(fit_: dict[str, Any], check: Recheck) -> dict[str, Any]:
    """A stored fit scaled to what a re-check measured: its prefill terms by the prefills'
    ratio, its decode terms by the decode steps'."""
    pre, dec = fit_["prefill"], fit_["decode"]
    return {**fit_, "prefill": {k: float(v) * check.prefill for k, v in pre.items()},
            "decode": {k: float(v) * check.decode for k, v in dec.items()}}


# -- start-up ------------------------------------------------------------------------------


def _steps(fit_: dict[str, Any], slots: int, setup: dict[str, Any]) -> dict[str, Any]:
    """The step model of a fit, for a worker of ``slots`` slots run with ``setup``."""
    return step_model(fit_, slots, int(setup.get("step_tokens") or 0))


def build(points: dict[str, Any], facts: dict[str, Any], setup: dict[str, Any], key: str, pool: str, model: str,
          slots: int, measured_s: float) -> dict[str, Any]:
    """The profile document (``bench/cost_profile.py``'s format plus the machine's facts), under
    its fingerprint ``key``."""
    fit_ = fit(points)
    steps = _steps(fit_, slots, setup)
    amx = "AMX bf16" if facts["amx_used"] else facts["dtype"]
    where = facts["gpu"] or facts["cpu"]
    return {
        "format": FORMAT,
        "name": f"{pool}-{facts['engine']}-{key}",
        "fingerprint": key,
        "device": f"{where}, {facts['threads'] or '?'} threads ({amx})",
        "model": model,
        "dtype": facts["dtype"],
        "derived": False,
        "pool": pool,
        "source": f"measured by the worker at start ({time.strftime('%Y-%m-%d %H:%M')})",
        "measured_at": time.time(),
        "measured_s": measured_s,
        "facts": facts,
        "setup": setup,
        "fit": fit_,
        "step_model": steps,
        "mixed_error": mixed_error(steps, points["mixed"]),
        "summary": summary(fit_),
        "starved": points.get("starved", 0.0),
        "points": {k: v for k, v in points.items() if k != "starved"},
    }


def published(profile: dict[str, Any], how: str, cost_s: float) -> dict[str, Any]:
    """What a heartbeat carries: the profile without its raw points, how it was had
    (measured, reused after a re-check, re-anchored by one) and what that cost this start."""
    doc = {k: v for k, v in profile.items() if k != "points"}
    doc["how"] = how
    doc["cost_s"] = cost_s
    doc["id"] = profile_id(profile)
    return doc


def profile_id(profile: dict[str, Any]) -> str:
    """The profile's identity: its machine's fingerprint and its fit (a profile measured or
    re-anchored again is another; one reused is the same), what gateways key the step-time
    model and calibration they learn on it by."""
    fit_ = json.dumps(profile.get("fit"), sort_keys=True).encode()
    return f"{profile.get('fingerprint', '?')}-{hashlib.sha256(fit_).hexdigest()[:8]}"


def default_dir() -> Path:
    return model_store.cache_root() / "profiles"


def obtain(engine: Engine, *, pool: str, model: str, setup: dict[str, Any], budget_s: float, slots: int,
           directory: Path | None) -> dict[str, Any] | None:
    """The engine's profile: the stored one for this fingerprint if a re-check confirms it,
    else a fresh measurement (stored for the next start). None if the budget is 0 or the
    measurement could not be fitted (the gateways keep their packaged priors)."""
    if budget_s <= 0:
        return None
    facts = machine_facts(engine)
    key = fingerprint(facts, setup)
    path = (directory or default_dir()) / f"{key}.json"
    t0 = time.perf_counter()
    stored = _read(path)
    if stored is not None:
        check = recheck(engine, stored)
        stored = {**stored, "step_model": _steps(stored["fit"], slots, setup), "recheck_error": check.error}
        cost = time.perf_counter() - t0
        if check.error <= RECHECK_TOLERANCE or check.starved >= STARVED:
            # (a starved re-check timed the neighbours: the stored profile stays; the gateways'
            # step-time model follows the busy machine from the live steps)
            why = (f"re-check {check.error * 100:.0f}% off" if check.starved < STARVED else
                   f"re-check {check.error * 100:.0f}% off, but starved of CPU ({check.starved * 100:.0f}% of its "
                   "threads' time waiting): another program is running; the live steps will tell")
            log.info("profile %s reused (%s, %.1f s): %s", key, why, cost, _describe(stored))
            return published(stored, "reused", cost)
        fit_ = reanchored(stored["fit"], check)
        profile = {**stored, "fit": fit_, "step_model": _steps(fit_, slots, setup), "summary": summary(fit_),
                   "starved": check.starved, "source": f"{stored.get('source', '?')}, re-anchored at start "
                                                       f"({time.strftime('%Y-%m-%d %H:%M')})"}
        _write(path, profile)
        log.info("profile %s re-anchored (re-check %.0f%% off: prefill x%.2f, decode x%.2f, %.1f s): %s", key,
                 check.error * 100, check.prefill, check.decode, cost, _describe(profile))
        return published(profile, "re-anchored", cost)
    points = measure(engine, budget_s, slots)
    spent = time.perf_counter() - t0
    if spent < budget_s / 4:  # a fast engine (a GPU): its first pass paid each shape's first call; again, warm
        points = measure(engine, budget_s - spent, slots)
    try:
        profile = build(points, facts, setup, key, pool, model, slots, time.perf_counter() - t0)
    except ValueError as exc:
        log.warning("self-profile failed (%s): gateways keep their packaged priors", exc)
        return None
    _write(path, profile)
    log.info("profile %s measured in %.1f s: %s", key, profile["measured_s"], _describe(profile))
    if profile["starved"] >= STARVED:
        log.warning("the profile was measured while starved of CPU: %.0f%% of its threads' time waiting for one "
                    "(another program is running); its figures time the neighbours too, and gateways hold it "
                    "loosely", profile["starved"] * 100)
    return published(profile, "measured", profile["measured_s"])


def _describe(profile: dict[str, Any]) -> str:
    s = profile["summary"]
    starved = profile.get("starved", 0.0)
    return (f"{profile['device']}: prefill {s['prefill_tokens_per_s']:.0f} tokens/s at 512, "
            f"decode step {s['decode_step_ms']:.1f} ms" + (f" (starved {starved * 100:.0f}%)" if starved >= STARVED
                                                           else ""))


def _read(path: Path) -> dict[str, Any] | None:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) and doc.get("format") == FORMAT and "fit" in doc else None


def _write(path: Path, profile: dict[str, Any]) -> None:
    """Atomically (a peer worker on the same machine may read it meanwhile); a failure to
    store only costs the next start a measurement."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(profile, indent=1))
        tmp.replace(path)
    except OSError as exc:
        log.warning("could not store the profile at %s: %s", path, exc)
