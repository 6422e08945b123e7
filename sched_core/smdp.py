"""The design notes' SMDP policy: macro-states, the actions a state can take, and the table
that maps one to the other (docs/scheduling.md §16).

The exact semi-Markov decision process (queue, waits, remaining lengths, memory) is far too
large to solve, so the scheduler's state is aggregated into ``N_STATES`` macro-states, each
computed in O(buckets) from counters the core keeps anyway:

* the queue level: ``clear`` (every queued request would find a free slot now), ``queue``
  (more than the free slots, at most one full round of every slot) or ``backlog`` (more than
  every slot of every path: a backlog);
* a long prompt waiting: a queued request in a bucket whose prompts are all longer than
  ``long_prompt`` tokens;
* full: some path runs sequences in at least ``full_share`` of its slots (the KV cache and
  the decode step grow with them).

An ``Action`` sets the knobs the heuristic fixes once: how many steps of prompt tokens a
busy path may hold unprefilled (``prefill_queue_steps``), the share of each path's slots in
use (``slot_share``), the aging rate (``aging``, a multiple of the configured
``aging_tokens_per_s``), and the admission threshold (``admit_quantile`` of the calibrated
first-token and per-token bounds, against ``admit_slack`` times the SLO). The order and the
path rule are the heuristic's in every state.

Both implementations of the core classify the state and apply its action in lockstep; a
table is solved offline in the simulator (``sched_core.simulate.solve``) and shipped as JSON.
The heuristic is the table whose every state takes the configuration's knobs.
"""

from __future__ import annotations

import functools
import json
import math
from bisect import bisect_left
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any

QUEUE_LEVELS = ("clear", "queue", "backlog")
N_STATES = len(QUEUE_LEVELS) * 2 * 2

#: The table shipped with the package: ``smdp`` without a file means this one.
DEFAULT_TABLE = "smdp-code.json"

#: One state's figures in its name: the queue level, then ``+long`` and ``+full`` when set.
STATE_NAMES: tuple[str, ...] = tuple(
    f"{q}{'+long' if s & 2 else ''}{'+full' if s & 1 else ''}"
    for q in QUEUE_LEVELS for s in range(4))


def level_of(state: int) -> str:
    """The queue level of a macro-state (``classify``'s first figure)."""
    return QUEUE_LEVELS[state // 4]


def classify(queued: int, free: int, slots: int, long_waiting: bool, full: bool) -> int:
    """The macro-state of ``queued`` requests against ``free`` of ``slots`` slots (every
    path's, in use or not); the compiled core computes the same integer."""
    level = 0 if queued <= free else (1 if queued <= slots else 2)
    return level * 4 + (2 if long_waiting else 0) + (1 if full else 0)


def long_bucket(bounds: Sequence[int], long_prompt: int) -> int:
    """The first bucket whose prompts are all longer than ``long_prompt`` tokens (a bucket
    holds the prompts above the previous bound, up to its own); ``len(bounds)``: none is."""
    return min(bisect_left(bounds, long_prompt) + 1, len(bounds))


def quantile_weight(q: float) -> float:
    """Where the ``q`` quantile of an exponential tail sits between its mean-ish prediction
    (0) and its 99th percentile (1): ln(1/(1−q)) / ln(100)."""
    return math.log(1.0 / (1.0 - q)) / math.log(100.0)


def weight_quantile(weight: float) -> float:
    """The quantile at ``weight`` of the way to the 99th percentile: ``quantile_weight``'s
    inverse."""
    return 1.0 - math.exp(-weight * math.log(100.0))


@dataclass(frozen=True, slots=True)
class Action:
    """The knobs one macro-state sets (the module's docstring says what each does)."""

    prefill_queue_steps: float = 4.0
    slot_share: float = 1.0
    aging: float = 1.0
    admit_quantile: float = 0.99
    admit_slack: float = 1.0

    def __post_init__(self) -> None:
        if not self.prefill_queue_steps > 0.0:  # inf: no gate
            raise ValueError(f"prefill_queue_steps must be positive, got {self.prefill_queue_steps}")
        if not 0.0 < self.slot_share <= 1.0:
            raise ValueError(f"slot_share must lie in (0, 1], got {self.slot_share}")
        if not (self.aging > 0.0 and math.isfinite(self.aging)):
            raise ValueError(f"aging must be positive and finite, got {self.aging}")
        if not 0.5 <= self.admit_quantile <= 0.99:
            raise ValueError(f"admit_quantile must lie in [0.5, 0.99], got {self.admit_quantile}")
        if not (self.admit_slack > 0.0 and math.isfinite(self.admit_slack)):
            raise ValueError(f"admit_slack must be positive and finite, got {self.admit_slack}")

    @property
    def key_weight(self) -> float:
        """The weight of a prompt token in the aging key (``1/aging``: faster aging makes a
        second of waiting worth more tokens of prompt)."""
        return 1.0 / self.aging

    @property
    def admit_weight(self) -> float:
        """``quantile_weight`` of the admission quantile; exactly 1 at the 99th percentile."""
        return 1.0 if self.admit_quantile >= 0.99 else quantile_weight(self.admit_quantile)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        if math.isinf(self.prefill_queue_steps):
            out["prefill_queue_steps"] = None  # JSON has no infinity: null means no gate
        return out

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Action:
        if not isinstance(doc, Mapping):
            raise ValueError(f"an action must be an object, got {doc!r}")
        unknown = set(doc) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown action fields {sorted(unknown)}")
        fields = dict(doc)
        if "prefill_queue_steps" in fields and fields["prefill_queue_steps"] is None:
            fields["prefill_queue_steps"] = math.inf
        return cls(**{k: float(v) for k, v in fields.items()})


@dataclass(frozen=True, slots=True)
class PolicyTable:
    """One action per macro-state (``STATE_NAMES`` order), the two boundaries the states
    are drawn with, and where the table came from (``about``: objective, trace, figures)."""

    actions: tuple[Action, ...]
    long_prompt: int = 2048
    full_share: float = 0.75
    name: str = "smdp"
    about: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if len(self.actions) != N_STATES:
            raise ValueError(f"a policy table has {N_STATES} actions, one per state, got {len(self.actions)}")
        if self.long_prompt < 1:
            raise ValueError(f"long_prompt must be at least 1, got {self.long_prompt}")
        if not 0.0 < self.full_share <= 1.0:
            raise ValueError(f"full_share must lie in (0, 1], got {self.full_share}")

    @classmethod
    def uniform(cls, action: Action, **fields: Any) -> PolicyTable:
        return cls((action,) * N_STATES, **fields)

    def with_action(self, state: int, action: Action) -> PolicyTable:
        actions = list(self.actions)
        actions[state] = action
        return replace(self, actions=tuple(actions))

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "long_prompt": self.long_prompt, "full_share": self.full_share,
                "states": {STATE_NAMES[s]: a.to_json() for s, a in enumerate(self.actions)},
                "about": dict(self.about)}

    @classmethod
    def from_json(cls, doc: Any, where: str = "policy table") -> PolicyTable:
        """A table from its JSON object; ValueError naming ``where`` and what is wrong."""
        try:
            if not isinstance(doc, dict):
                raise ValueError("not a JSON object")
            states = doc.get("states")
            if not isinstance(states, dict) or set(states) != set(STATE_NAMES):
                raise ValueError(f"'states' must name every state once: {', '.join(STATE_NAMES)}")
            return cls(tuple(Action.from_json(states[n]) for n in STATE_NAMES),
                       long_prompt=int(doc.get("long_prompt", 2048)),
                       full_share=float(doc.get("full_share", 0.75)),
                       name=str(doc.get("name", "smdp")), about=dict(doc.get("about") or {}))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{where}: {exc}") from None

    @classmethod
    def load(cls, path: str | Path) -> PolicyTable:
        try:
            text = Path(path).read_text(encoding="utf-8")
            doc = json.loads(text)
        except (OSError, ValueError) as exc:
            raise ValueError(f"policy table {path}: {exc}") from None
        return cls.from_json(doc, f"policy table {path}")

    def dump(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n", encoding="utf-8")


@functools.cache
def packaged_table(filename: str = DEFAULT_TABLE) -> PolicyTable:
    """A table shipped as package data (``sched_core/tables``)."""
    text = resources.files("sched_core").joinpath("tables", filename).read_text(encoding="utf-8")
    return PolicyTable.from_json(json.loads(text), f"packaged policy table {filename}")


def describe(table: PolicyTable | None, state: int, visits: Sequence[int]) -> dict[str, Any]:
    """The policy in force, for a snapshot: the table's name, the state the scheduler is in,
    its action, and how often each state was seen at a tick."""
    action = table.actions[state] if table is not None else None
    return {"name": table.name if table is not None else "tokengate", "state": STATE_NAMES[state],
            "action": action.to_json() if action is not None else None,
            "visits": dict(zip(STATE_NAMES, visits, strict=True))}


def heuristic_table(prefill_queue_steps: float) -> PolicyTable:
    """The heuristic as a table: every state takes the configured ``prefill_queue_steps``
    and the neutral knobs."""
    return PolicyTable.uniform(Action(prefill_queue_steps=prefill_queue_steps), name="tokengate")


def in_force(table: PolicyTable | None, prefill_queue_steps: float) -> PolicyTable:
    """The table a core applies: ``table``, or the heuristic's."""
    return table if table is not None else heuristic_table(prefill_queue_steps)
