"""The first request after `make run`: what a fresh `tokengate serve` promises it, and what it takes.

    python -m bench.first_request [--starts 10] [--temperature T] [--json]

Each start is a fresh ``tokengate serve`` (its own data directory: no saved model, no
outcome seen) sent the README's request once, the chat completion "Say hello in five words."
(sampled at the API's default temperature unless ``--temperature`` is given). The table has,
per start, the promised latency (``x-tokengate-latency-ms``), the p99 bound, the latency the
client measured, the tokens generated and the ratio; the summary, how many starts were
within 2x of their promise (issue 12's target 3).
"""

from __future__ import annotations

import argparse
import re
import tempfile
import time
from pathlib import Path

import httpx
import orjson

from bench.common import OUT, spawn, stop, table, wait_ready
from gateway.embedded_redis import free_port

PROMPT = "Say hello in five words."


def one(temperature: float | None) -> tuple[float, float, float, int, int]:
    """(promised s, p99 s, took s, tokens, tokens assumed) of a fresh serve's first request."""
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        log = OUT / "serve.log"
        proc = spawn(["-m", "gateway.cli", "serve", "--port", str(port), "--data-dir", str(Path(tmp) / "data")], log)
        base = f"http://127.0.0.1:{port}"
        try:
            wait_ready(base, [proc])
            key = ""
            for _ in range(100):
                found = re.search(r"Bearer (tg-[0-9a-f]{8}-[A-Za-z0-9_-]{43})'", log.read_text())
                if found:
                    key = found.group(1)
                    break
                time.sleep(0.1)
            body: dict[str, object] = {"model": "SmolLM2-135M-Instruct",
                                       "messages": [{"role": "user", "content": PROMPT}]}
            if temperature is not None:
                body["temperature"] = temperature
            t0 = time.perf_counter()
            r = httpx.post(base + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"},
                           timeout=120)
            took = time.perf_counter() - t0
            r.raise_for_status()
            h = r.headers
            return (float(h["x-tokengate-latency-ms"]) / 1000, float(h["x-tokengate-p99-ms"]) / 1000, took,
                    int(r.json()["usage"]["completion_tokens"]), int(h["x-tokengate-output-tokens"]))
        finally:
            stop([proc])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--starts", type=int, default=10)
    parser.add_argument("--temperature", type=float, default=None)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = [one(args.temperature) for _ in range(args.starts)]
    within = sum(p / 2 <= t <= 2 * p for p, _, t, _, _ in rows)
    table(f"the first request after a fresh `tokengate serve` ({args.starts} starts)",
          ["start", "promised ms", "p99 ms", "took ms", "tokens", "assumed", "took / promised"],
          [[i + 1, f"{p * 1000:.0f}", f"{b * 1000:.0f}", f"{t * 1000:.0f}", n, a, f"{t / p:.2f}"]
           for i, (p, b, t, n, a) in enumerate(rows)])
    summary = {"starts": args.starts, "within_2x": within, "within_p99": sum(t <= b for _, b, t, _, _ in rows)}
    print(orjson.dumps(summary).decode() if args.json else summary)


if __name__ == "__main__":
    main()
