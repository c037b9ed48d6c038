"""A reproducer for vLLM's KVCacheManager (vLLM 0.30.0), written by kvprop report.

Broken: a hit's block announced again names a key the replayed events hold.
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
        max_model_len=10,
        scheduler_block_size=2,
        hash_block_size=2,
        enable_caching=True,
        enable_kv_cache_events=True,
        log_stats=True,
        use_eagle=False,
        kv_cache_config=vllm.v1.kv_cache_interface.KVCacheConfig(num_blocks=5, kv_cache_tensors=[], kv_cache_groups=[vllm.v1.kv_cache_interface.KVCacheGroupSpec(layer_names=['layer0'], kv_cache_spec=vllm.v1.kv_cache_interface.SlidingWindowSpec(block_size=2, num_kv_heads=1, head_size=1, dtype=torch.float32, head_size_v=1, sliding_window=2))], prefix_cache_retention_interval=0),
    )
except TypeError as e:  # another release's signature: no answer either way
    print(f"vLLM {vllm.__version__} does not take the manager written for vLLM 0.30.0: {e}")
    sys.exit(2)
except (AssertionError, ValueError, NotImplementedError) as e:  # its own start-up checks: not a find
    print(f"vLLM {vllm.__version__} refuses this configuration at start-up: {type(e).__name__}: {e}")
    sys.exit(2)
# the manager's calls below and their keywords; a release without them is another API: exit 2
API = {'take_events': [], 'new_step_starts': [], 'get_computed_blocks': [], 'allocate_slots': ['num_new_computed_tokens', 'new_computed_blocks', 'num_lookahead_tokens', 'num_external_computed_tokens', 'delay_cache_blocks'], 'take_kv_cache_block_copies': [], 'free': []}
for method, keywords in API.items():
    takes = inspect.signature(getattr(manager, method)).parameters if hasattr(manager, method) else None
    if takes is None or not set(keywords) <= set(takes):
        print(f"vLLM {vllm.__version__} does not take manager.{method}() with {keywords} "
              "as vLLM 0.30.0 does")
        sys.exit(2)
requests = {}  # request id -> vLLM Request
freed = set()  # the requests freed
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
ledger = collections.Counter()  # (block hash, group) -> blocks the events say hold it
lookups = set()  # ids of the events a prefix-cache lookup queued: a hit's blocks announced again


def watch_events(manager):
    lookup, take = manager.get_computed_blocks, manager.take_events

    def get_computed_blocks(*args, **kwargs):
        queue = manager.block_pool.kv_event_queue
        before = len(queue)
        result = lookup(*args, **kwargs)
        lookups.update(id(event) for event in queue[before:])
        return result

    def take_events():
        events = take()
        replay(events)
        return events

    manager.get_computed_blocks, manager.take_events = get_computed_blocks, take_events


def replay(events):
    for event in events:
        if isinstance(event, AllBlocksCleared):
            ledger.clear()
            continue
        for block_hash in event.block_hashes:
            key = (block_hash, getattr(event, "group_idx", None))
            if isinstance(event, BlockRemoved):
                assert ledger[key] > 0, f"a BlockRemoved for {key}, which no event before stored"
                ledger[key] -= 1
            elif id(event) in lookups:
                assert ledger[key] > 0, (
                    f"a hit's block announced again (BlockStored) under {key}, which the events so far do not "
                    "hold: a router learns a prefix this group does not have, and no BlockRemoved will retract it"
                )
            else:
                ledger[key] += 1


watch_events(manager)

# ---- from kvprop operation 0 (AddRequest)
manager.take_events()

# ---- from kvprop operation 1 (AddLargeRequest)
manager.take_events()

# ---- from kvprop operation 2 (Step)
# engine step 1
manager.new_step_starts()
requests['r0'] = Request(request_id='r0', prompt_token_ids=[0], sampling_params=SamplingParams(max_tokens=1, extra_args={'kv_cache_report_mode': 'full'}), pooling_params=None, block_hasher=block_hasher)
requests['r0'].num_computed_tokens = 0
requests['r0'].shared_prefix_boundary = 0
computed0 = manager.get_computed_blocks(requests['r0'])
manager.allocate_slots(requests['r0'], 1, num_new_computed_tokens=0, new_computed_blocks=computed0[0], num_lookahead_tokens=0, num_external_computed_tokens=0, delay_cache_blocks=False)  # granted when recorded
requests['r1'] = Request(request_id='r1', prompt_token_ids=[0, 0, 0, 1, 2], sampling_params=SamplingParams(max_tokens=1, extra_args={'kv_cache_report_mode': 'full'}), pooling_params=None, block_hasher=block_hasher)
requests['r1'].num_computed_tokens = 0
requests['r1'].shared_prefix_boundary = 0
computed1 = manager.get_computed_blocks(requests['r1'])
manager.allocate_slots(requests['r1'], 1, num_new_computed_tokens=0, new_computed_blocks=computed1[0], num_lookahead_tokens=0, num_external_computed_tokens=0, delay_cache_blocks=False)  # granted when recorded
copies, retained = manager.take_kv_cache_block_copies()
if retained:
    manager.block_pool.free_blocks(retained)
requests['r0'].num_computed_tokens = 1
manager.free(requests['r0'])
freed.add('r0')
manager.take_events()

# ---- from kvprop operation 3 (AddLargeRequest)
manager.take_events()

# ---- from kvprop's drain (engine steps until every request has finished)
# engine step 2
manager.new_step_starts()
requests['r1'].num_computed_tokens = 1
manager.allocate_slots(requests['r1'], 2, num_lookahead_tokens=0)  # granted when recorded
copies, retained = manager.take_kv_cache_block_copies()
if retained:
    manager.block_pool.free_blocks(retained)
manager.take_events()
# engine step 3
manager.new_step_starts()
requests['r1'].num_computed_tokens = 3
manager.allocate_slots(requests['r1'], 2, num_lookahead_tokens=0)  # granted when recorded
copies, retained = manager.take_kv_cache_block_copies()
if retained:
    manager.block_pool.free_blocks(retained)
requests['r1'].num_computed_tokens = 5
manager.free(requests['r1'])
freed.add('r1')
manager.take_events()
# engine step 4
manager.new_step_starts()
requests['r2'] = Request(request_id='r2', prompt_token_ids=[0, 0, 0, 1, 2], sampling_params=SamplingParams(max_tokens=1, extra_args={'kv_cache_report_mode': 'full'}), pooling_params=None, block_hasher=block_hasher)
requests['r2'].num_computed_tokens = 0
requests['r2'].shared_prefix_boundary = 0
computed2 = manager.get_computed_blocks(requests['r2'])
manager.allocate_slots(requests['r2'], 1, num_new_computed_tokens=4, new_computed_blocks=computed2[0], num_lookahead_tokens=0, num_external_computed_tokens=0, delay_cache_blocks=False)  # granted when recorded
copies, retained = manager.take_kv_cache_block_copies()
if retained:
    manager.block_pool.free_blocks(retained)
requests['r2'].num_computed_tokens = 5
manager.free(requests['r2'])
freed.add('r2')
manager.take_events()

# The property kvprop found broken (events-reannounce-unheld): a hit's block announced again names a key the replayed events hold.
manager.take_events()  # the events it holds for its next publication
print("OK: events-reannounce-unheld holds; the bug is fixed")
