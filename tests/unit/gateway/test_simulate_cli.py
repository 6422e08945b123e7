"""`tokengate simulate`: a malformed trace names its line; --json has the promised fields."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.cli.main import main

ROWS = "\n".join(f"2023-11-16 18:17:{i // 10:02d}.{i % 10}00,{50 + 37 * i % 900},{1 + i % 20}"
                 for i in range(60))


def test_a_malformed_trace_is_a_clear_error_naming_the_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n1,20,3\n2,abc,4\n")
    assert main(["simulate", "--trace", str(bad), "--no-plots", "--out", str(tmp_path)]) == 2
    assert f"{bad}:3: ContextTokens" in capsys.readouterr().err


def test_json_prints_one_object_per_policy_and_load(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + ROWS + "\n")
    args = ["simulate", "--trace", str(trace), "--policies", "fcfs,tokengate", "--rates", "2,4",
            "--json", "--no-plots", "--out", str(tmp_path), "--seed", "3"]
    assert main(args) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [(x["policy"], x["rate_rps"]) for x in lines] == [
        ("fcfs", 2.0), ("tokengate", 2.0), ("fcfs", 4.0), ("tokengate", 4.0)]
    for x in lines:
        for key in ("policy", "p50_ms", "p99_ms", "throughput_rps", "slo_attainment", "jain",
                    "within_p99_bound", "mape"):
            assert key in x
        assert x["profiles"]["gpu"]["derived"] is True
    assert main(args) == 0  # deterministic for a seed
    assert [json.loads(x) for x in capsys.readouterr().out.splitlines()] == lines
    assert (tmp_path / "summary.json").exists()


def _fleet_of_two_models(tmp_path: Path) -> Path:
    """A `tokengate workers profiles` file of a fleet serving two models: the packaged cpu profile
    as `small`'s, and a copy twice as slow per token as `large`'s."""
    packaged = json.loads((Path(__file__).parents[3] / "sched_core" / "profiles" / "cpu-smollm2-135m.json").read_text())
    small = {**packaged, "name": "small-cpu", "model": "small", "pool": "cpu"}
    large = {**packaged, "name": "large-cpu", "model": "large", "pool": "cpu"}
    large["fit"] = {phase: {k: 2 * v for k, v in terms.items()} if isinstance(terms, dict) else terms
                    for phase, terms in packaged["fit"].items()}
    fleet = tmp_path / "fleet.json"
    fleet.write_text(json.dumps({"small": {"cpu": small}, "large": {"cpu": large}}))
    return fleet


def test_a_fleet_of_two_models_is_simulated_a_domain_per_model(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + ROWS + "\n")
    fleet = _fleet_of_two_models(tmp_path)
    base = ["simulate", "--trace", str(trace), "--fleet", str(fleet), "--policies", "fcfs", "--rates", "3",
            "--gpu-workers", "0", "--no-plots", "--out", str(tmp_path / "sim"), "--seed", "3"]
    assert main(base) == 2  # which one?
    assert "the fleet serves the models large, small: pick one with --fleet-model" in capsys.readouterr().err
    assert main([*base, "--fleet-model", "medium"]) == 2
    assert "--fleet-model medium: the fleet serves large, small" in capsys.readouterr().err
    assert main([*base, "--fleet-model", "all", "--json"]) == 0
    rows = {x["model"]: x for x in map(json.loads, capsys.readouterr().out.splitlines())}
    assert {m: r["profiles"]["cpu"]["name"] for m, r in rows.items()} == {"large": "large-cpu", "small": "small-cpu"}
    assert rows["large"]["p50_ms"] > rows["small"]["p50_ms"]  # twice as slow a step: longer latencies
    assert all((tmp_path / "sim" / model / "summary.json").exists() for model in ("large", "small"))
    assert main([*base, "--fleet-model", "small", "--json"]) == 0
    (only,) = map(json.loads, capsys.readouterr().out.splitlines())
    assert only["model"] == "small" and only["p50_ms"] == rows["small"]["p50_ms"]
