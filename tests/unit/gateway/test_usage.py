import pytest

from gateway.errors import InvalidRequest
from gateway.tenancy.usage import row, totals, window

NOW = 1_700_000_000.0


def test_the_window_defaults_to_the_last_hour() -> None:
    first, last = window(None, None, NOW)
    assert last == int(NOW // 60) and last - first == 60


def test_the_window_takes_unix_seconds() -> None:
    assert window("120", "300", NOW) == (2, 5)


@pytest.mark.parametrize(
    ("since", "until", "param"),
    [("x", None, "since"), (None, "-1", "until"), ("600", "60", "since"), ("0", str(NOW), "since")],
)
def test_bad_windows_are_400(since: str | None, until: str | None, param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        window(since, until, NOW)
    assert info.value.param == param


def test_rows_and_totals() -> None:
    r = row(3, {b"requests": b"2", b"prompt_tokens": b"10", b"completion_tokens": b"5"})
    assert r == {
        "minute": 180,
        "requests": 2,
        "rate_limited": 0,
        "prompt_tokens": 10,
        "completion_tokens": 5,
        "total_tokens": 15,
    }
    assert totals([r, r])["total_tokens"] == 30
