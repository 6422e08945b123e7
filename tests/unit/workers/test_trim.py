"""The trim point of a jobs stream: below it every entry was delivered and acknowledged."""

from __future__ import annotations

import pytest

from workers.trim import parse_id, trim_point


def test_parse_id() -> None:
    assert parse_id(b"1700000000000-3") == (1700000000000, 3)
    assert parse_id("5") == (5, 0)
    assert parse_id("0-0") == (0, 0)


@pytest.mark.parametrize(
    ("last_delivered", "oldest_pending", "point"),
    [
        ("0-0", None, None),  # nothing delivered yet: nothing may go
        (b"1-5", None, "1-5"),  # all delivered entries acked: up to the last one
        (b"9-0", b"3-7", "3-7"),  # an entry still pending holds everything after it
        ("9-0", "9-0", "9-0"),  # the last delivered entry is the one pending
        ("10-0", "9-99", "9-99"),  # ids compare as numbers, not as text
        ("9-99", "10-0", "9-99"),  # a pending id above last-delivered (group moved by SETID)
    ],
)
def test_trim_point_is_the_smaller_of_last_delivered_and_oldest_pending(
    last_delivered: str | bytes, oldest_pending: str | bytes | None, point: str | None
) -> None:
    assert trim_point(last_delivered, oldest_pending) == point
