"""The first requests after `make run`: what a fresh `tokengate serve` promises them, and what they take.

    python -m bench.first_request [--starts 10] [--temperature T] [--json]
    python -m bench.first_request --prompts [--starts 10] [--json]

Each start is a fresh ``tokengate serve`` (its own data directory: no saved model, no
outcome seen). By default it is sent the README's request once, the chat completion "Say
hello in five words." (sampled at the API's default temperature unless ``--temperature`` is
given). The table has, per start, the promised latency (``x-tokengate-latency-ms``), the p99
bound, the latency the client measured, the tokens generated and the ratio; the summary, how
many starts were within 2x of their promise (issue 12's target 3).

``--prompts`` (issue 24's target) sends, one after the other, completions of prompts of
about 250, 2,000 and 4,000 tokens with ``max_tokens`` 1, promised a first token
(``x-tokengate-ttft-ms``, bound ``x-tokengate-ttft-p99-ms``), then a 48-token answer with
``ignore_eos``, promised its total (``x-tokengate-latency-ms``, bound ``x-tokengate-p99-ms``).
Each row says how the worker had its step-time profile (measured at start, or a stored one
re-checked: ``workers/selfprofile.py``) and the summary counts the requests within 1.5x of
their promise and inside their p99 bound.
"""

from __future__ import annotations

import argparse
import re
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import orjson

from bench.harness import OUT, spawn, stop, table, wait_ready
from gateway.cli.embedded_redis import free_port
from gateway.cli.serve_state import ADMIN_TOKEN_FILE

PROMPT = "Say hello in five words."
MODEL = "SmolLM2-135M-Instruct"
#: (words, max_tokens) of the --prompts requests: about 250, 2,000 and 4,000 prompt tokens
#: with one token out, then a short prompt answered with 48 tokens
LONG_PROMPTS = ((245, 1), (1990, 1), (3990, 1), (0, 48))
WORDS = ("the", "river", "moves", "slowly", "past", "old", "stone", "houses", "and", "green", "fields")


@contextmanager
def fresh_serve() -> Iterator[tuple[str, str, str]]:
    """A fresh ``tokengate serve`` (new data directory): (base URL, API key, admin token)."""
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        log = OUT / "serve.log"
        data = Path(tmp) / "data"
        proc = spawn(["-m", "gateway.cli", "serve", "--port", str(port), "--data-dir", str(data)], log)
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
            yield base, key, (data / ADMIN_TOKEN_FILE).read_text().strip()
        finally:
            stop([proc])


def timed_post(url: str, key: str, body: dict[str, Any]) -> tuple[httpx.Response, float]:
    """The response of one request, and the seconds the client waited for it."""
    t0 = time.perf_counter()
    r = httpx.post(url, json=body, headers={"authorization": f"Bearer {key}"}, timeout=120)
    took = time.perf_counter() - t0
    r.raise_for_status()
    return r, took


def one(temperature: float | None) -> tuple[float, float, float, int, int]:
    """(promised s, p99 s, took s, tokens, tokens assumed) of a fresh serve's first request."""
    with fresh_serve() as (base, key, _):
        body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}]}
        if temperature is not None:
            body["temperature"] = temperature
        r, took = timed_post(base + "/v1/chat/completions", key, body)
        h = r.headers
        return (float(h["x-tokengate-latency-ms"]) / 1000, float(h["x-tokengate-p99-ms"]) / 1000, took,
                int(r.json()["usage"]["completion_tokens"]), int(h["x-tokengate-output-tokens"]))


def prompts(start: int) -> list[dict[str, Any]]:
    """The --prompts requests on one fresh serve, one row each."""
    rows = []
    with fresh_serve() as (base, key, admin):
        workers = httpx.get(base + "/admin/workers", headers={"authorization": f"Bearer {admin}"}).json()["data"]
        how = ",".join(w["profile"].get("how", "none") for w in workers) or "none"
        for words, max_tokens in LONG_PROMPTS:
            text = " ".join(WORDS[i % len(WORDS)] for i in range(words)) if words else PROMPT
            body = {"model": MODEL, "prompt": text, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
            r, took = timed_post(base + "/v1/completions", key, body)
            h = r.headers
            first = max_tokens == 1  # one token out: its whole time is its first token's
            promised = float(h["x-tokengate-ttft-ms" if first else "x-tokengate-latency-ms"]) / 1000
            bound = float(h["x-tokengate-ttft-p99-ms" if first else "x-tokengate-p99-ms"]) / 1000
            rows.append({"start": start, "profile": how, "prompt_tokens": r.json()["usage"]["prompt_tokens"],
                         "max_tokens": max_tokens, "promised_s": promised, "p99_s": bound, "took_s": took,
                         "ratio": took / promised})
    return rows


def main_prompts(starts: int, as_json: bool) -> None:
    rows = [row for i in range(starts) for row in prompts(i + 1)]
    table(f"first requests of long prompts after a fresh `tokengate serve` ({starts} starts)",
          ["start", "profile", "prompt tokens", "max_tokens", "promised ms", "p99 ms", "took ms", "took / promised"],
          [[r["start"], r["profile"], r["prompt_tokens"], r["max_tokens"], f"{r['promised_s'] * 1000:.0f}",
            f"{r['p99_s'] * 1000:.0f}", f"{r['took_s'] * 1000:.0f}", f"{r['ratio']:.2f}"] for r in rows])
    summary = {"starts": starts, "requests": len(rows),
               "within_1_5x": sum(1 / 1.5 <= r["ratio"] <= 1.5 for r in rows),
               "within_p99": sum(r["took_s"] <= r["p99_s"] for r in rows),
               "worst_ratio": max((max(r["ratio"], 1 / r["ratio"]) for r in rows), default=None)}
    if as_json:
        print(orjson.dumps({"summary": summary, "rows": rows}).decode())
    else:
        print(summary)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--starts", type=int, default=10)
    parser.add_argument("--temperature", type=float, default=None)
    parser.add_argument("--prompts", action="store_true",
                        help="long prompts with one token out and a 48-token answer (issue 24)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.prompts:
        main_prompts(args.starts, args.json)
        return
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
