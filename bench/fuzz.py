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
import json
import random
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

MODEL = "SmolLM2-135M-Instruct"
PROTECTED = ("fuzz", "bench", "demo")  # tenants the fuzzer only reads
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


@dataclass(frozen=True)
class Target:
    host: str
    port: int
    key: str
    admin_token: str
    model: str = MODEL
    max_body_bytes: int = 65536


@dataclass
class Case:
    index: int
    kind: str  # what was malformed, for the tables
    data: bytes
    head: bool = False  # a HEAD request: a response without a body
    truncated: bool = False  # cut short, then half-closed: the server may close without answering
    deadline: bool = False  # sent x-tokengate-deadline-ms


@dataclass
class Outcome:
    status: int | None = None
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    error: str | None = None  # "timeout", "closed", "reset", "unparseable"
    seconds: float = 0.0


# -- what to send ----------------------------------------------------------------------------

EXTREMES: list[Any] = [
    None, True, False, 0, -1, 1, 2**31, 2**31 - 1, 2**63, -(2**63) - 1, 2**64, 1.5, -0.0, 1e308, -1e308, 5e-324,
    "", "1", "x" * 5000, "\u202e\u0000\ufeff", "😀" * 100, [], {}, [[]], [None], {"a": {"b": {}}}, ["x"] * 300,
]
RAW_NUMBERS = [b"NaN", b"Infinity", b"-Infinity", b"1e99999", b"-1e99999", b"1" + b"0" * 400, b"-0", b"00", b"1.",
               b".5", b"+1", b"0x10", b"1_000", b"\"\\ud800\"", b"\"\\u0000\"", b"\"\xff\xfe\"", b"\"\\x41\""]


def _chat(model: str) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8}


def _completion(model: str) -> dict[str, Any]:
    return {"model": model, "prompt": [1, 2, 3], "max_tokens": 8}


def _tenant(rng: random.Random) -> dict[str, Any]:
    return {"name": f"fz-{rng.randrange(10**6)}", "rate": 100, "limits": {"max_concurrent": 2}}


def _tenant_ref(rng: random.Random, read_only: bool) -> str:
    refs = ["fz-1", "nobody", "tn_" + "".join(rng.choices("0123456789abcdef", k=16)), "%00", "a" * 3000, "..%2F..",
            "%ff%fe", "tn_", "-", "ü"]
    if read_only:
        refs += list(PROTECTED)
    return rng.choice(refs)


def _deep(depth: int) -> bytes:
    return b'{"model": ' + b"[" * depth + b"]" * depth + b"}"


def _mutate(rng: random.Random, body: dict[str, Any]) -> bytes:
    """A body with one field (perhaps nested) set to something extreme, or a raw literal."""
    doc = orjson.loads(orjson.dumps(body))
    target = doc
    if "messages" in doc and rng.random() < 0.4:
        target = doc["messages"][0]
    fields = [*target, "stop", "seed", "n", "temperature", "top_p", "logprobs", "user", "stream", "stream_options",
              "max_completion_tokens", "presence_penalty", "echo", "limits", "burst", "priority", "content", "role"]
    name = rng.choice(fields)
    if rng.random() < 0.3:  # a literal orjson cannot write: NaN, huge ints, bad escapes
        marker = "__raw__"
        target[name] = marker
        return json.dumps(doc).encode().replace(b'"__raw__"', rng.choice(RAW_NUMBERS))
    target[name] = rng.choice(EXTREMES)
    return json.dumps(doc, ensure_ascii=rng.random() < 0.5).encode()  # ints beyond 64 bits too


def _body(rng: random.Random, valid: dict[str, Any], t: Target) -> tuple[str, bytes]:
    good = orjson.dumps(valid)
    choice = rng.randrange(14)
    if choice == 0:
        return "valid body", good
    if choice <= 4:
        return "extreme field", _mutate(rng, valid)
    if choice == 5:
        return "truncated JSON", good[: rng.randrange(len(good))]
    if choice == 6:
        return "garbage", rng.randbytes(rng.randrange(1, 300))
    if choice == 7:
        return "wrong JSON type", rng.choice([b"[]", b'"chat"', b"1", b"null", b"true", b"[{}]", b"{}"])
    if choice == 8:
        return "deep nesting", _deep(rng.choice([64, 1000, 5000, 30000]))
    if choice == 9:
        return "long string", orjson.dumps({**valid, rng.choice(["model", "user", "name"]): "y" * 60_000})
    if choice == 10:
        return "too large", b'{"model": "' + b"z" * (t.max_body_bytes + rng.randrange(1, 5000)) + b'"}'
    if choice == 11:
        return "duplicate keys", good[:-1] + b', "model": 7, "model": "' + t.model.encode() + b'"}'
    if choice == 12:
        return "BOM or whitespace", rng.choice([b"\xef\xbb\xbf", b"  \n\t", b"\x00"]) + good
    return "empty body", b""


def _route(rng: random.Random, t: Target) -> tuple[str, str, dict[str, Any] | None, str]:
    """(method, path, a valid body or None, which credential the route wants)."""
    r = rng.randrange(16)
    if r < 4:
        return "POST", "/v1/chat/completions", _chat(t.model), "key"
    if r < 6:
        return "POST", "/v1/completions", _completion(t.model), "key"
    if r == 6:
        return "GET", "/v1/models", None, "key"
    if r == 7:
        return "GET", "/v1/requests/" + rng.choice(["0" * 24, "chatcmpl-x", "%00", "a" * 200, "../admin"]), None, "key"
    if r == 8:
        return "POST", "/admin/tenants", _tenant(rng), "admin"
    if r == 9:
        return "PATCH", f"/admin/tenants/{_tenant_ref(rng, False)}", {"rate": 5}, "admin"
    if r == 10:
        ref = _tenant_ref(rng, True)
        tail = rng.choice(["", "/keys", "/usage", "/usage?since=1e400", "/usage?since=nan&until=-1", "/usage?since=5"])
        return "GET", f"/admin/tenants/{ref}{tail}", None, "admin"
    if r == 11:
        return "POST", f"/admin/tenants/{_tenant_ref(rng, False)}/keys", {"name": "k"}, "admin"
    if r == 12:
        return "DELETE", rng.choice([f"/admin/tenants/{_tenant_ref(rng, False)}", "/admin/keys/0123abcd",
                                     "/admin/keys/zz", "/admin/keys/"]), None, "admin"
    if r == 13:
        path = rng.choice(["/admin/workers", "/admin/scheduler", "/admin", "/admin/", "/admin/nope"])
        return "GET", path, None, "admin"
    if r == 14:
        return "GET", rng.choice(["/healthz", "/readyz", "/metrics", "/openapi.json"]), None, "none"
    unknown = ["/", "/v1", "/v1/", "/v1/chat/completions/", "/V1/models", "//v1/models", "/v1/embeddings", "/%",
               "/?" + "q" * 8000, "/" + "p" * 70_000, "/v1/models/../models", "*", "/\u00fc".encode().decode("latin-1"),
               "/v1/models#frag", "/v1/models?x=1&x=2&" + "a=" * 2000]
    return rng.choice(["GET", "POST"]), rng.choice(unknown), None, "key"


def _auth(rng: random.Random, t: Target, wants: str) -> list[tuple[bytes, bytes]]:
    good = t.admin_token if wants == "admin" else t.key
    r = rng.random()
    if r < 0.7 or wants == "none":
        return [(b"authorization", f"Bearer {good}".encode())]
    bad: list[bytes] = [b"", b"Bearer", b"Bearer ", b"bearer  " + good.encode(), good.encode(), b"Basic dXNlcjpwYXNz",
                        b"Bearer " + b"x" * 10_000, b"Bearer tg-zzzzzzzz-" + b"a" * 43, b"Bearer " + good[:-1].encode(),
                        "Bearer ключ".encode(), b"Bearer \x00", f"Bearer {t.key if wants == 'admin' else t.admin_token}"
                        .encode()]
    if r < 0.9:
        return [(b"authorization", rng.choice(bad))]
    if r < 0.95:
        return [(b"authorization", rng.choice(bad)), (b"authorization", f"Bearer {good}".encode())]
    return []


def _headers(rng: random.Random) -> tuple[str, list[tuple[bytes, bytes]], bool]:
    """(what, extra headers, sent a deadline)."""
    r = rng.randrange(20)
    if r < 8:
        return "", [], False
    if r < 11:
        value = rng.choice([b"0", b"-1", b"nan", b"inf", b"1e309", b"0.0001", b"5", b"250", b"99999999999", b"",
                            b"abc", b"0x10", b"1_000", b" 10 "])
        return "deadline header", [(b"x-tokengate-deadline-ms", value)], True
    if r == 11:
        return "huge header", [(b"x-big", b"h" * rng.choice([8_000, 100_000, 1_000_000]))], False
    if r == 12:
        return "many headers", [(f"x-h{i}".encode(), b"v") for i in range(rng.choice([100, 1000, 5000]))], False
    if r == 13:
        return "bad header syntax", [rng.choice([(b"bad header", b"x"), (b"x-nul", b"a\x00b"), (b"", b"empty-name"),
                                                 (b"x-fold", b"a\r\n folded"), (b"x-bin", b"\xff\xfe\x80"),
                                                 (b"x-cr", b"a\rb"), (b"x:colon", b"v")])], False
    if r == 14:
        return "duplicate content-type", [(b"content-type", b"application/json"), (b"content-type", b"text/plain")], \
            False
    if r == 15:
        return "content-type", [(b"content-type", rng.choice([b"text/plain", b"application/x-www-form-urlencoded",
                                                              b"multipart/form-data; boundary=x", b"", b"\x01",
                                                              b"application/json; charset=utf-16", b"*/*"]))], False
    if r == 16:
        return "expect 100-continue", [(b"expect", b"100-continue")], False
    if r == 17:
        ws = [(b"sec-websocket-key", b"dGhlIHNhbXBsZSBub25jZQ=="), (b"sec-websocket-version", b"13")]
        return "upgrade", [(b"connection", b"Upgrade"), (b"upgrade", rng.choice([b"websocket", b"h2c"])), *ws], False
    if r == 18:
        return "no host", [(b"host", b"")], False
    return "connection", [(b"connection", rng.choice([b"close", b"keep-alive", b"garbage"]))], False


def _frame(rng: random.Random, body: bytes) -> tuple[str, list[tuple[bytes, bytes]], bytes, bool]:
    """(what, framing headers, the bytes after the head, cut short)."""
    r = rng.randrange(24)
    if r < 14:
        return "", [(b"content-length", str(len(body)).encode())], body, False
    if r == 14:
        return "no content-length", [], body, False
    if r == 15:
        return "content-length too small", [(b"content-length", str(max(0, len(body) // 2)).encode())], body, False
    if r == 16:
        return "body cut short", [(b"content-length", str(len(body) + 100).encode())], body, True
    if r == 17:
        value = rng.choice([b"-1", b"abc", b"1e3", b" 10", b"0x10", b"99999999999999999999", b"", b"+5", b"1,1"])
        return "bad content-length", [(b"content-length", value)], body, False
    if r == 18:
        n = str(len(body)).encode()
        return "two content-lengths", [(b"content-length", n), (b"content-length", b"3")], body, False
    chunked = _chunks(rng, body)
    if r == 19:
        return "chunked", [(b"transfer-encoding", b"chunked")], chunked + b"0\r\n\r\n", False
    if r == 20:
        cut = chunked[: rng.randrange(len(chunked) + 1)]
        return "chunked cut short", [(b"transfer-encoding", b"chunked")], cut, True
    if r == 21:
        bad = rng.choice([b"zz\r\nab\r\n0\r\n\r\n", b"ffffffffffffffffffff\r\nab\r\n", b"5\r\nab\r\n0\r\n\r\n",
                          b"2;ext=1\r\nab\r\n0\r\nx-trailer: 1\r\n\r\n", b"-2\r\nab\r\n"])
        return "bad chunks", [(b"transfer-encoding", b"chunked")], bad, False
    if r == 22:
        return "content-length and chunked", [(b"content-length", b"4"), (b"transfer-encoding", b"chunked")], \
            chunked + b"0\r\n\r\n", False
    te = rng.choice([b"gzip", b"chunked, gzip", b"xchunked", b"identity", b"chunked\x00"])
    return "odd transfer-encoding", [(b"transfer-encoding", te)], body, False


def _chunks(rng: random.Random, body: bytes) -> bytes:
    out, i = b"", 0
    while i < len(body):
        n = rng.randrange(1, 4096)
        out += f"{len(body[i:i + n]):x}\r\n".encode() + body[i : i + n] + b"\r\n"
        i += n
    return out


def _request_line(rng: random.Random, method: str, path: str) -> tuple[str, bytes, bool]:
    """(what, the request line with its CRLF, cut short)."""
    r = rng.randrange(30)
    if r < 22:
        return "", f"{method} {path} HTTP/1.1\r\n".encode("latin-1"), False
    choices: list[tuple[str, bytes, bool]] = [
        ("HTTP/1.0", f"{method} {path} HTTP/1.0\r\n".encode("latin-1"), False),
        ("bad version", f"{method} {path} {rng.choice(['HTTP/2.0', 'HTTP/1.2', 'HTTP/9.9', 'http/1.1', 'HTTP/1'])}\r\n"
         .encode("latin-1"), False),
        ("no version", f"{method} {path}\r\n".encode("latin-1"), False),
        ("bad method", f"{rng.choice(['get', 'PROPFIND', 'G3T', 'CONNECT', 'TRACE', 'OPTIONS', 'HEAD', 'PUT'])} "
         f"{path} HTTP/1.1\r\n".encode("latin-1"), False),
        ("garbage request line", rng.randbytes(rng.randrange(1, 200)) + b"\r\n", False),
        ("bare LF", f"{method} {path} HTTP/1.1\n".encode("latin-1"), False),
        ("TLS hello", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + rng.randbytes(40), True),
        ("request line cut short", f"{method} {path}".encode("latin-1")[: rng.randrange(1, 20)], True),
    ]
    return rng.choice(choices)


def make_case(seed: int, index: int, t: Target) -> Case:
    rng = random.Random(f"{seed}:{index}")
    method, path, valid, wants = _route(rng, t)
    if rng.random() < 0.05:  # a wrong method on a known route
        method = rng.choice(["PUT", "DELETE", "PATCH", "GET", "POST", "OPTIONS"])
    kinds: list[str] = []
    body = b""
    if valid is not None or method in ("POST", "PATCH", "PUT"):
        what, body = _body(rng, valid or {}, t)
        kinds.append(what)
    line_kind, line, cut_line = _request_line(rng, method, path)
    head = line.startswith(b"HEAD ")
    frame_kind, framing, payload, cut_body = _frame(rng, body) if body or rng.random() < 0.2 else ("", [], b"", False)
    header_kind, extra, deadline = _headers(rng)
    headers: list[tuple[bytes, bytes]] = [(b"host", f"{t.host}:{t.port}".encode())]
    if not any(k == b"content-type" for k, _ in extra):
        headers.append((b"content-type", b"application/json"))
    headers += _auth(rng, t, wants) + extra + framing
    data = line
    if not cut_line:
        data += b"".join(k + b": " + v + b"\r\n" for k, v in headers if k or v) + b"\r\n" + payload
    kinds += [line_kind, frame_kind, header_kind]
    kind = ", ".join(k for k in kinds if k and k != "valid body") or "valid"
    return Case(index, kind, data, head=head, truncated=cut_line or cut_body, deadline=deadline)


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
        from bench import common  # numpy and the bench extra: only when starting a gateway

        gateway = ["--max-body-bytes", str(args.max_body_bytes)]
        with common.stack(engine="echo", echo_tokens=4, extra_gateway=gateway) as (base, _, key):
            args.url, args.key, args.admin_token = base, key, common.ADMIN_TOKEN
            report = go(_target(args))
    left = report.left(tuple(args.allow))
    if left:
        console.print(f"[red]findings: {left}[/red]")
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
