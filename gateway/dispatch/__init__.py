"""One request's way to a worker and back: its life from admission to settlement, the scheduling
shell around sched_core, the dispatcher's Redis streams, liveness and request records."""
