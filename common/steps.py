"""How a continuously batching worker fills a step, written once: the engine runs by it
(``workers/hf_engine.py``) and the simulator's workers model it (``sched_core/simulate``)."""

IDLE_PREFILL_TOKENS = 8192  # the most prompt tokens one step prefills when nothing decodes


def prefill_room(step_tokens: int, decoding: int, most: int = IDLE_PREFILL_TOKENS) -> int:
    """Prompt tokens (padding counted) one step may prefill beside ``decoding`` decode
    tokens: the step budget's rest, but at least a quarter of it so prefill always moves.
    The budget protects decoding sequences: with none decoding (or no budget, 0), nobody
    waits on the prefill and a step takes up to ``most`` (a burst into an idle worker is
    prefilled at once)."""
    if not step_tokens or decoding == 0:
        return most
    return min(most, max(step_tokens - decoding, step_tokens // 4, 1))
