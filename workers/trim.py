"""Trimming a jobs stream without losing a job.

An entry of a jobs stream (``wire.jobs_stream``) may go once it was delivered and acknowledged. Entries
are delivered in id order, so every entry below the group's last-delivered id was
delivered; every delivered entry below the oldest pending one was acknowledged. Entries
below the smaller of the two ids are therefore done, and ``XTRIM MINID`` to that id keeps
everything else: entries not yet delivered and entries still pending. An acknowledged
entry never becomes pending again and the last-delivered id only grows, so a trim point
read a moment before the XTRIM is still safe when it runs.
"""

from __future__ import annotations

import redis

from common import wire

StreamId = tuple[int, int]


def parse_id(value: str | bytes) -> StreamId:
    """``"1700000000000-3"`` -> (1700000000000, 3); a bare ``"5"`` is (5, 0)."""
    ms, _, seq = wire.text(value).partition("-")
    return int(ms), int(seq or 0)


def trim_point(last_delivered: str | bytes, oldest_pending: str | bytes | None) -> str | None:
    """The MINID below which every entry of the group is done, or None if there is none."""
    point = parse_id(last_delivered)
    if oldest_pending is not None:
        point = min(point, parse_id(oldest_pending))
    if point == (0, 0):
        return None
    return f"{point[0]}-{point[1]}"


def trim_jobs_stream(client: redis.Redis, stream: str, group: str = wire.GROUP) -> str | None:
    """Trim ``stream`` (approximately) to its group's trim point; returns that point."""
    pipe = client.pipeline(transaction=False)
    pipe.xpending(stream, group)
    pipe.xinfo_groups(stream)
    pending, groups = pipe.execute()
    last = next((g["last-delivered-id"] for g in groups if wire.text(g["name"]) == group), None)
    if last is None:
        return None
    point = trim_point(last, pending["min"] if pending["pending"] else None)
    if point is not None:
        client.xtrim(stream, minid=point, approximate=True)
    return point
