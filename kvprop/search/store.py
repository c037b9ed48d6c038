"""Sharing failures between machines through Redis (the optional ``redis`` extra).

The Hypothesis engine uses Hypothesis's own ``RedisExampleDatabase``; walk traces go to a
Redis list per allocator under test, so every machine fuzzing the same target replays what
any of them found and stops when another finds something.
"""

from __future__ import annotations

import json

from kvprop.errors import ConfigError
from kvprop.search.trace import Trace, from_dict, to_dict


def _client(url: str):
    try:
        import redis
    except ImportError:
        raise ConfigError("--redis needs the 'redis' package: pip install 'kvprop[redis]'") from None
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=5)
        client.ping()
    except (redis.exceptions.RedisError, ValueError, OSError) as e:
        raise ConfigError(f"--redis {url}: cannot connect ({type(e).__name__}: {e})") from None
    return client


def hypothesis_database(url: str):
    from hypothesis.extra.redis import RedisExampleDatabase

    return RedisExampleDatabase(_client(url), key_prefix=b"kvprop-hypothesis:")


class TraceStore:
    """Traces found for one allocator under test (target + variant), newest last."""

    def __init__(self, url: str, target: str | None, variant: str | None):
        self.client = _client(url)
        self.key = f"kvprop:traces:{target or 'kvprop'}:{variant or 'correct'}"

    def push(self, trace: Trace) -> None:
        self.client.rpush(self.key, json.dumps(to_dict(trace)))

    def __len__(self) -> int:
        return int(self.client.llen(self.key))

    def traces(self, start: int = 0) -> list[Trace]:
        return [from_dict(json.loads(raw)) for raw in self.client.lrange(self.key, start, -1)]
