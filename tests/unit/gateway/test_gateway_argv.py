"""`tokengate gateway --workers N`: the command of each gateway process says everything the
parent was told (but the admin token, which travels in the environment), and the process
count is checked by the parser."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import pytest

from gateway.cli.flags import GATEWAY_FLAGS, SETTING_FLAGS, setting_default
from gateway.cli.main import build_parser
from gateway.cli.server import gateway_argv, gateway_env

TOKEN = "unit-admin-token-0123456789"
# a value for every GatewaySettings flag, none of them its default
GIVEN = {
    "host": "0.0.0.0",
    "port": "9123",
    "max-body-bytes": "65536",
    "request-timeout": "33.5",
    "default-max-tokens": "17",
    "default-temperature": "0.7",
    "default-top-p": "0.95",
    "admin-token": TOKEN,
    "usage-retention": "3600",
    "handoff-min-prompt": "512",
    "auth-cache": "0.25",
    "shutdown-grace": "4",
    "request-record-ttl": "90",
    "header-timeout": "2.5",
    "body-timeout": "7.0",
    "max-connections": "1000",
    "keep-alive-timeout": "11",
    "policy": "fixed:batch=4,window_ms=5",
    "routing": "pool",
    "max-in-flight": "123",
    "redis-max-connections": "32",
    "redis-timeout": "2.75",
    "gateway-dead-after": "6.5",
    "max-queue-wait-ms": "2500.0",
    "tune-every": "120.0",
    "tune-cpu": "0.25",
}
# the other flags a gateway process takes
OTHERS = {
    "slo-ttft-ms": "1234.5",
    "slo-tpot-ms": "55.0",
    "aging-tokens": "250.0",
    "cost-priors": "/srv/priors.json",
    "model": "/srv/models/tiny",
    "model-name": "tiny-chat",
    "cache-dir": "/srv/cache",
}


@pytest.fixture(autouse=True)
def no_tokengate_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Defaults from the flags alone: no TOKENGATE_* variable of this shell leaks in."""
    for name in list(os.environ):
        if name.startswith("TOKENGATE_"):
            monkeypatch.delenv(name)


def _parent() -> argparse.Namespace:
    flags = [item for flag, value in {**GIVEN, **OTHERS}.items() for item in (f"--{flag}", value)]
    return build_parser().parse_args(
        ["--log-level", "DEBUG", "gateway", "--redis-url", "redis://redis.internal:6380/2", *flags, "--workers", "3"]
    )


def _child(argv: list[str]) -> argparse.Namespace:
    assert argv[:3] == [sys.executable, "-m", "gateway.cli"]
    return build_parser().parse_args(argv[3:])


def test_every_gateway_flag_has_a_value_here_that_is_not_its_default() -> None:
    assert {flag for flag, _name, _help in GATEWAY_FLAGS} == set(GIVEN)  # a new flag needs a value above
    parent = _parent()
    for flag, name, _help in GATEWAY_FLAGS:
        assert getattr(parent, name) != setting_default(name), flag


def test_a_gateway_process_gets_every_flag_of_its_parent_but_the_admin_token() -> None:
    parent = _parent()
    argv = gateway_argv(parent, parent.redis_url, parent.model, parent.model_name)
    child = _child(argv)

    for name in SETTING_FLAGS - {"admin_token"}:
        assert getattr(child, name) == getattr(parent, name), name
    for name in ("log_level", "redis_url", "slo_ttft_ms", "slo_tpot_ms", "aging_tokens", "cost_priors",
                 "model", "model_name", "cache_dir"):
        assert getattr(child, name) == getattr(parent, name), name
    assert child.cache_dir == Path("/srv/cache")
    assert child.command == "gateway"
    assert child.reuse_port and not parent.reuse_port
    assert child.workers == 1  # a process of the group supervises nothing
    assert child.admin_token is None
    assert not [arg for arg in argv if TOKEN in arg]


def test_the_admin_token_reaches_the_gateway_process_through_its_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    parent = _parent()
    env = gateway_env(parent)
    assert env == {"TOKENGATE_ADMIN_TOKEN": TOKEN}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert _child(gateway_argv(parent, parent.redis_url, parent.model, parent.model_name)).admin_token == TOKEN


def test_without_an_admin_token_the_environment_adds_nothing() -> None:
    parent = build_parser().parse_args(["gateway", "--redis-url", "redis://x", "--workers", "2"])
    assert gateway_env(parent) == {}
    child = _child(gateway_argv(parent, parent.redis_url, parent.model, parent.model_name))
    assert child.admin_token is None
    assert (child.model, child.model_name, child.cost_priors, child.cache_dir) == (None, None, None, None)


def test_serve_builds_the_same_command_for_its_extra_gateway_processes() -> None:
    parent = build_parser().parse_args(["serve", "--port", "9000", "--admin-token", TOKEN, "--gateways", "2"])
    child = _child(gateway_argv(parent, "redis://127.0.0.1:7000/0", ["/srv/models/tiny", "/srv/models/big"],
                                ["tiny-chat", "big-chat"]))
    assert (child.command, child.port, child.redis_url, child.reuse_port) == (
        "gateway", 9000, "redis://127.0.0.1:7000/0", True)
    assert (child.model, child.model_name, child.admin_token, child.workers) == (
        ["/srv/models/tiny", "/srv/models/big"], ["tiny-chat", "big-chat"], None, 1)


def test_a_gateway_process_supervises_nothing_even_when_the_environment_says_workers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TOKENGATE_WORKERS", "2")  # how the parent itself may have been told
    parent = build_parser().parse_args(["gateway", "--redis-url", "redis://x"])
    assert parent.workers == 2
    assert _child(gateway_argv(parent, parent.redis_url, None, None)).workers == 1


@pytest.mark.parametrize("value", ["0", "-1", "257", "abc", "1.5", ""])
@pytest.mark.parametrize(("command", "flag"), [("gateway", "--workers"), ("serve", "--gateways")])
def test_a_bad_process_count_is_refused_by_the_parser(
    command: str, flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args([command, "--redis-url", "redis://x", flag, value])
    assert info.value.code == 2
    assert flag in capsys.readouterr().err


@pytest.mark.parametrize("value", ["1", "2", "256"])
def test_a_process_count_from_1_to_256_is_taken(value: str) -> None:
    assert build_parser().parse_args(["gateway", "--redis-url", "redis://x", "--workers", value]).workers == int(value)


def test_serve_with_an_upstream_starts_upstream_workers_of_the_cpu_pool_only() -> None:
    from gateway.cli.server import _pools, _worker_argv

    args = build_parser().parse_args(["serve", "--upstream-url", "http://127.0.0.1:8001", "--upstream-model", "m",
                                      "--upstream-timeout", "9", "--slots", "1"])
    assert _pools(args.pools, upstream=True) == ["cpu"]
    assert _pools("cpu,gpu", upstream=True) == ["cpu", "gpu"]  # as asked
    argv = _worker_argv("cpu", "redis://127.0.0.1:1/0", args, Path("/models/x"), "x", "INFO")
    at = argv.index("--upstream-url")
    assert argv[at: at + 6] == ["--upstream-url", "http://127.0.0.1:8001", "--upstream-timeout", "9.0",
                                "--upstream-model", "m"]
    assert argv[argv.index("--slots") + 1] == "1"
    plain = _worker_argv("cpu", "redis://127.0.0.1:1/0", build_parser().parse_args(["serve"]), Path("/m"), "x", "INFO")
    assert "--upstream-url" not in plain
