import pytest

from gateway.errors import InvalidRequest
from gateway.tenancy.usage import row, slo_verdict, totals, window

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
        "slo_met": 0,
        "slo_missed": 0,
        "total_tokens": 15,
        "charged_tokens": 15,  # no token weight: what the tokens are
    }
    assert totals([r, r])["total_tokens"] == 30
    weighted = row(3, {b"prompt_tokens": b"10", b"completion_tokens": b"5", b"weighted_extra_tokens": b"30"})
    assert (weighted["total_tokens"], weighted["charged_tokens"]) == (15, 45)  # a model of token weight 3
    assert totals([r, weighted])["charged_tokens"] == 60


@pytest.mark.parametrize(
    ("state", "ttft", "total", "tokens", "slo", "verdict"),
    [
        ("done", 0.1, 1.0, 10, (None, None), None),  # no SLO: not judged
        ("cancelled", 0.1, 1.0, 10, (0.5, None), None),  # its client's choice: not judged
        ("failed", None, None, 0, (0.5, None), False),
        ("done", 0.4, 1.0, 10, (0.5, None), True),
        ("done", 0.6, 1.0, 10, (0.5, None), False),  # first token late
        ("done", 0.1, 1.0, 10, (0.5, 0.1), True),  # 0.9 s for 9 later tokens: 0.1 s each
        ("done", 0.1, 1.1, 10, (0.5, 0.1), False),  # 0.111 s each
        ("done", 0.1, 5.0, 1, (0.5, 0.1), True),  # one token: no later ones to judge
        ("done", None, 0.4, 3, (0.5, None), True),  # not streamed apart: judged by its end
        ("done", None, 0.6, 3, (0.5, None), False),
    ],
)
def test_the_slo_verdict_judges_as_the_simulator(
    state: str, ttft: float | None, total: float | None, tokens: int, slo: tuple[float | None, float | None],
    verdict: bool | None,
) -> None:
    assert slo_verdict(state, ttft, total, tokens, *slo) is verdict
