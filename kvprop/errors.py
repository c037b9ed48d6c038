"""Exceptions shared by every layer, so that low modules can raise what high ones catch."""

from __future__ import annotations


def bounded(items, limit: int = 8) -> str:
    """The first ``limit`` items, then how many more: an error message stays short whatever the
    input it quotes (a trace with ten thousand unknown fields, a list of made-up names)."""
    items = [repr(item) if not isinstance(item, str) else item for item in items]
    shown = ", ".join(items[:limit])
    return shown if len(items) <= limit else f"{shown} and {len(items) - limit:,} more"


class KvpropError(Exception):
    """Base class: every error kvprop raises on purpose."""


class ConfigError(KvpropError, ValueError):
    """A configuration value is out of range; the message names the field and the range."""


class TargetError(KvpropError):
    """The target cannot be used at all: importing it or its factory raised. The target's
    error, not kvprop's and not a find; the message names the target and the exception."""


class LimitError(KvpropError):
    """An input asks for more than any real run produces (a hand-made or hostile trace)."""


class AllocatorError(KvpropError):
    """The allocator was asked for something its contract forbids (e.g. more blocks than free)."""


class RequestError(KvpropError, ValueError):
    """A request is malformed, unknown, or one the allocator can never serve."""


class Violation(KvpropError, AssertionError):
    """An invariant does not hold.

    ``kind`` is a short stable name (the minimiser keeps a candidate only while the same
    kind still fails); ``blocks``, ``requests`` and ``groups`` name what is involved; ``cause``,
    where a kind holds several mechanisms, names the one seen (``liveness``: what the stalled
    requests wait for, ``kvprop.check.stall``), and joins the find's signature.
    """

    def __init__(self, kind: str, message: str, *, blocks=(), requests=(), groups=(), cause: str | None = None):
        self.kind = kind
        self.cause = cause
        self.blocks = tuple(blocks)
        self.requests = tuple(requests)
        self.groups = tuple(groups)
        where = []
        if self.blocks:
            where.append(f"blocks={list(self.blocks)}")
        if self.requests:
            where.append(f"requests={list(self.requests)}")
        if self.groups:
            where.append(f"groups={list(self.groups)}")
        suffix = f" [{', '.join(where)}]" if where else ""
        super().__init__(f"{kind}: {message}{suffix}")


class TargetCrash(Exception):
    """The allocator under test raised inside one of its own calls: a finding (``target-crash``),
    never confused with a ``Violation`` (an invariant failed) or an error of kvprop itself.

    ``exception_type`` names the original exception; ``where`` is the target's innermost frame."""

    kind = "target-crash"

    def __init__(self, call: str, error: BaseException):
        self.call = call
        self.error = error
        self.exception_type = type(error).__name__
        frame = None
        tb = error.__traceback__
        while tb is not None:
            frame = tb
            tb = tb.tb_next
        self.where = (
            f"{frame.tb_frame.f_code.co_filename}:{frame.tb_lineno} in {frame.tb_frame.f_code.co_name}"
            if frame
            else "?"
        )
        notes = "".join(f" ({note})" for note in error.__dict__.get("__notes__", ()))
        super().__init__(
            f"target-crash: {self.exception_type} raised by the target's {call}() at {self.where}: {error}{notes}"
        )
