"""The engine that drives an allocator the way a server does: a scheduler, a worker and a buggy caller.

``Engine`` composes three mixins: the scheduler (``kvprop.sim.scheduler``: the requests, their
queues and each ``step``'s choice of what runs), the worker (``kvprop.sim.worker``: the step's
block copies and fingerprint writes into paged memory) and the misuse rules
(``kvprop.sim.misuse``: malformed calls against the target's caller contract). Every call on the
allocator crosses ``kvprop.sim.target_calls``. The engine judges nothing: it calls hooks where
blocks change hands (around every allocation, at the connector hand-off, before every write),
and the checker (``kvprop.check.checker``) implements them. A target with its own scheduler
subclasses ``Engine`` and takes over ``step``, ``release`` and ``worker_block_ids``.
"""

from __future__ import annotations

from kvprop.allocator.specs import EngineConfig, Mamba
from kvprop.capabilities import EVERY, Capabilities
from kvprop.errors import ConfigError
from kvprop.sim.connector import Connector
from kvprop.sim.hooks import Hooks
from kvprop.sim.misuse import MISUSES, BuggyCaller
from kvprop.sim.pipeline import Pipeline
from kvprop.sim.scheduler import Scheduler
from kvprop.sim.step_report import StepReport
from kvprop.sim.target_calls import TargetCalls
from kvprop.sim.worker import Worker

__all__ = [
    "MISUSES",
    "Engine",
    "Hooks",
    "StepReport",
]


class Engine(Pipeline, Scheduler, Worker, BuggyCaller):
    """A simulated server over one allocator: its scheduler, its worker and its buggy caller."""

    terms = "blocks"  # judged by kvprop's block invariants; an engine with its own terms names them
    # the external tier's (a variant plants a bug in it; None: the target's own is in charge)
    connector_class: type[Connector] | None = Connector

    def __init__(
        self,
        config: EngineConfig,
        allocator,
        view,
        device: str | None = None,
        hooks: Hooks | None = None,
        capabilities: Capabilities = EVERY,
    ):
        self.config = config
        self.allocator = allocator
        self.capabilities = capabilities  # what the target declares (kvprop.targets.protocol); kvprop's own: every one
        self.target_calls = TargetCalls(allocator)
        self.view = view
        self.specs = config.allocator.groups
        self.state_groups = frozenset(g for g, spec in enumerate(self.specs) if isinstance(spec, Mamba))
        self.block_size = config.allocator.block_size
        self.hooks = hooks or Hooks()
        self._init_worker(config.allocator.num_blocks, device)
        if config.tier_chunk != 1 and self.connector_class is not None:
            raise ConfigError(
                f"EngineConfig.tier_chunk must be 1 for kvprop's own tier, which keeps one block per key, got "
                f"{config.tier_chunk}: a chunked tier runs through vLLM's scheduler (--target vllm-scheduler)"
            )
        self.connector = (
            None
            if config.connector == "off" or self.connector_class is None
            else self.connector_class(
                config.connector,
                self.memory,
                self.block_size,
                len(self.specs),
                self.state_groups,
                config.tier_blocks,
                config.tier_policy,
            )
        )
        self._init_scheduler()
        self._init_pipeline()
