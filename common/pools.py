"""The worker pools, one tuple for everyone: the gateway routes to them, workers serve one,
the scheduler calls them paths (index 0 the CPU pool, 1 the GPU pool)."""

POOLS: tuple[str, str] = ("cpu", "gpu")
