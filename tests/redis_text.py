"""Everything a Redis holds, as bytes, to check that no secret was stored."""

from __future__ import annotations

import redis


def everything(client: redis.Redis) -> bytes:
    parts: list[bytes] = []
    for name in client.scan_iter(count=1000):
        parts.append(name)
        kind = client.type(name)
        if kind == b"string":
            parts.append(client.get(name) or b"")
        elif kind == b"hash":
            for k, v in client.hgetall(name).items():
                parts += [k, v]
        elif kind in (b"set",):
            parts += list(client.smembers(name))
        elif kind == b"zset":
            parts += [m for m, _ in client.zrange(name, 0, -1, withscores=True)]
        elif kind == b"list":
            parts += client.lrange(name, 0, -1)
        elif kind == b"stream":
            for _id, fields in client.xrange(name):
                for k, v in fields.items():
                    parts += [k, v]
    return b"\n".join(parts)
