"""`tokengate tenants …`, `tokengate keys …` and `tokengate workers …`: the admin API from the command line.

Each command is one HTTP call to a running gateway (``--url``, ``--admin-token``, or
``TOKENGATE_URL``, ``TOKENGATE_ADMIN_TOKEN``); the reply is printed as JSON. An error
prints the API's message and exits 1 (2 when the gateway cannot be reached).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from common.settings import env_default
from gateway.dispatch.prompts import LARGE_PROMPT_CHARS, LARGE_PROMPTS_PER_TENANT
from gateway.tenancy.limits import REFUSAL_BURST_BYTES, REFUSAL_BYTES_PER_S

_LIMITS = ("max_prompt_tokens", "max_output_tokens", "max_concurrent")
#: (option, help) of the limits a request may be refused for (the status, code and when)
_LIMIT_HELP = {
    "max_prompt_tokens": "prompt tokens a request may have; over it: 400 prompt_too_long",
    "max_output_tokens": "max_tokens a request may ask for (and the cap of its default); over it: 400 "
    "max_tokens_exceeded",
    "max_concurrent": "requests in flight at once, across all gateways; beyond: 429 rate_limit_exceeded "
    "(type requests)",
}

#: `tenants create|update --help`'s epilog: every per-tenant limit that refuses a request
LIMITS_EPILOG = f"""\
what refuses a tenant's request (docs/tenants.md, "Per-tenant limits"):
  --rate, --burst        429 rate_limit_exceeded (type tokens): its budget would hold the request
                         longer than --max-queue-delay (or its deadline or first-token SLO);
                         400 budget_exceeded: prompt + max_tokens over the burst
  --max-concurrent       429 rate_limit_exceeded (type requests): that many requests in flight
  --max-prompt-tokens    400 prompt_too_long
  --max-output-tokens    400 max_tokens_exceeded
  --allowed-models       404 model_not_found
  --slo-ttft-ms/-tpot-ms 503 slo_unattainable: the gateway cannot promise the tenant's default
                         SLO now (a request's own x-slo-* headers replace it)
  --max-queue-wait-ms    503 overloaded: a request without a first-token SLO would wait longer
  --weight               its share under overload: a tenant over it is held to half its SLO and
                         refused first (503 slo_unattainable, overloaded)
  (fixed, every tenant)  429 rate_limit_exceeded (type requests): {LARGE_PROMPTS_PER_TENANT} long prompts (over
                         {LARGE_PROMPT_CHARS} characters) already being tokenized, whatever --max-concurrent;
                         429 oversize_held: it keeps sending requests refused for their size,
                         past {REFUSAL_BURST_BYTES >> 20} MiB at once or {REFUSAL_BYTES_PER_S / 1e6:g} MB/s
Each refusal's message names the limit. The burst must hold one request within the limits:
prompt + max_tokens is reserved at admission, so the burst must be at least
--max-prompt-tokens + --max-output-tokens, or the model's context where either is unset
(a smaller one is refused, naming the fix); left out, it defaults to the larger of 10 s of
--rate and that."""
#: (option, field, help): a tenant's latency defaults, in milliseconds; 'none' removes one
_SLOS = (
    ("--slo-ttft-ms", "slo_ttft_ms", "default SLO, p99 time to first token in ms, for requests that set none; "
     "one the gateway cannot promise now: 503 slo_unattainable"),
    ("--slo-tpot-ms", "slo_tpot_ms", "default SLO, time per output token in ms, for requests that set none; "
     "one the gateway cannot promise now: 503 slo_unattainable"),
    ("--max-queue-wait-ms", "max_queue_wait_ms", "the longest predicted wait in ms of a request without a "
     "first-token SLO before a 503 overloaded (default: the gateway's --max-queue-wait-ms)"),
)


def _count_or_none(text: str) -> int | None:
    if text.lower() in ("none", "null", ""):
        return None
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a whole number or 'none', got {text!r}"
        ) from None
    return value


def _ms_or_none(text: str) -> float | None:
    if text.lower() in ("none", "null", ""):
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(
            f"expected milliseconds (a number > 0) or 'none', got {text!r}"
        )
    return value


def _models(text: str) -> list[str]:
    return [m.strip() for m in text.split(",") if m.strip()]


def _connection() -> argparse.ArgumentParser:
    conn = argparse.ArgumentParser(add_help=False)
    conn.add_argument(
        "--url",
        default=env_default("url", "http://127.0.0.1:8000"),
        help="the gateway (env TOKENGATE_URL)",
    )
    conn.add_argument(
        "--admin-token",
        default=env_default("admin_token"),
        help="the gateway's admin token (env TOKENGATE_ADMIN_TOKEN)",
    )
    return conn


def _tenant_fields(parser: argparse.ArgumentParser, create: bool) -> None:
    if create:
        parser.add_argument("name")
        parser.add_argument("--rate", type=float, required=True, help="budget in tokens/s")
    else:
        parser.add_argument("tenant", help="tenant id or name")
        parser.add_argument("--name", help="a new name")
        parser.add_argument("--rate", type=float, help="budget in tokens/s")
    parser.add_argument("--burst", type=int,
                        help="tokens spendable at once, the budget's depth; must hold one request within the "
                        "limits (see below; default: 10 s of rate, or one such request if more); a request "
                        "larger: 400 budget_exceeded")
    parser.add_argument("--priority", type=int, help="scheduler class, 0 (most urgent) to 9")
    parser.add_argument(
        "--weight", type=float, help="share under overload, tokens/s (default: rate)"
    )
    parser.add_argument(
        "--max-queue-delay",
        type=float,
        dest="max_queue_delay_s",
        help="seconds a request may wait for its budget (default 2); longer: 429 rate_limit_exceeded",
    )
    for option, dest, what in _SLOS:
        parser.add_argument(
            option,
            type=_ms_or_none,
            dest=dest,
            default=argparse.SUPPRESS,
            help=f"{what}; 'none' removes it",
        )
    for limit in _LIMITS:
        parser.add_argument(
            "--" + limit.replace("_", "-"),
            type=_count_or_none,
            default=argparse.SUPPRESS,
            help=f"{_LIMIT_HELP[limit]}; a whole number, or 'none' for no limit",
        )
    parser.add_argument(
        "--allowed-models",
        type=_models,
        default=argparse.SUPPRESS,
        help="comma-separated model ids the tenant may use; '' allows every model; another: 404 "
        "model_not_found",
    )


def add_commands(sub: Any) -> None:
    conn = _connection()
    tenants = sub.add_parser("tenants", help="create, list, read, update, delete tenants; usage")
    tsub = tenants.add_subparsers(dest="action", required=True)
    described = {"epilog": LIMITS_EPILOG, "formatter_class": argparse.RawDescriptionHelpFormatter}
    _tenant_fields(tsub.add_parser("create", parents=[conn], help="a new tenant", **described), create=True)
    tsub.add_parser("list", parents=[conn], help="every tenant")
    tsub.add_parser("get", parents=[conn], help="one tenant and its budget now").add_argument(
        "tenant"
    )
    _tenant_fields(
        tsub.add_parser("update", parents=[conn], help="change some fields", **described), create=False
    )
    tsub.add_parser("delete", parents=[conn], help="a tenant and all its keys").add_argument(
        "tenant"
    )
    usage = tsub.add_parser("usage", parents=[conn], help="per-minute usage")
    usage.add_argument("tenant")
    usage.add_argument("--since", help="unix seconds (default: an hour ago)")
    usage.add_argument("--until", help="unix seconds (default: now)")
    usage.add_argument("--json", action="store_true", help="the API's JSON (minutes in unix seconds), not a table")

    api_keys = sub.add_parser("keys", help="issue, list, revoke API keys")
    ksub = api_keys.add_subparsers(dest="action", required=True)
    issue = ksub.add_parser("issue", parents=[conn], help="a new key (printed once)")
    issue.add_argument("tenant", help="tenant id or name")
    issue.add_argument("--name", default="", help="a label for the key")
    ksub.add_parser("list", parents=[conn], help="a tenant's keys, by prefix").add_argument(
        "tenant"
    )
    ksub.add_parser("revoke", parents=[conn], help="revoke a key by its prefix").add_argument(
        "prefix"
    )

    workers = sub.add_parser("workers", help="live workers: device, dtype, AMX, measured speed; their profiles")
    wsub = workers.add_subparsers(dest="action", required=True)
    wsub.add_parser("list", parents=[conn], help="each live worker, with what it measured of itself at start")
    profiles = wsub.add_parser("profiles", parents=[conn],
                               help="the live workers' measured profiles, one per pool, as `tokengate simulate "
                                    "--fleet FILE` replays them")
    profiles.add_argument("--out", type=Path, help="write them to this file (default: print)")


def tenant_body(args: argparse.Namespace) -> dict[str, Any]:
    """The JSON body of `tenants create|update`: only the options given."""
    body: dict[str, Any] = {}
    for name in ("name", "rate", "burst", "priority", "weight", "max_queue_delay_s"):
        value = getattr(args, name, None)
        if value is not None:
            body[name] = value
    body.update({dest: getattr(args, dest) for _, dest, _ in _SLOS if hasattr(args, dest)})
    limits = {k: getattr(args, k) for k in (*_LIMITS, "allowed_models") if hasattr(args, k)}
    if limits:
        body["limits"] = limits
    return body


def request_for(args: argparse.Namespace) -> tuple[str, str, dict[str, Any] | None]:
    """(method, path, body) of a command."""
    q = urllib.parse.quote
    if args.command == "workers":
        return "GET", "/admin/workers", None
    if args.command == "keys":
        if args.action == "issue":
            return "POST", f"/admin/tenants/{q(args.tenant)}/keys", {"name": args.name}
        if args.action == "list":
            return "GET", f"/admin/tenants/{q(args.tenant)}/keys", None
        return "DELETE", f"/admin/keys/{q(args.prefix)}", None
    if args.action == "create":
        return "POST", "/admin/tenants", tenant_body(args)
    if args.action == "list":
        return "GET", "/admin/tenants", None
    path = f"/admin/tenants/{q(args.tenant)}"
    if args.action == "update":
        return "PATCH", path, tenant_body(args)
    if args.action == "usage":
        query = {k: v for k in ("since", "until") if (v := getattr(args, k)) is not None}
        return "GET", f"{path}/usage" + (f"?{urllib.parse.urlencode(query)}" if query else ""), None
    return ("DELETE" if args.action == "delete" else "GET"), path, None


def call(url: str, token: str | None, method: str, path: str, body: dict[str, Any] | None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url.rstrip("/") + path, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read() or b"null")


def run(args: argparse.Namespace) -> int:
    method, path, body = request_for(args)
    try:
        result = call(args.url, args.admin_token, method, path, body)
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        try:
            message = json.loads(raw)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = raw.decode(errors="replace") or exc.reason
        print(f"tokengate: {message} (HTTP {exc.code})", file=sys.stderr)
        return 1
    except (urllib.error.URLError, OSError) as exc:
        print(f"tokengate: cannot reach {args.url}: {exc}", file=sys.stderr)
        return 2
    if args.command == "workers":
        return _workers(args, result["data"])
    if args.command == "tenants" and args.action == "usage" and not args.json:
        print(usage_table(args.tenant, result["data"]))
        return 0
    print(json.dumps(result, indent=2))
    return 0


def usage_table(tenant: str, rows: list[dict[str, Any]]) -> str:
    """`tenants usage` as a person reads it: one line a minute (UTC), the counters, a total."""
    import datetime as dt

    from rich.console import Console
    from rich.table import Table

    from gateway.tenancy.usage import DERIVED, FIELDS

    if not rows:
        return f"tenant {tenant}: no traffic in that window"
    names = (*FIELDS, *DERIVED)
    table = Table(title=f"usage of tenant {tenant}", show_footer=True)
    table.add_column("minute (UTC)", footer="total")
    for n in names:
        table.add_column(n.replace("_", " "), justify="right", footer=str(sum(r.get(n, 0) for r in rows)))
    for r in rows:
        table.add_row(dt.datetime.fromtimestamp(r["minute"], dt.UTC).strftime("%Y-%m-%d %H:%M"),
                      *(str(r.get(n, 0)) for n in names))
    console = Console(width=160, record=True)
    with console.capture() as out:
        console.print(table)
    return out.get()


def worker_summary(hb: dict[str, Any]) -> dict[str, Any]:
    """One live worker as `tokengate workers list` prints it."""
    prof = hb.get("profile") or {}
    facts, summary = prof.get("facts", {}), prof.get("summary", {})
    return {"worker": hb["worker"], "pool": hb["pool"], "engine": hb["engine"], "device": hb["device"],
            "gpu": facts.get("gpu", ""), "cpu": facts.get("cpu", ""), "dtype": hb["dtype"],
            "amx": bool(facts.get("amx_used")), "why": hb.get("choice", ""),
            "slots": hb["slots"], "free": hb["free"],
            "prefill_tokens_per_s": summary.get("prefill_tokens_per_s"),
            "decode_step_ms": summary.get("decode_step_ms"),
            "profile": prof.get("how", "none"), "profile_cost_s": prof.get("cost_s")}


def _workers(args: argparse.Namespace, beats: list[dict[str, Any]]) -> int:
    if args.action == "list":
        print(json.dumps([worker_summary(hb) for hb in beats], indent=2))
        return 0
    from common.protocol import by_model

    fleet = by_model([hb["profile"] for hb in beats if hb.get("profile")])
    if not fleet:
        print("tokengate: no live worker published a profile", file=sys.stderr)
        return 1
    # one model: its pools (as `tokengate simulate --fleet` has always read them); several: per model
    doc = next(iter(fleet.values())) if len(fleet) == 1 else fleet
    text = json.dumps(doc, indent=1)
    if args.out is None:
        print(text)
    else:
        args.out.write_text(text + "\n")
        what = "; ".join(f"{model}: pools {', '.join(sorted(pools))}" for model, pools in fleet.items())
        print(f"wrote the profiles of {what} to {args.out}", file=sys.stderr)
    return 0
