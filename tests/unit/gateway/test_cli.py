"""`tokengate gateway|serve` flags: each default is the GatewaySettings field's, each flag an env var."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.cli.flags import setting_default
from gateway.cli.main import build_parser
from gateway.settings import GatewaySettings

# flag -> field, for every GatewaySettings field that has a flag
FLAGS = {
    "host": "host",
    "port": "port",
    "max-body-bytes": "max_body_bytes",
    "request-timeout": "request_timeout_s",
    "default-max-tokens": "default_max_tokens",
    "default-temperature": "default_temperature",
    "default-top-p": "default_top_p",
    "admin-token": "admin_token",
    "usage-retention": "usage_retention_s",
    "handoff-min-prompt": "handoff_min_prompt",
    "auth-cache": "auth_cache_s",
    "shutdown-grace": "shutdown_grace_s",
    "request-record-ttl": "request_record_ttl_s",
    "header-timeout": "header_timeout_s",
    "body-timeout": "body_timeout_s",
    "max-connections": "max_connections",
    "keep-alive-timeout": "keep_alive_timeout_s",
}


@pytest.mark.parametrize("command", ["gateway", "serve"])
def test_every_default_is_the_settings_default(command: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for flag in FLAGS:
        monkeypatch.delenv("TOKENGATE_" + flag.upper().replace("-", "_"), raising=False)
    args = build_parser().parse_args([command, "--redis-url", "redis://x"])
    fields = {f.name: f.default for f in dataclasses.fields(GatewaySettings)}
    for field in FLAGS.values():
        assert getattr(args, field) == fields[field] == setting_default(field), field


@pytest.mark.parametrize(("flag", "field"), FLAGS.items())
def test_every_flag_is_also_an_environment_variable(flag: str, field: str, monkeypatch: pytest.MonkeyPatch) -> None:
    default = setting_default(field)
    value = {int: "7", float: "2.5", str: "a-long-admin-token-0123"}[str if default is None else type(default)]
    monkeypatch.setenv("TOKENGATE_" + flag.upper().replace("-", "_"), value)
    from_env = build_parser().parse_args(["serve"])
    from_flag = build_parser().parse_args(["serve", f"--{flag}", value])
    assert getattr(from_env, field) == getattr(from_flag, field) == type(from_flag.__dict__[field])(value)
    assert getattr(from_env, field) != default


def test_a_bad_environment_value_is_refused_like_a_bad_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENGATE_MAX_CONNECTIONS", "lots")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve"])


def test_data_dir_flag_and_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENGATE_DATA_DIR", "/srv/tg")
    assert build_parser().parse_args(["serve"]).data_dir == Path("/srv/tg")
    assert build_parser().parse_args(["serve", "--data-dir", "d"]).data_dir == Path("d")


def test_the_slo_flags_reach_the_scheduler_and_default_to_its_config(monkeypatch: pytest.MonkeyPatch) -> None:
    from gateway.cli.server import settings_from_args
    from sched_core import SchedulerConfig

    for name in ("TOKENGATE_SLO_TTFT_MS", "TOKENGATE_SLO_TPOT_MS", "TOKENGATE_AGING_TOKENS"):
        monkeypatch.delenv(name, raising=False)
    args = build_parser().parse_args(["gateway", "--redis-url", "redis://x"])
    plain = settings_from_args(args, "redis://x", "m", 4096)
    assert plain.scheduler == SchedulerConfig()
    monkeypatch.setenv("TOKENGATE_SLO_TPOT_MS", "400")
    args = build_parser().parse_args(["gateway", "--redis-url", "redis://x", "--slo-ttft-ms", "3000",
                                      "--aging-tokens", "30"])
    config = settings_from_args(args, "redis://x", "m", 4096).scheduler
    assert (config.ttft_p99_slo_s, config.tpot_slo_s, config.aging_tokens_per_s) == (3.0, 0.4, 30.0)
    args = build_parser().parse_args(["gateway", "--redis-url", "redis://x", "--slo-tpot-ms", "0"])
    with pytest.raises(ValueError, match="tpot_slo_s must be positive"):
        settings_from_args(args, "redis://x", "m", 4096)


def _subparser(command: str) -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    chosen: argparse.ArgumentParser = sub.choices[command]
    return chosen


@pytest.mark.parametrize("command", ["serve", "gateway", "worker"])
def test_help_shows_every_flag_s_default(command: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENGATE_ADMIN_TOKEN", "a-secret-admin-token-0123")
    parser = _subparser(command)
    text = " ".join(parser.format_help().split())  # the help as one line: wrapping aside
    flags = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    assert flags
    for action in flags:
        assert action.help, f"{action.option_strings[0]} has no help"
        if action.default is not None and action.dest != "admin_token":
            shown = f"(default: {action.default})"
            wanted = sum(1 for a in flags if str(a.default) == str(action.default) and a.dest != "admin_token")
            assert text.count(shown) >= wanted, f"{action.option_strings[0]}: {shown} not shown"
    assert "a-secret-admin-token-0123" not in text  # a secret's default is never shown
    assert "(default: None)" not in text


def test_the_worker_entry_s_help_shows_the_defaults() -> None:
    """`python -m workers`, the command `serve` runs its workers with."""
    out = subprocess.run([sys.executable, "-m", "workers", "--help"], capture_output=True, text=True, check=True)
    text = " ".join(out.stdout.split())
    assert "--slots SLOTS sequences decoded together" in text and "(default: 32)" in text
    assert "(default: INFO)" in text
