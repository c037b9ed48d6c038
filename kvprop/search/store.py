"""Sharing failures between machines through Redis (the optional ``redis`` extra).

The Hypothesis engine uses Hypothesis's own ``RedisExampleDatabase``; walk traces go to a
Redis list per allocator under test, so every machine fuzzing the same target replays what
any of them found and stops when another finds something.

Redis is a convenience, never what a campaign stands on: one that cannot be reached at the
start is unusable input (exit 2, naming the URL), but one lost later (the server killed,
frozen, or the network gone) leaves the campaign going on locally, said once. Each call is
held to ``TIMEOUT`` seconds, so that a frozen server costs a campaign a few seconds, not its
life.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable

from kvprop.errors import ConfigError
from kvprop.search.trace import Trace, from_dict, to_dict

TIMEOUT = 3.0  # seconds a connection or a reply may take before Redis counts as lost


def _client(url: str):
    try:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry
    except ImportError:
        raise ConfigError("--redis needs the 'redis' package: pip install 'kvprop[redis]'") from None
    try:
        # One immediate retry makes a connection the server dropped anew; redis-py's default of
        # ten retries with backoff would hold each call to a frozen server for a minute.
        client = redis.Redis.from_url(
            url, socket_connect_timeout=TIMEOUT, socket_timeout=TIMEOUT, retry=Retry(NoBackoff(), 1)
        )
        client.ping()
    except (redis.exceptions.RedisError, ValueError, OSError) as e:
        raise ConfigError(f"--redis {url}: cannot connect ({type(e).__name__}: {e})") from None
    return client


def _lost_errors() -> tuple:
    """What a call raises when Redis is gone or not answering (not when a command is wrong)."""
    import redis

    return (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def hypothesis_database(url: str):
    """Hypothesis's Redis database, which goes on in memory once Redis is lost: a worker's
    example database is a help to the search, and losing it must not end the search."""
    from hypothesis.database import ExampleDatabase, InMemoryExampleDatabase
    from hypothesis.extra.redis import RedisExampleDatabase

    class LocalOnLoss(ExampleDatabase):
        def __init__(self, shared):
            super().__init__()
            self.shared, self.local = shared, InMemoryExampleDatabase()

        def _either(self, call):
            if self.shared is not None:
                try:
                    return call(self.shared)
                except _lost_errors():  # the parent's TraceStore notices the same loss and says it
                    self.shared = None
            return call(self.local)

        def fetch(self, key):
            return iter(self._either(lambda db: list(db.fetch(key))))

        def save(self, key, value):
            self._either(lambda db: db.save(key, value))

        def delete(self, key, value):
            self._either(lambda db: db.delete(key, value))

        def move(self, src, dest, value):
            self._either(lambda db: db.move(src, dest, value))

    return LocalOnLoss(RedisExampleDatabase(_client(url), key_prefix=b"kvprop-hypothesis:"))


class TraceStore:
    """Traces found for one allocator under test (target + variant), newest last, as one
    campaign uses them: it pushes its own finds and reads those of other machines.

    Connecting is checked here (``ConfigError`` naming the URL). Once a later call finds Redis
    lost, ``say`` is told once and the store is local from then on: pushes are dropped and no
    other machine's find arrives, so the campaign goes on with what it has."""

    def __init__(self, url: str, target: str | None, variant: str | None, say: Callable[[str], None] | None = None):
        self.url = url
        self.client = _client(url)
        self.key = f"kvprop:traces:{target or 'kvprop'}:{variant or 'correct'}"
        self.say = say or _to_stderr
        self.lost: str | None = None  # why Redis stopped answering; from then on every call is local
        self.held: set[str] = set()  # traces (as stored) this campaign pushed or read: never pushed back
        self.read = 0  # how far into the list this campaign has read

    def _call(self, command: str, *args):
        """The Redis command's reply, or None once Redis is lost."""
        if self.lost is not None:
            return None
        try:
            return getattr(self.client, command)(*args)
        except _lost_errors() as e:
            self.lost = f"{type(e).__name__}: {e}"
            self.say(f"the shared store at {self.url} is unreachable ({self.lost}): going on locally")
            return None

    def push(self, trace: Trace) -> None:
        """Share a find, unless this campaign already pushed it or read it from the store."""
        raw = json.dumps(to_dict(trace))
        if raw not in self.held:
            self.held.add(raw)
            self._call("rpush", self.key, raw)

    def news(self) -> list[Trace]:
        """The traces pushed since this campaign last read (at first every stored one), less
        its own."""
        raws = [raw.decode() for raw in self._call("lrange", self.key, self.read, -1) or []]
        self.read += len(raws)
        fresh = [raw for raw in raws if raw not in self.held]
        self.held.update(fresh)
        return [from_dict(json.loads(raw)) for raw in fresh]

    def __len__(self) -> int:
        return int(self._call("llen", self.key) or 0)

    def traces(self, start: int = 0) -> list[Trace]:
        return [from_dict(json.loads(raw)) for raw in self._call("lrange", self.key, start, -1) or []]


def sharing(on_find: Callable[[Trace, str | None], None] | None, store: TraceStore | None):
    """``on_find`` followed by a push of the find to ``store``: every find, triaged or not, the
    process pool's and the Ray campaign's alike, goes to the other machines once it is on disk."""
    if store is None:
        return on_find

    def found(trace: Trace, log: str | None = None) -> None:
        if on_find is not None:
            on_find(trace, log)
        store.push(trace)

    return found
