"""Workers measure themselves at start and everything downstream takes it: the heartbeat and
/admin/workers, the gateway's step-time model, /metrics, the serve banner, `tokengate workers`,
a restart that re-checks instead of measuring, and `tokengate simulate --fleet` (echo engine:
no model, real Redis, real processes)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import ADMIN_TOKEN, banner_match, start

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gateway.cli", *args], capture_output=True, text=True, timeout=120)


def test_a_worker_measures_itself_and_the_gateway_prices_with_it(tmp_path: Path) -> None:
    profiles = tmp_path / "profiles"
    args = ["serve", "--engine", "echo", "--echo-step-ms", "5", "--profile-dir", str(profiles),
            "--admin-token", ADMIN_TOKEN]
    served = start(args, tmp_path)
    try:
        admin = served.auth(ADMIN_TOKEN)
        (hb,) = httpx.get(served.base_url + "/admin/workers", headers=admin).json()["data"]
        prof = hb["profile"]
        assert prof["how"] == "measured" and prof["facts"]["engine"] == "echo" and "points" not in prof
        # every echo step sleeps 5 ms: the measured decode step says so (the packaged CPU's is 45 ms)
        assert 4.0 <= prof["summary"]["decode_step_ms"] <= 15.0
        assert (profiles / f"{prof['fingerprint']}.json").is_file()
        snap = httpx.get(served.base_url + "/admin/scheduler", headers=admin).json()
        assert snap["priors"]["cpu"] == f"{hb['worker']}={prof['fingerprint']}"
        model = snap["paths"]["cpu"]["step_model"]
        assert model["decode_launch"] + model["decode_seq"] == pytest.approx(
            prof["step_model"]["decode_launch"] + prof["step_model"]["decode_seq"], rel=0.5)
        metrics = httpx.get(served.base_url + "/metrics").text
        assert re.search(r'tokengate_worker_decode_step_seconds\{.*worker="' + re.escape(hb["worker"]), metrics)
        banner_match(served, r"^\s+cpu worker .*: echo on cpu, none .*measured at start \(measured")
        conn = ["--url", served.base_url, "--admin-token", ADMIN_TOKEN]
        listed = _cli("workers", "list", *conn)
        assert listed.returncode == 0, listed.stderr
        (row,) = json.loads(listed.stdout)
        assert row["profile"] == "measured" and row["decode_step_ms"] == prof["summary"]["decode_step_ms"]
        fleet = tmp_path / "fleet.json"
        exported = _cli("workers", "profiles", *conn, "--out", str(fleet))
        assert exported.returncode == 0, exported.stderr
        assert json.loads(fleet.read_text())["cpu"]["fingerprint"] == prof["fingerprint"]
        redis_url = re.search(r"; redis (redis://\S+)\)", served.log.read_text())
        assert redis_url is not None
        for source in (str(fleet), redis_url.group(1)):
            sim = _cli("simulate", "--fleet", source, "--requests", "100", "--rates", "20", "--policies",
                       "fcfs,tokengate", "--gpu-workers", "0", "--no-plots", "--json", "--out", str(tmp_path / "sim"))
            assert sim.returncode == 0, sim.stderr
            rows = [json.loads(line) for line in sim.stdout.splitlines()]
            assert {r["profiles"]["cpu"]["name"] for r in rows} == {prof["name"]}
    finally:
        assert served.stop() == 0
    again = start(args, tmp_path)  # the same machine and settings: the stored profile, re-checked
    try:
        (hb,) = httpx.get(again.base_url + "/admin/workers", headers=again.auth(ADMIN_TOKEN)).json()["data"]
        assert hb["profile"]["how"] == "reused" and hb["profile"]["fingerprint"] == prof["fingerprint"]
        assert hb["profile"]["cost_s"] < prof["cost_s"]
    finally:
        again.stop()
