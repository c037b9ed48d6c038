"""A reproducer for vLLM's KVCacheManager (vLLM 0.33.0), written by kvprop report.

Broken: vLLM raises no exception.
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
block_hasher = get_request_block_hasher(2, sha256)
try:
    manager = KVCacheManager(
        max_model_len=80,
        scheduler_block_size=16,
        hash_block_size=2,
        enable_caching=True,
        enable_kv_cache_events=True,
        log_stats=True,
        use_eagle=False,
        kv_cache_config=vllm.v1.kv_cache_interface.KVCacheConfig(num_blocks=5, kv_cache_tensors=[], kv_cache_groups=[vllm.v1.kv_cache_interface.KVCacheGroupSpec(layer_names=['layer0'], kv_cache_spec=vllm.v1.kv_cache_interface.FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=1, dtype=torch.float32, head_size_v=1)), vllm.v1.kv_cache_interface.KVCacheGroupSpec(layer_names=['layer1'], kv_cache_spec=vllm.v1.kv_cache_interface.MambaSpec(block_size=16, shapes=((2,),), dtypes=(torch.float32,), mamba_cache_mode='align'))]),
    )
except TypeError as e:  # another release's signature: no answer either way
    print(f"vLLM {vllm.__version__} does not take the manager written for vLLM 0.33.0: {e}")
    sys.exit(2)
except (AssertionError, ValueError, NotImplementedError) as e:  # its own start-up checks: not a find
    print(f"vLLM {vllm.__version__} refuses this configuration at start-up: {type(e).__name__}: {e}")
    sys.exit(2)
# the manager's calls below and their keywords; a release without them is another API: exit 2
API = {'take_events': [], 'new_step_starts': [], 'get_computed_blocks': [], 'allocate_slots': ['num_new_computed_tokens', 'new_computed_blocks', 'num_lookahead_tokens', 'num_external_computed_tokens', 'delay_cache_blocks'], 'take_kv_cache_block_copies': [], 'cache_blocks': [], 'free': []}
for method, keywords in API.items():
    takes = inspect.signature(getattr(manager, method)).parameters if hasattr(manager, method) else None
    if takes is None or not set(keywords) <= set(takes):
        print(f"vLLM {vllm.__version__} does not take manager.{method}() with {keywords} "
              "as vLLM 0.33.0 does")
        sys.exit(2)
requests = {}  # request id -> vLLM Request
freed = set()  # the requests freed

# ---- from kvprop operation 0 (AddRequest)
manager.take_events()

# ---- from kvprop operation 1 (AddRequest)
manager.take_events()

# ---- from kvprop's drain (engine steps until every request has finished)
# engine step 1
manager.new_step_starts()
requests['r0'] = Request(request_id='r0', prompt_token_ids=[0, 0, 1], sampling_params=SamplingParams(max_tokens=1, extra_args={'kv_cache_report_mode': 'full'}), pooling_params=None, block_hasher=block_hasher)
requests['r0'].num_computed_tokens = 0
requests['r0'].shared_prefix_boundary = 0
computed0 = manager.get_computed_blocks(requests['r0'])
manager.allocate_slots(requests['r0'], 1, num_new_computed_tokens=0, new_computed_blocks=computed0[0], num_lookahead_tokens=0, num_external_computed_tokens=0, delay_cache_blocks=False)  # granted when recorded
copies, retained = manager.take_kv_cache_block_copies()
if retained:
    manager.block_pool.free_blocks(retained)
manager.take_events()
# engine step 2
manager.new_step_starts()
requests['r0'].num_computed_tokens = 1
manager.allocate_slots(requests['r0'], 1, num_lookahead_tokens=0)  # granted when recorded
copies, retained = manager.take_kv_cache_block_copies()
if retained:
    manager.block_pool.free_blocks(retained)
manager.take_events()
# engine step 3
manager.new_step_starts()
requests['r0'].num_computed_tokens = 2
manager.allocate_slots(requests['r0'], 1, num_lookahead_tokens=0)  # granted when recorded
copies, retained = manager.take_kv_cache_block_copies()
if retained:
    manager.block_pool.free_blocks(retained)
requests['r0'].num_computed_tokens = 3
manager.cache_blocks(requests['r0'], 3)
manager.free(requests['r0'])
freed.add('r0')
manager.take_events()
# engine step 4
manager.new_step_starts()
requests['r1'] = Request(request_id='r1', prompt_token_ids=[0, 0, 1, 1], sampling_params=SamplingParams(max_tokens=1, extra_args={'kv_cache_report_mode': 'full'}), pooling_params=None, block_hasher=block_hasher)
requests['r1'].num_computed_tokens = 0
requests['r1'].shared_prefix_boundary = 0
computed1 = manager.get_computed_blocks(requests['r1'])

# The last call above raises on vLLM 0.33.0: kvprop's target-crash find.
print("OK: no exception; the crash is fixed")
