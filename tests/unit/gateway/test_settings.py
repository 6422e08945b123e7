import dataclasses
from pathlib import Path

import pytest

from gateway.settings import GatewaySettings
from sched_core.smdp import packaged_table


def test_defaults_are_valid_and_frozen() -> None:
    s = GatewaySettings(redis_url="redis://x", model_name="m")
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.port = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    "kw",
    [{"redis_url": ""}, {"port": 0}, {"max_body_bytes": 10}, {"request_timeout_s": 0}, {"default_max_tokens": 0},
     {"default_temperature": -0.1}, {"default_temperature": 2.5}, {"default_top_p": 0.0}, {"default_top_p": 1.1}],
)
def test_invalid_settings_are_refused_at_start(kw: dict[str, object]) -> None:
    args = {"redis_url": "redis://x", "model_name": "m", **kw}
    with pytest.raises(ValueError):
        GatewaySettings(**args)  # type: ignore[arg-type]


def test_the_admin_token_is_checked_and_never_shown() -> None:
    with pytest.raises(ValueError):
        GatewaySettings(redis_url="redis://x", model_name="m", admin_token="short")
    token = "a-long-admin-token-0123"
    s = GatewaySettings(redis_url="redis://x", model_name="m", admin_token=token)
    assert token not in repr(s)


def test_a_batcher_that_waits_for_arrivals_to_end_is_refused() -> None:
    with pytest.raises(ValueError, match="until arrivals end"):
        GatewaySettings(redis_url="redis://x", model_name="m", policy="fixed:batch=4")
    assert GatewaySettings(redis_url="redis://x", model_name="m", policy="fixed:batch=4,window_ms=5").policy


def test_the_smdp_policy_takes_the_packaged_table_or_a_file_and_a_bad_file_stops_start_up(tmp_path: Path) -> None:
    assert GatewaySettings(redis_url="redis://x", model_name="m", policy="smdp").policy == "smdp"
    packaged_table().dump(tmp_path / "t.json")
    assert GatewaySettings(redis_url="redis://x", model_name="m", policy=f"smdp:{tmp_path / 't.json'}").policy
    (tmp_path / "bad.json").write_text('{"states": {}}')
    with pytest.raises(ValueError, match=r"bad\.json: 'states' must name every state"):
        GatewaySettings(redis_url="redis://x", model_name="m", policy=f"smdp:{tmp_path / 'bad.json'}")
