"""A reproducer for vLLM's v1 KVCacheManager: a model with static attention sinks cannot start.

A sink-attention layer (``StaticSinkAttention``, used by OpenPangu when its config sets
``param_sink_number``) declares a ``SinkFullAttentionSpec``; the scheduler's ``KVCacheManager``
builds the manager vLLM's registry names for it, ``SinkFullAttentionManager``, through its
coordinator, which passes every manager the same keywords. The sink manager's ``__init__`` takes
a fixed list without ``**kwargs``: from 0.23.0 it lacks ``scheduler_block_size`` (fixed upstream
by vLLM PR #46384, as the closed PR #44951 says), from 0.30.0 ``needs_kv_cache_zeroing``.

Exits 1 while the bug is present (vLLM's own TypeError), 0 once the manager builds, 2 where the
installed vLLM has no sink spec or its KVCacheManager takes none of these keywords.
"""

import inspect
import sys

import torch
import vllm
import vllm.v1.kv_cache_interface as kvi
from vllm.v1.core.kv_cache_manager import KVCacheManager

print(f"vLLM {vllm.__version__}")
if not hasattr(kvi, "SinkFullAttentionSpec"):
    print(f"vLLM {vllm.__version__} has no SinkFullAttentionSpec: another release's API")
    sys.exit(2)
BLOCK = 16
# what StaticSinkAttention.get_kv_cache_spec declares: sink_len is a whole number of blocks
spec = kvi.SinkFullAttentionSpec(
    block_size=BLOCK, num_kv_heads=1, head_size=64, head_size_v=64, sink_len=BLOCK, dtype=torch.bfloat16
)
config = kvi.KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[kvi.KVCacheGroupSpec(["layer0"], spec)])
# what the engine passes (Scheduler.__init__); a release without scheduler_block_size or
# hash_block_size derives both from the one group's block size, the value passed here
wanted = dict(kv_cache_config=config, max_model_len=1024, scheduler_block_size=BLOCK, hash_block_size=BLOCK,
              enable_caching=True)
takes = inspect.signature(KVCacheManager.__init__).parameters
if "kv_cache_config" not in takes or "enable_caching" not in takes:
    print(f"vLLM {vllm.__version__}'s KVCacheManager takes another API")
    sys.exit(2)
manager = KVCacheManager(**{k: v for k, v in wanted.items() if k in takes})  # raises while the bug is present
built = [type(m).__name__ for m in manager.coordinator.single_type_managers]
print("built:", built)
assert built == ["SinkFullAttentionManager"], built
