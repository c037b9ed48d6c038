"""A reproducer for vLLM's KVCacheManager (vLLM 0.23.0), written by kvprop report.

Broken: a live block belongs to one group.
It builds the manager kvprop drove, makes the calls kvprop's engine made, in order, and
exits 1 while the bug is present (an AssertionError, or vLLM's own exception), 0 once fixed,
2 where the installed vLLM does not take the manager's configuration or calls (another release's API)
or refuses the configuration at start-up.
"""

import collections
import inspect
import os
import sys

import torch
import vllm
import vllm.v1.kv_cache_interface
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.request import Request

print(f"vLLM {vllm.__version__}")
init_none_hash(sha256)  # as vLLM's engine does once per process
block_hasher = get_request_block_hasher(3, sha256)
try:
    manager = KVCacheManager(
        max_model_len=54,
        scheduler_block_size=3,
        hash_block_size=3,
        enable_caching=True,
        enable_kv_cache_events=False,
        log_stats=True,
        use_eagle=False,
        kv_cache_config=vllm.v1.kv_cache_interface.KVCacheConfig(num_blocks=18, kv_cache_tensors=[], kv_cache_groups=[vllm.v1.kv_cache_interface.KVCacheGroupSpec(layer_names=['layer0'], kv_cache_spec=vllm.v1.kv_cache_interface.FullAttentionSpec(block_size=3, num_kv_heads=1, head_size=1, dtype=torch.float32, head_size_v=1)), vllm.v1.kv_cache_interface.KVCacheGroupSpec(layer_names=['layer1'], kv_cache_spec=vllm.v1.kv_cache_interface.SlidingWindowSpec(block_size=3, num_kv_heads=1, head_size=1, dtype=torch.float32, sliding_window=4, head_size_v=1))]),
    )
except TypeError as e:  # another release's signature: no answer either way
    print(f"vLLM {vllm.__version__} does not take the manager written for vLLM 0.23.0: {e}")
    sys.exit(2)
except (AssertionError, ValueError, NotImplementedError) as e:  # its own start-up checks: not a find
    print(f"vLLM {vllm.__version__} refuses this configuration at start-up: {type(e).__name__}: {e}")
    sys.exit(2)
# the manager's calls below and their keywords; a release without them is another API: exit 2
API = {'new_step_starts': [], 'get_computed_blocks': [], 'allocate_slots': ['num_new_computed_tokens', 'new_computed_blocks', 'num_lookahead_tokens', 'num_external_computed_tokens', 'delay_cache_blocks']}
for method, keywords in API.items():
    takes = inspect.signature(getattr(manager, method)).parameters if hasattr(manager, method) else None
    if takes is None or not set(keywords) <= set(takes):
        print(f"vLLM {vllm.__version__} does not take manager.{method}() with {keywords} "
              "as vLLM 0.23.0 does")
        sys.exit(2)
requests = {}  # request id -> vLLM Request
freed = set()  # the requests freed

# ---- from kvprop's drain (engine steps until every request has finished)
# engine step 1
manager.new_step_starts()
requests['r0'] = Request(request_id='r0', prompt_token_ids=[0, 0, 1, 2, 3, 1, 1, 2, 2, 1, 0, 3, 2, 3, 3, 0, 1, 0, 1, 0, 3, 1, 3], sampling_params=SamplingParams(max_tokens=1), pooling_params=None, block_hasher=block_hasher)
requests['r0'].num_computed_tokens = 0
computed0 = manager.get_computed_blocks(requests['r0'])
manager.allocate_slots(requests['r0'], 9, num_new_computed_tokens=0, new_computed_blocks=computed0[0], num_lookahead_tokens=0, num_external_computed_tokens=0, delay_cache_blocks=False)  # granted when recorded
# engine step 2
manager.new_step_starts()
requests['r0'].num_computed_tokens = 9
manager.allocate_slots(requests['r0'], 9, num_lookahead_tokens=0)  # granted when recorded
# engine step 3
manager.new_step_starts()
requests['r0'].num_computed_tokens = 18
manager.allocate_slots(requests['r0'], 5, num_lookahead_tokens=0)  # granted when recorded
requests['r1'] = Request(request_id='r1', prompt_token_ids=[0], sampling_params=SamplingParams(max_tokens=1), pooling_params=None, block_hasher=block_hasher)
requests['r1'].num_computed_tokens = 0
computed1 = manager.get_computed_blocks(requests['r1'])
manager.allocate_slots(requests['r1'], 1, num_new_computed_tokens=0, new_computed_blocks=computed1[0], num_lookahead_tokens=0, num_external_computed_tokens=0, delay_cache_blocks=False)  # granted when recorded
requests['r2'] = Request(request_id='r2', prompt_token_ids=[0, 0, 1, 2, 3, 1], sampling_params=SamplingParams(max_tokens=1), pooling_params=None, block_hasher=block_hasher)
requests['r2'].num_computed_tokens = 0
computed2 = manager.get_computed_blocks(requests['r2'])
manager.allocate_slots(requests['r2'], 1, num_new_computed_tokens=3, new_computed_blocks=computed2[0], num_lookahead_tokens=0, num_external_computed_tokens=2, delay_cache_blocks=True)  # granted when recorded

# The property kvprop found broken (block-in-two-groups): a live block belongs to one group.
live = [request_id for request_id in requests if request_id not in freed]
null = manager.block_pool.null_block.block_id
groups_of = {}
for request_id in live:
    for group, block_ids in enumerate(manager.get_block_ids(request_id)):
        for block_id in block_ids:
            if block_id != null:
                groups_of.setdefault(block_id, set()).add(group)
in_two = {b: sorted(g) for b, g in sorted(groups_of.items()) if len(g) > 1}
assert not in_two, (
    f"block ids in the block tables of more than one KV cache group at once (block id -> groups): {in_two}; "
    "a block holds one group's KV, so the groups overwrite each other's"
)
print("OK: block-in-two-groups holds; the bug is fixed")
