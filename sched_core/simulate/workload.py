"""Arrivals for the simulator: trace replay, Poisson, on/off bursts, heavy-tailed lengths, tenants.

Everything here is a pure function of its arguments and a seeded ``random.Random``: the same
seed gives the same arrivals. Reading a file is the caller's business; ``parse_trace`` takes
its lines.
"""

from __future__ import annotations

import csv
import math
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime

TRACE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
MAX_PROMPT = 8192  # the scheduler's largest bucket; longer synthetic prompts are clipped


class TraceError(ValueError):
    """A malformed trace file; the message names the file and the line."""


@dataclass(frozen=True, slots=True)
class TraceRow:
    time_s: float  # seconds since the trace's first request
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True, slots=True)
class Arrival:
    id: str
    time: float
    tenant: str
    prompt_tokens: int
    output_tokens: int  # what the request will actually generate
    max_tokens: int  # what the client asked for (>= output_tokens)


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    budget: float  # tokens/s: the tenant's weight in the fair share
    share: float  # fraction of the traffic it sends


@dataclass(frozen=True, slots=True)
class Workload:
    arrivals: tuple[Arrival, ...]
    tenants: tuple[Tenant, ...]
    description: str

    @property
    def rate(self) -> float:
        """Mean arrival rate (requests/s) over the span of the arrivals."""
        a = self.arrivals
        span = a[-1].time - a[0].time if len(a) > 1 else 0.0
        return (len(a) - 1) / span if span > 0.0 else 0.0


#: Four tenants; ``noisy`` sends half of the traffic on a fifth of the budget.
DEFAULT_TENANTS = (
    Tenant("alpha", 2000.0, 0.15),
    Tenant("beta", 2000.0, 0.15),
    Tenant("gamma", 4000.0, 0.20),
    Tenant("noisy", 2000.0, 0.50),
)


def parse_tenants(spec: str) -> tuple[Tenant, ...]:
    """``name:budget:share,...`` (shares are normalized to sum to one)."""
    tenants = []
    for part in spec.split(","):
        fields = part.strip().split(":")
        if len(fields) != 3:
            raise ValueError(f"tenant {part!r}: expected name:budget:share")
        name, budget, share = fields[0], float(fields[1]), float(fields[2])
        if not name or budget <= 0.0 or share < 0.0:
            raise ValueError(f"tenant {part!r}: needs a name, a budget > 0 and a share >= 0")
        tenants.append(Tenant(name, budget, share))
    total = sum(t.share for t in tenants)
    if total <= 0.0:
        raise ValueError("tenant shares must not all be zero")
    return tuple(Tenant(t.name, t.budget, t.share / total) for t in tenants)


# -- traces ------------------------------------------------------------------------------


def _timestamp(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        pass
    return datetime.fromisoformat(text).timestamp()


def parse_trace(lines: Iterable[str], source: str = "trace") -> list[TraceRow]:
    """Rows of a CSV with columns TIMESTAMP, ContextTokens, GeneratedTokens (any order, more
    columns allowed). TIMESTAMP is an ISO date-time or seconds. Rows are returned in time
    order, times relative to the first request."""
    reader = csv.reader(lines)
    header = next(reader, None)
    if header is None:
        raise TraceError(f"{source}: empty file, expected a header {','.join(TRACE_COLUMNS)}")
    names = [h.strip() for h in header]
    missing = [c for c in TRACE_COLUMNS if c not in names]
    if missing:
        raise TraceError(f"{source}:1: header lacks column(s) {', '.join(missing)}; "
                         f"expected {','.join(TRACE_COLUMNS)}")
    it, ip, io = (names.index(c) for c in TRACE_COLUMNS)
    raw: list[tuple[float, int, int]] = []
    for row in reader:
        line = reader.line_num
        if not row or all(not f.strip() for f in row):
            continue
        if len(row) != len(names):
            raise TraceError(f"{source}:{line}: {len(row)} fields, the header has {len(names)}")
        try:
            t = _timestamp(row[it].strip())
        except ValueError:
            raise TraceError(f"{source}:{line}: TIMESTAMP {row[it]!r} is neither a date-time "
                             "nor a number") from None
        try:
            prompt, output = int(row[ip]), int(row[io])
        except ValueError:
            raise TraceError(f"{source}:{line}: ContextTokens and GeneratedTokens must be "
                             f"integers, got {row[ip]!r}, {row[io]!r}") from None
        if prompt < 1 or output < 0 or not math.isfinite(t):
            raise TraceError(f"{source}:{line}: ContextTokens must be >= 1 and GeneratedTokens "
                             ">= 0")
        raw.append((t, prompt, output))
    if not raw:
        raise TraceError(f"{source}: no requests after the header")
    raw.sort(key=lambda r: r[0])  # stable: equal times keep file order
    t0 = raw[0][0]
    return [TraceRow(t - t0, p, o) for t, p, o in raw]


def trace_part(rows: Sequence[TraceRow], spec: str) -> list[TraceRow]:
    """The rows ``START:END`` of a trace (Python slice bounds, either may be empty, negative
    counts from the end; ``first-half``/``second-half`` split it in two), times shifted so
    that the part's first request comes at 0. A tuning run takes one part and reports on
    another it never saw."""
    half = len(rows) // 2
    named = {"first-half": f":{half}", "second-half": f"{half}:", "all": ":"}
    text = named.get(spec, spec)
    start, sep, end = text.partition(":")
    try:
        if not sep:
            raise ValueError(spec)
        part = list(rows[slice(int(start) if start else None, int(end) if end else None)])
    except ValueError:
        raise TraceError(f"rows {spec!r}: expected START:END, first-half, second-half or all") from None
    if len(part) < 2:
        raise TraceError(f"rows {spec!r} leave {len(part)} of the trace's {len(rows)} rows: at least 2 are needed")
    t0 = part[0].time_s
    return [TraceRow(r.time_s - t0, r.prompt_tokens, r.output_tokens) for r in part]


def shuffled_gaps(rows: Sequence[TraceRow], seed: int = 0) -> list[TraceRow]:
    """The rows with the gaps between arrivals shuffled (the same gaps, so the same mean rate
    and the same spread of gaps, in another order: bursts broken up and made anew)."""
    gaps = [b.time_s - a.time_s for a, b in zip(rows, rows[1:], strict=False)]
    random.Random(seed).shuffle(gaps)
    t, out = rows[0].time_s, [rows[0]]
    for r, gap in zip(rows[1:], gaps, strict=True):
        t += gap
        out.append(TraceRow(t, r.prompt_tokens, r.output_tokens))
    return out


def trace_rate(rows: Sequence[TraceRow]) -> float:
    span = rows[-1].time_s - rows[0].time_s
    return (len(rows) - 1) / span if span > 0.0 else 0.0


def _assign(tenants: Sequence[Tenant], rng: random.Random) -> Callable[[], str]:
    names = [t.name for t in tenants]
    weights = [t.share for t in tenants]
    return lambda: rng.choices(names, weights)[0]


def _request(i: int, t: float, tenant: str, prompt: int, output: int, max_tokens: int) -> Arrival:
    output = max(1, output)
    return Arrival(f"r{i}", t, tenant, max(1, min(MAX_PROMPT, prompt)), output,
                   max(output, max_tokens))


def replay(rows: Sequence[TraceRow], *, time_scale: float = 1.0, length_scale: float = 1.0,
           tenants: Sequence[Tenant] = DEFAULT_TENANTS, max_tokens: int = 256,
           seed: int = 0) -> Workload:
    """The trace, its clock multiplied by ``time_scale`` (0.1 plays it 10× faster) and its
    lengths divided by ``length_scale``; each request goes to a tenant drawn by share."""
    if time_scale <= 0.0 or length_scale <= 0.0:
        raise ValueError("time_scale and length_scale must be positive")
    pick = _assign(tenants, random.Random(seed))
    arrivals = tuple(
        _request(i, r.time_s * time_scale, pick(), round(r.prompt_tokens / length_scale),
                 round(r.output_tokens / length_scale), max_tokens)
        for i, r in enumerate(rows)
    )
    return Workload(arrivals, tuple(tenants),
                    f"trace replay, time x{time_scale:.4g}, lengths /{length_scale:g}")


# -- synthetic arrivals and lengths ------------------------------------------------------

LengthSampler = Callable[[random.Random], tuple[int, int]]


def trace_lengths(rows: Sequence[TraceRow], length_scale: float = 1.0) -> LengthSampler:
    """Resample (prompt, output) pairs of the trace, keeping their joint distribution."""
    pairs = [(r.prompt_tokens, r.output_tokens) for r in rows]

    def sample(rng: random.Random) -> tuple[int, int]:
        p, o = pairs[rng.randrange(len(pairs))]
        return round(p / length_scale), round(o / length_scale)

    return sample


def lognormal_lengths(prompt_median: float = 1469.0, prompt_sigma: float = 1.0,
                      output_median: float = 13.0, output_sigma: float = 1.2) -> LengthSampler:
    """Heavy-tailed lengths; the defaults match the medians and spreads of the Azure trace."""
    mp, mo = math.log(prompt_median), math.log(output_median)
    return lambda rng: (round(rng.lognormvariate(mp, prompt_sigma)),
                        round(rng.lognormvariate(mo, output_sigma)))


def pareto_lengths(prompt_min: float = 256.0, prompt_alpha: float = 1.5,
                   output_min: float = 6.0, output_alpha: float = 1.3) -> LengthSampler:
    """Pareto tails (alpha < 2: infinite variance); prompts are clipped to the largest bucket."""
    return lambda rng: (round(prompt_min * rng.paretovariate(prompt_alpha)),
                        round(output_min * rng.paretovariate(output_alpha)))


#: Length mixes of other workloads, from published distributions (lognormal fits of their
#: medians and spreads; docs/scheduling.md §13.4 names the sources). None was used to tune a
#: policy: they are held out, as the conversation trace is.
#: chat: ShareGPT conversations as vLLM's and others' serving benchmarks replay them (prompts
#: p50 ~150 tokens, answers p50 ~250, long-tailed both ways);
#: classify: short classification or extraction prompts answered in a label (prompt p50 250,
#: output p50 2);
#: agent: tool-using agents resending a long context each call, answering briefly (prompt p50
#: 4,000, output p50 80), replayed with on/off bursts.
LENGTH_MIXES: dict[str, tuple[float, float, float, float]] = {
    # (prompt median, prompt sigma, output median, output sigma) of the lognormals
    "chat": (150.0, 1.1, 250.0, 0.9),
    "classify": (250.0, 0.6, 2.0, 0.5),
    "agent": (4000.0, 0.5, 80.0, 0.8),
}


def mix_lengths(name: str) -> LengthSampler:
    """The lengths of one of ``LENGTH_MIXES``."""
    if name not in LENGTH_MIXES:
        raise ValueError(f"unknown length mix {name!r}; known: {', '.join(LENGTH_MIXES)}")
    return lognormal_lengths(*LENGTH_MIXES[name])


def poisson(rate: float, count: int, lengths: LengthSampler, *,
            tenants: Sequence[Tenant] = DEFAULT_TENANTS, max_tokens: int = 256,
            seed: int = 0) -> Workload:
    """``count`` requests with exponential gaps of mean ``1/rate``."""
    if rate <= 0.0 or count < 1:
        raise ValueError("poisson needs rate > 0 and count >= 1")
    rng = random.Random(seed)
    pick = _assign(tenants, rng)
    t = 0.0
    arrivals: list[Arrival] = []
    for i in range(count):
        prompt, output = lengths(rng)
        arrivals.append(_request(i, t, pick(), prompt, output, max_tokens))
        t += rng.expovariate(rate)
    return Workload(tuple(arrivals), tuple(tenants), f"Poisson {rate:.4g} req/s")


def on_off(rate: float, count: int, lengths: LengthSampler, *, burst: float = 4.0,
           mean_on_s: float = 2.0, mean_off_s: float = 6.0,
           tenants: Sequence[Tenant] = DEFAULT_TENANTS, max_tokens: int = 256,
           seed: int = 0) -> Workload:
    """A two-state MMPP: exponential on and off periods; during "on" arrivals come at
    ``burst``× the rate of "off", so that the mean over time is ``rate``."""
    if rate <= 0.0 or count < 1 or burst < 1.0:
        raise ValueError("on_off needs rate > 0, count >= 1 and burst >= 1")
    on_frac = mean_on_s / (mean_on_s + mean_off_s)
    low = rate / (on_frac * burst + (1.0 - on_frac))
    rates = (low * burst, low)
    rng = random.Random(seed)
    pick = _assign(tenants, rng)
    state, t = 0, 0.0
    switch = rng.expovariate(1.0 / mean_on_s)
    arrivals: list[Arrival] = []
    while len(arrivals) < count:
        gap = rng.expovariate(rates[state])
        if t + gap >= switch:  # memoryless: restart the clock at the switch
            t = switch
            state = 1 - state
            switch = t + rng.expovariate(1.0 / (mean_off_s if state else mean_on_s))
            continue
        t += gap
        prompt, output = lengths(rng)
        arrivals.append(_request(len(arrivals), t, pick(), prompt, output, max_tokens))
    return Workload(tuple(arrivals), tuple(tenants),
                    f"on/off bursts {rate:.4g} req/s mean, x{burst:g} when on")
