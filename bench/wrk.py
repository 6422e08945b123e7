"""A closed loop driven by wrk (C, one thread), where it is installed (``apt install wrk``):
the Python client tops out near 2,000-3,000 requests/s on one core, below what a gateway here
can answer. wrk keeps no list of latencies; it reports its own percentiles."""

from __future__ import annotations

import os
import shutil
import subprocess

from bench.harness import OUT

INSTALLED = shutil.which("wrk") is not None

WRK_SCRIPT = """
local f = io.open(os.getenv("PEERS_BODY"), "rb"); wrk.body = f:read("*a"); f:close()
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
local auth = os.getenv("PEERS_AUTH"); if auth ~= "" then wrk.headers["Authorization"] = auth end
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format("PEERS %d %d %d %d %d %d %d %d\\n", summary.requests, e.status,
                         e.connect + e.read + e.write + e.timeout, latency:percentile(50), latency:percentile(99),
                         latency:percentile(99.9), latency.max, summary.duration))
end
"""


def closed_loop(url: str, body: bytes, authorization: str, clients: int, duration_s: float,
                timeout_s: float) -> tuple[int, int, float, dict[float, float]]:
    """``clients`` keep-alive connections POSTing ``body`` to ``url`` for ``duration_s``: the
    requests answered without error, the errors, the seconds it ran, and {50, 99, 99.9, 100:
    seconds} (100 is the slowest)."""
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "peers.lua").write_text(WRK_SCRIPT)
    (OUT / "peers-body.json").write_bytes(body)
    env = {**os.environ, "PEERS_BODY": str(OUT / "peers-body.json"), "PEERS_AUTH": authorization}
    cmd = ["wrk", "-t1", f"-c{clients}", f"-d{max(1, round(duration_s))}s", "--timeout", f"{timeout_s:g}s",
           "-s", str(OUT / "peers.lua"), url]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    line = next(x for x in out.splitlines() if x.startswith("PEERS "))
    requests, bad_status, socket_errors, p50_us, p99_us, p999_us, max_us, duration_us = (
        int(v) for v in line.split()[1:])
    quantiles = {50: p50_us / 1e6, 99: p99_us / 1e6, 99.9: p999_us / 1e6, 100: max_us / 1e6}
    return requests - bad_status, bad_status + socket_errors, duration_us / 1e6, quantiles
