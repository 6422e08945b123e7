"""`tokengate tenants|keys`: arguments to (method, path, body), no I/O."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.cli.admin import request_for
from gateway.cli.main import build_parser


def parse(*argv: str) -> tuple[str, str, dict[str, Any] | None]:
    return request_for(build_parser().parse_args(list(argv)))


def test_create_sends_only_what_was_given() -> None:
    assert parse("tenants", "create", "acme", "--rate", "100") == (
        "POST",
        "/admin/tenants",
        {"name": "acme", "rate": 100.0},
    )
    method, path, body = parse(
        "tenants",
        "create",
        "acme",
        "--rate",
        "5",
        "--burst",
        "50",
        "--max-concurrent",
        "2",
        "--allowed-models",
        "a,b",
    )
    assert body == {
        "name": "acme",
        "rate": 5.0,
        "burst": 50,
        "limits": {"max_concurrent": 2, "allowed_models": ["a", "b"]},
    }


def test_update_can_clear_a_limit() -> None:
    assert parse("tenants", "update", "acme", "--max-concurrent", "none", "--name", "acme2") == (
        "PATCH",
        "/admin/tenants/acme",
        {"name": "acme2", "limits": {"max_concurrent": None}},
    )


@pytest.mark.parametrize(
    ("argv", "want"),
    [
        (("tenants", "list"), ("GET", "/admin/tenants", None)),
        (("tenants", "get", "acme"), ("GET", "/admin/tenants/acme", None)),
        (("tenants", "delete", "acme"), ("DELETE", "/admin/tenants/acme", None)),
        (
            ("tenants", "usage", "acme", "--since", "60"),
            ("GET", "/admin/tenants/acme/usage?since=60", None),
        ),
        (
            ("keys", "issue", "acme", "--name", "ci"),
            ("POST", "/admin/tenants/acme/keys", {"name": "ci"}),
        ),
        (("keys", "list", "acme"), ("GET", "/admin/tenants/acme/keys", None)),
        (("keys", "revoke", "0123abcd"), ("DELETE", "/admin/keys/0123abcd", None)),
        (("workers", "list"), ("GET", "/admin/workers", None)),
        (("workers", "profiles", "--out", "f.json"), ("GET", "/admin/workers", None)),
    ],
)
def test_commands_map_to_admin_routes(argv: tuple[str, ...], want: tuple[str, str, object]) -> None:
    assert parse(*argv) == want


def test_a_tenant_default_slo_is_set_and_cleared() -> None:
    _, _, body = parse("tenants", "create", "acme", "--rate", "5", "--slo-ttft-ms", "800", "--slo-tpot-ms", "40")
    assert body == {"name": "acme", "rate": 5.0, "slo_ttft_ms": 800.0, "slo_tpot_ms": 40.0}
    assert parse("tenants", "update", "acme", "--slo-ttft-ms", "none") == (
        "PATCH",
        "/admin/tenants/acme",
        {"slo_ttft_ms": None},
    )
    assert parse("tenants", "update", "acme", "--priority", "1")[2] == {"priority": 1}


@pytest.mark.parametrize("value", ["0", "-3", "nan", "inf", "fast"])
def test_a_bad_slo_is_a_usage_error(value: str) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["tenants", "update", "a", "--slo-tpot-ms", value])


def test_connection_options_come_after_the_command() -> None:
    args = build_parser().parse_args(
        ["tenants", "list", "--url", "http://x:1", "--admin-token", "t"]
    )
    assert (args.url, args.admin_token) == ("http://x:1", "t")


def test_a_bad_limit_is_a_usage_error() -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["tenants", "update", "a", "--max-concurrent", "lots"])


def test_usage_prints_a_table_of_utc_minutes_with_a_total() -> None:
    from gateway.cli.admin import usage_table

    rows = [{"minute": 1_800_000_000, "requests": 3, "rate_limited": 1, "prompt_tokens": 30, "completion_tokens": 12,
             "slo_met": 2, "slo_missed": 1, "total_tokens": 42},
            {"minute": 1_800_000_060, "requests": 1, "rate_limited": 0, "prompt_tokens": 10, "completion_tokens": 4,
             "slo_met": 1, "slo_missed": 0, "total_tokens": 14}]
    text = usage_table("acme", rows)
    assert "2027-01-15 08:00" in text and "2027-01-15 08:01" in text  # UTC minutes, not unix seconds
    assert "1800000000" not in text
    total = next(line for line in text.splitlines() if "total" in line and "56" in line)
    assert "40" in total and "16" in total and "56" in total  # prompt, completion and all tokens summed
    assert usage_table("acme", []) == "tenant acme: no traffic in that window"
