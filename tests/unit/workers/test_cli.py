"""`tokengate worker` flags: every default comes from WorkerSettings, every flag is also
an environment variable."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from workers.cli import add_model_args, add_worker_args, setting_default, settings_from_args
from workers.settings import WorkerSettings


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--redis-url", default="redis://127.0.0.1:1/0")
    add_model_args(parser)
    add_worker_args(parser)
    return parser.parse_args(argv)


@pytest.fixture(autouse=True)
def _no_tokengate_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in [n for n in os.environ if n.startswith("TOKENGATE_")]:
        monkeypatch.delenv(name)


def test_flag_defaults_are_the_settings_defaults() -> None:
    built = settings_from_args(_parse())
    reference = WorkerSettings(redis_url=built.redis_url, worker_id=built.worker_id)
    assert built == reference  # a flag with a default of its own would differ here


def test_setting_default_reads_the_dataclass() -> None:
    plain = {f.name: f.default for f in dataclasses.fields(WorkerSettings) if f.default is not dataclasses.MISSING}
    assert {name: setting_default(name) for name in plain} == plain
    with pytest.raises(KeyError):
        setting_default("worker_id")  # a default factory, not a value


def test_environment_variables_set_flags_with_their_types(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {
        "TOKENGATE_POOL": "gpu",
        "TOKENGATE_ENGINE": "echo",
        "TOKENGATE_SLOTS": "7",
        "TOKENGATE_STEP_TOKENS": "128",
        "TOKENGATE_ECHO_TOKENS": "5",
        "TOKENGATE_ECHO_STEP_MS": "20",
        "TOKENGATE_CLAIM_IDLE": "30",
        "TOKENGATE_HEARTBEAT": "2",
        "TOKENGATE_HEARTBEAT_TTL": "9",
        "TOKENGATE_MAX_DELIVERIES": "4",
        "TOKENGATE_THREADS": "3",
        "TOKENGATE_WORKER_ID": "w-env",
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    s = settings_from_args(_parse())
    assert (s.pool, s.engine, s.slots, s.echo_tokens, s.echo_step_s) == ("gpu", "echo", 7, 5, 0.02)
    assert (s.claim_idle_s, s.heartbeat_s, s.heartbeat_ttl_s, s.max_deliveries) == (30.0, 2.0, 9.0, 4)
    assert (s.threads, s.worker_id, s.step_tokens) == (3, "w-env", 128)


def test_a_flag_beats_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENGATE_SLOTS", "7")
    assert _parse("--slots", "9").slots == 9
    assert _parse("--step-tokens", "0").step_tokens == 0


def test_an_upstream_url_makes_an_upstream_worker_and_the_upstream_engine_needs_one() -> None:
    built = settings_from_args(_parse("--upstream-url", "http://127.0.0.1:8001", "--upstream-model", "m",
                                      "--upstream-timeout", "5", "--slots", "1"))
    assert (built.engine, built.upstream_url, built.upstream_model, built.upstream_timeout_s, built.slots) == (
        "upstream", "http://127.0.0.1:8001", "m", 5.0, 1)
    with pytest.raises(ValueError, match="needs an upstream URL"):
        settings_from_args(_parse("--engine", "upstream"))
    with pytest.raises(ValueError, match="timeout must be positive"):
        settings_from_args(_parse("--upstream-url", "http://h:1", "--upstream-timeout", "0"))
