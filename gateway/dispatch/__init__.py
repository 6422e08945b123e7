"""Jobs out to the workers and events back: the scheduling shell around ``sched_core``, the
dispatcher's Redis streams, the prompts' tokenizing, liveness of gateways and workers, request
records and what a request consumed."""
