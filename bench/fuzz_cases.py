"""What ``bench.fuzz`` sends: request ``i`` of seed ``s``, drawn from ``random.Random(f"{s}:{i}")``
alone (bad request lines, headers, framing, bodies, routes, auth), as the raw bytes of one
HTTP/1.1 request."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

import orjson

MODEL = "SmolLM2-135M-Instruct"
PROTECTED = ("fuzz", "bench", "demo")  # tenants the fuzzer only reads


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
