"""Every per-tenant limit that can refuse a request is in the tenants' docs, in
`tokengate tenants create|update --help` and in the admin API's schema, with the refusal it
causes (issue 38: a limit of two long prompts tokenized at once refused a tenant whose
--max-concurrent was 1000, and only docs/operations.md said so)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.cli.main import build_parser
from gateway.http import openapi
from gateway.tenancy import admin_protocol as ap

ROOT = Path(__file__).resolve().parents[3]

#: (the tenant's field, its CLI option, the code of the refusal it causes)
LIMITS = [
    ("rate", "--rate", "rate_limit_exceeded"),
    ("burst", "--burst", "budget_exceeded"),
    ("max_queue_delay_s", "--max-queue-delay", "rate_limit_exceeded"),
    ("max_concurrent", "--max-concurrent", "rate_limit_exceeded"),
    ("max_prompt_tokens", "--max-prompt-tokens", "prompt_too_long"),
    ("max_output_tokens", "--max-output-tokens", "max_tokens_exceeded"),
    ("allowed_models", "--allowed-models", "model_not_found"),
    ("slo_ttft_ms", "--slo-ttft-ms", "slo_unattainable"),
    ("slo_tpot_ms", "--slo-tpot-ms", "slo_unattainable"),
    ("max_queue_wait_ms", "--max-queue-wait-ms", "overloaded"),
    ("weight", "--weight", "slo_unattainable"),
]


def _help(action: str, capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["tenants", action, "--help"])
    return " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("action", ["create", "update"])
def test_the_cli_help_names_every_limit_and_its_refusal(action: str, capsys: pytest.CaptureFixture[str]) -> None:
    text = _help(action, capsys)
    for _, option, code in LIMITS:
        assert option in text and code in text, (option, code)
    assert "2 long prompts (over 4096 characters) already being tokenized, whatever --max-concurrent" in text
    assert "oversize_held" in text
    assert "The burst must hold one request within the limits" in text


def test_the_admin_schema_describes_every_limit_and_its_refusal() -> None:
    schemas = openapi.schemas()
    for model in ("TenantCreate", "TenantUpdate"):
        props = schemas[model]["properties"]
        limits = schemas["LimitsIn"]["properties"]
        for field, _, code in LIMITS:
            prop = props.get(field) or limits[field]
            assert code in prop["description"], (model, field)
    assert "two prompts over 4,096 characters" in schemas["LimitsIn"]["properties"]["max_concurrent"]["description"]
    assert "burst_too_small" in schemas["TenantCreate"]["properties"]["burst"]["description"]
    # the descriptions are the same text as the module's
    assert schemas["TenantCreate"]["properties"]["rate"]["description"] == ap.DESCRIPTIONS["rate"]


def test_the_tenants_doc_lists_every_limit_and_its_refusal() -> None:
    doc = (ROOT / "docs" / "tenants.md").read_text()
    section = doc.split("## Per-tenant limits: what refuses a request", 1)[1].split("\n## ", 1)[0]
    for field, _, code in LIMITS:
        assert f"`{field}`" in section or f"`limits.{field}`" in section, field
        assert f"`{code}`" in section, code
    assert "long prompts" in section and "`oversize_held`" in section
    assert "### The burst holds one request" in doc
