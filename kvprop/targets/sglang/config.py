"""What an ``SglangScheduler`` is built from and what one of its steps reports.

``SglangConfig`` is the part of SGLang's server arguments its KV cache reads, with the start-up
checks SGLang applies to them; a bad value is a ``ConfigError`` naming the field.
"""

from __future__ import annotations

import attrs

from kvprop.errors import ConfigError


def _positive(name: str):
    def check(instance, attribute, value):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"target 'sglang': {name} must be a positive integer, got {value!r}")

    return check


@attrs.frozen
class SglangConfig:
    """What a ``Scheduler`` is started with, reduced to what its KV cache reads."""

    page_size: int = attrs.field(default=1, validator=_positive("page_size"))
    pool_tokens: int = attrs.field(default=96, validator=_positive("pool_tokens"))
    chunked_prefill_size: int = attrs.field(default=16, validator=_positive("chunked_prefill_size"))
    sliding_window: int | None = None
    swa_pool_tokens: int = attrs.field(default=64, validator=_positive("swa_pool_tokens"))
    max_running_requests: int = attrs.field(default=8, validator=_positive("max_running_requests"))
    max_context_len: int = attrs.field(default=256, validator=_positive("max_context_len"))
    schedule_policy: str = "fcfs"
    tree_core: str = "python"  # 0.5.19 on: "python" or "rust" (UnifiedRadixCache's tree core)

    def __attrs_post_init__(self):
        # server_args validation (arg_groups/validation_hook.py, 0.5.23; server_args.py, 0.5.18)
        if self.chunked_prefill_size % self.page_size:
            raise ConfigError(
                f"target 'sglang': chunked_prefill_size ({self.chunked_prefill_size}) must be a multiple "
                f"of page_size ({self.page_size})"
            )
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int) or self.sliding_window < 1):
            raise ConfigError(
                f"target 'sglang': sliding_window must be None or a positive integer, got {self.sliding_window!r}"
            )
        if self.tree_core not in ("python", "rust"):
            raise ConfigError(f"target 'sglang': tree_core must be 'python' or 'rust', got {self.tree_core!r}")

    @property
    def swa(self) -> bool:
        return self.sliding_window is not None


@attrs.frozen
class StepResult:
    """One turn of the event loop: the batch it ran and what it did to requests."""

    mode: str  # "extend", "decode" or "idle"
    admitted: tuple[str, ...] = ()  # entered from the waiting queue (new or retracted)
    finished: tuple[str, ...] = ()  # released their KV this step (finished or aborted)
    retracted: tuple[str, ...] = ()  # sent back to the waiting queue
    scheduled: tuple[tuple[str, int], ...] = ()  # (request, tokens computed) per request in the batch
