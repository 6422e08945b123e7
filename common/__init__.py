"""What the gateway, the workers and the scheduler's users share: the stream protocol between
gateways and workers (``protocol``), every Redis name (``wire``), Redis retries (``retry``)
and the settings helpers of every command (``settings``). Nothing here imports ``gateway``,
``workers`` or ``sched_core``."""
