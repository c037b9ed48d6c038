"""The values of the command line: each type reads one option's text and says, when it cannot,
what was wrong and what is allowed (argparse turns that into exit 2)."""

from __future__ import annotations

import argparse
import math
import os

MAX_OPS = 10_000
MAX_SEED = 2**63 - 1


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


# ---- value types: a bad value is argparse's error (exit 2), never a silent clamp ----------


def _integer(text: str, lo: int, hi: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer {what}, got {text!r}") from None
    if not lo <= value <= hi:
        raise argparse.ArgumentTypeError(f"expected an integer {what}, got {value}")
    return value


def positive_int(text: str) -> int:
    return _integer(text, 1, MAX_SEED, ">= 1")


def operations(text: str) -> int:
    return _integer(text, 1, MAX_OPS, f"in [1, {MAX_OPS:,}]")


def seed(text: str) -> int:
    return _integer(text, 0, MAX_SEED, "in [0, 2**63)")


def workers(text: str) -> int:
    limit = 4 * cores()
    return _integer(text, 1, limit, f"in [1, {limit}] (4 x the {cores()} cores here)")


def kinds(text: str) -> frozenset:
    """Comma-separated violation kinds (``kvprop.check.kinds``), ``target-crash`` or ``target-hang``."""
    from kvprop.check.kinds import KINDS
    from kvprop.errors import bounded

    allowed = sorted(KINDS) + ["target-crash", "target-hang", "target-oom"]
    names = [name.strip() for name in text.split(",")]
    unknown = [name for name in names if name not in allowed]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown kind(s) {bounded(unknown)}; allowed: {', '.join(allowed)}")
    return frozenset(names)


REDIS_SCHEMES = ("redis", "rediss", "unix")


def redis_url(text: str) -> str:
    """``redis://host:port/db`` (or ``rediss://``, ``unix:///path``): scheme, host and port checked."""
    from urllib.parse import urlsplit

    allowed = "redis://HOST[:PORT][/DB], rediss://... or unix:///PATH"
    try:
        url = urlsplit(text)
        port = url.port
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not a URL ({e}); expected {allowed}") from None
    if url.scheme not in REDIS_SCHEMES:
        raise argparse.ArgumentTypeError(f"scheme {url.scheme!r} of {text!r} is not one of {REDIS_SCHEMES}")
    if url.scheme == "unix":
        if not url.path:
            raise argparse.ArgumentTypeError(f"{text!r} names no socket path; expected {allowed}")
    elif not url.hostname:
        raise argparse.ArgumentTypeError(f"{text!r} names no host; expected {allowed}")
    elif port is not None and not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port {port} of {text!r} is not in [1, 65535]")
    return text


def _positive(text: str, unit: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of {unit} > 0, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a finite number of {unit} > 0, got {text!r}")
    return value


def mebibytes(text: str) -> float:
    return _positive(text, "MiB")


def seconds(text: str) -> float:
    return _positive(text, "seconds")
