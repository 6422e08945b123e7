"""Malformed HTTP against a live gateway, over raw sockets: does every request get an answer,
and is every error OpenAI's error object?

    python -m bench.fuzz --requests 10000 --seed 1             # starts Redis, an echo worker, a gateway
    python -m bench.fuzz --url http://127.0.0.1:8000 --key tg-… --admin-token …   # a running gateway
    python -m bench.fuzz … --only 1234 --show                   # replay one request, print both sides

Request ``i`` of seed ``s`` is drawn from ``random.Random(f"{s}:{i}")`` alone, so any finding
replays with ``--only i``. The requests: bad request lines, bad, duplicate and huge headers,
bad or missing ``Content-Length``, chunked bodies cut short, garbage and truncated JSON, JSON
of the wrong types and extreme values (huge ints, deep nesting, long strings, NaN literals,
unicode), wrong methods, unknown paths, bad auth headers, bad deadlines. Admin requests never
change the tenants ``fuzz``, ``bench`` and ``demo`` (the fuzzer's own key must keep working).

Findings (exit status 1 when any is left after ``--allow``):

- ``server error``: a status >= 500 (except 503 ``deadline_unmet`` to a request that set a deadline);
- ``non-OpenAI error``: a status >= 400 whose body is not ``{"error": {"message", "type", "param", "code"}}``;
- ``plain-text 400 from the HTTP layer``: the same, from uvicorn's own parser (its text/plain 400s);
- ``bad JSON response``: a 2xx ``application/json`` body that does not parse;
- ``hang``: no whole response within ``--timeout``;
- ``closed without a response``: the server closed (or reset) a connection that carried a whole
  request without answering it (a request the fuzzer cut short may be closed unanswered);
- ``5xx no client saw``: server errors the gateway counted in ``/metrics`` beyond those the
  fuzzer received (a handler that failed after its client hung up); exact only when nobody
  else uses the gateway meanwhile.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import orjson
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from bench.fuzz_cases import MODEL, Case, Target, make_case

HTTP_LAYER_400 = "plain-text 400 from the HTTP layer"
UNSEEN_5XX = "5xx no client saw"
FINDINGS = (
    "server error",
    "non-OpenAI error",
    HTTP_LAYER_400,
    "bad JSON response",
    "hang",
    "closed without a response",
    UNSEEN_5XX,
)


@dataclass
class Outcome:
    status: int | None = None
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    error: str | None = None  # "timeout", "closed", "reset", "unparseable"
    seconds: float = 0.0


# -- sending and reading ---------------------------------------------------------------------


async def _read_response(reader: asyncio.StreamReader, head: bool) -> Outcome:
    line = await reader.readline()
    if not line:
        return Outcome(error="closed")
    parts = line.split(None, 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/") or not parts[1].isdigit():
        return Outcome(error="unparseable", body=line)
    status = int(parts[1])
    out = Outcome(status=status)
    while True:
        h = await reader.readline()
        if h in (b"\r\n", b"\n", b""):
            break
        name, _, value = h.decode("latin-1").partition(":")
        out.headers[name.strip().lower()] = value.strip()
    if head or status in (204, 304) or 100 <= status < 200:
        return out
    if "content-length" in out.headers:
        out.body = await reader.readexactly(int(out.headers["content-length"]))
    elif "chunked" in out.headers.get("transfer-encoding", ""):
        while True:
            size = int((await reader.readline()).split(b";")[0].strip() or b"0", 16)
            if size == 0:
                await reader.readline()
                break
            out.body += await reader.readexactly(size)
            await reader.readline()
    else:
        out.body = await reader.read()
    return out


async def send(t: Target, case: Case, timeout_s: float) -> Outcome:
    start = time.perf_counter()
    writer: asyncio.StreamWriter | None = None
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(t.host, t.port, limit=1 << 22)
            writer.write(case.data)
            await writer.drain()
            if case.truncated:
                writer.write_eof()  # no more is coming
            out = await _read_response(reader, case.head)
            while out.status == 100:  # Expect: 100-continue
                out = await _read_response(reader, case.head)
    except TimeoutError:
        out = Outcome(error="timeout")
    except (ConnectionResetError, BrokenPipeError):
        out = Outcome(error="reset")
    except (asyncio.IncompleteReadError, ValueError) as exc:
        out = Outcome(error="unparseable", body=repr(exc).encode())
    finally:
        if writer is not None:
            writer.close()
    out.seconds = time.perf_counter() - start
    return out


def is_openai_error(body: Any) -> bool:
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""
    if not isinstance(body, dict) or set(body) != {"error"} or not isinstance(body["error"], dict):
        return False
    err = body["error"]
    return (
        {"message", "type", "param", "code"} <= set(err)
        and isinstance(err["message"], str)
        and isinstance(err["type"], str)
        and (err["param"] is None or isinstance(err["param"], str))
        and (err["code"] is None or isinstance(err["code"], str))
    )


def _json(body: bytes) -> Any:
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        return None


def classify(case: Case, out: Outcome) -> str | None:
    """The finding this outcome is (one of ``FINDINGS``), or None."""
    if out.error == "timeout":
        return "hang"
    if out.status is None:
        return None if case.truncated else "closed without a response"
    if case.head:  # a status without a body
        return "server error" if out.status >= 500 else None
    doc = _json(out.body)
    if out.status >= 500:
        unmet = is_openai_error(doc) and doc["error"]["code"] == "deadline_unmet"
        return None if out.status == 503 and case.deadline and unmet else "server error"
    if out.status >= 400 and not is_openai_error(doc):
        plain = out.headers.get("content-type", "").startswith("text/plain")
        return HTTP_LAYER_400 if out.status == 400 and plain else "non-OpenAI error"
    if 200 <= out.status < 300 and out.headers.get("content-type", "").startswith("application/json") and doc is None:
        return "bad JSON response"
    return None


# -- the run ---------------------------------------------------------------------------------


@dataclass
class Report:
    requests: int = 0
    statuses: Counter[str] = field(default_factory=Counter)  # "200", "closed", "timeout", ...
    by_kind: Counter[tuple[str, str]] = field(default_factory=Counter)
    findings: Counter[str] = field(default_factory=Counter)
    examples: dict[str, list[tuple[Case, Outcome]]] = field(default_factory=dict)
    seconds: float = 0.0

    def left(self, allowed: tuple[str, ...] = ()) -> dict[str, int]:
        return {k: n for k, n in self.findings.items() if k not in allowed}


async def server_errors(t: Target) -> int:
    """The 5xx responses the gateway has counted (``tokengate_requests_total``)."""
    request = f"GET /metrics HTTP/1.1\r\nhost: {t.host}\r\nconnection: close\r\n\r\n".encode()
    out = await send(t, Case(-1, "metrics", request), 10.0)
    total = 0.0
    for line in out.body.decode().splitlines():
        if line.startswith("tokengate_requests_total{") and 'status="5' in line:
            total += float(line.rsplit(" ", 1)[1])
    return int(total)


async def run(t: Target, requests: int, seed: int, timeout_s: float = 10.0, concurrency: int = 8,
              only: int | None = None, on_case: Callable[[Case, Outcome], None] | None = None,
              exclude: tuple[str, ...] = ()) -> Report:
    """Sends requests ``0 .. requests-1`` of ``seed`` (or just ``only``), ``concurrency`` at a
    time; a request whose kind includes one of ``exclude`` is drawn but not sent."""
    report = Report()
    indices = iter([only] if only is not None else range(requests))
    counted_before = await server_errors(t)
    seen = 0
    start = time.perf_counter()

    async def worker() -> None:
        nonlocal seen
        for i in indices:
            case = make_case(seed, i, t)
            if any(kind in exclude for kind in case.kind.split(", ")):
                report.statuses["not sent (excluded)"] += 1
                continue
            out = await send(t, case, timeout_s)
            seen += 1 if out.status is not None and out.status >= 500 else 0
            status = str(out.status) if out.status is not None else out.error or "?"
            report.requests += 1
            report.statuses[status] += 1
            for kind in case.kind.split(", "):
                report.by_kind[kind, status] += 1
            finding = classify(case, out)
            if finding is not None:
                report.findings[finding] += 1
                report.examples.setdefault(finding, [])
                if len(report.examples[finding]) < 5:
                    report.examples[finding].append((case, out))
            if on_case is not None:
                on_case(case, out)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    report.seconds = time.perf_counter() - start
    await asyncio.sleep(0.5)  # a handler whose client left may still be failing
    unseen = await server_errors(t) - counted_before - seen
    if unseen > 0:
        report.findings[UNSEEN_5XX] += unseen
    return report


def _excerpt(data: bytes, n: int = 160) -> str:
    text = data[:n].decode("latin-1").encode("unicode_escape").decode()
    return text + (f"… ({len(data)} bytes)" if len(data) > n else "")


def print_report(report: Report, seed: int, console: Console, allowed: tuple[str, ...] = ()) -> None:
    rate = report.requests / report.seconds if report.seconds else 0.0
    console.print(f"bench.fuzz: {report.requests} requests, seed {seed}, {report.seconds:.1f} s ({rate:.0f}/s)")
    t = Table()
    t.add_column("status")
    t.add_column("responses", justify="right")
    for status, n in sorted(report.statuses.items()):
        t.add_row(status, str(n))
    console.print(t)
    kinds = Table(title="by what was malformed (a request may be several)")
    kinds.add_column("kind")
    kinds.add_column("statuses")
    names = sorted({k for k, _ in report.by_kind})
    for kind in names:
        row = ", ".join(f"{s}×{n}" for (k, s), n in sorted(report.by_kind.items()) if k == kind)
        kinds.add_row(escape(kind), row)
    console.print(kinds)
    f = Table(title="findings")
    f.add_column("class")
    f.add_column("count", justify="right")
    f.add_column("example: request #, kind, first bytes sent → answer")
    for name in FINDINGS:
        n = report.findings.get(name, 0)
        example = "counted in /metrics; the gateway's log names them" if name == UNSEEN_5XX and n else ""
        if report.examples.get(name):
            case, out = report.examples[name][0]
            answer = f"{out.status or out.error} {_excerpt(out.body, 100)}"
            example = escape(f"#{case.index} [{case.kind}] {_excerpt(case.data)} → {answer}")
        mark = " (allowed)" if name in allowed and n else ""
        f.add_row(name + mark, str(n), example)
    console.print(f)


def _target(args: argparse.Namespace) -> Target:
    parts = urlsplit(args.url)
    return Target(parts.hostname or "127.0.0.1", parts.port or 80, args.key, args.admin_token,
                  args.model, args.max_body_bytes)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.fuzz", description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--url", help="a running gateway (with --key and --admin-token); default: start one")
    p.add_argument("--key", default="", help="an API key of a tenant whose budget does not bind")
    p.add_argument("--admin-token", default="")
    p.add_argument("--model", default=MODEL)
    p.add_argument("--max-body-bytes", type=int, default=65536, help="the gateway's limit (started with it)")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds a request may take before it is a hang")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--only", type=int, help="send only request number ONLY")
    p.add_argument("--show", action="store_true", help="print each request and response")
    p.add_argument("--allow", action="append", default=[], choices=FINDINGS, help="a finding class not to fail on")
    p.add_argument("--exclude", action="append", default=[], help="a kind of request not to send (e.g. upgrade)")
    args = p.parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else 150)

    def show(case: Case, out: Outcome) -> None:
        console.print(f"#{case.index} [{case.kind}]\n>>> {_excerpt(case.data, 2000)}\n<<< {out.status or out.error} "
                      f"{out.headers}\n{_excerpt(out.body, 2000)}", markup=False)

    def go(t: Target) -> Report:
        report = asyncio.run(run(t, args.requests, args.seed, args.timeout, args.concurrency, args.only,
                                 show if args.show else None, tuple(args.exclude)))
        print_report(report, args.seed, console, tuple(args.allow))
        return report

    if args.url:
        report = go(_target(args))
    else:
        from bench import harness  # numpy and the bench extra: only when starting a gateway

        gateway = ["--max-body-bytes", str(args.max_body_bytes)]
        with harness.stack(engine="echo", echo_tokens=4, extra_gateway=gateway) as (base, _, key):
            args.url, args.key, args.admin_token = base, key, harness.ADMIN_TOKEN
            report = go(_target(args))
    left = report.left(tuple(args.allow))
    if left:
        console.print(f"[red]findings: {left}[/red]")
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
