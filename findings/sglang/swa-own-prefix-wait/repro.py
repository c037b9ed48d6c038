"""SGLang: an idle server never admits a request whose SWA reservation fits the SWA pool, but not
the pool less the request's own cached prefix, which admission pins while it checks.

A full + SWA hybrid model (window 6, page 3, chunked prefill 3, --max-total-tokens 15, the
default --swa-full-tokens-ratio: an SWA pool of 12 tokens, which start-up validation accepts).
r0 (3 tokens) finishes and its KV is cached. r1 extends r0's prompt by 4 tokens and arrives at an
idle server. PrefillAdder.add_one_req pins r1's matched prefix (_lock_node) and finds the SWA
reservation (9) not below what remains (12 less the 3 pinned); swa_never_fits compares with the
whole pool (12), calls the shortfall transient, and r1 waits. Nothing runs, so nothing is ever
evicted: every scheduling round repeats the same decision.

Run with SGLang installed (CPU is enough): python repro.py
Exit 1: the request is refused on every scheduling round of an idle server (the hang);
exit 0: it is admitted; exit 2: this SGLang has not the API the script calls (0.5.22 on).
"""

import json
import os
import sys
import tempfile
import warnings
from array import array
from importlib.metadata import version

warnings.simplefilter("ignore")
if tuple(int(p) for p in version("sglang").split(".")[:3]) < (0, 5, 22):
    print(f"SGLang {version('sglang')}: the script calls checkpoint-era APIs (0.5.22 on)")
    sys.exit(2)

import torch  # noqa: E402
from sglang.srt.configs.model_config import ModelConfig  # noqa: E402
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch  # noqa: E402
from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder  # noqa: E402
from sglang.srt.mem_cache import common  # noqa: E402
from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool  # noqa: E402
from sglang.srt.mem_cache.registry import TreeCacheBuildContext, create_tree_cache  # noqa: E402
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool  # noqa: E402
from sglang.srt.runtime_context import get_context  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # noqa: E402

PAGE, WINDOW, CHUNK = 3, 6, 3
FULL_TOKENS = 15  # --max-total-tokens 15
SWA_TOKENS = int(FULL_TOKENS * 0.8) // PAGE * PAGE  # the default --swa-full-tokens-ratio: 12
assert WINDOW + PAGE < SWA_TOKENS  # what validate_swa_pool_size requires at start-up

model_dir = tempfile.mkdtemp()
with open(os.path.join(model_dir, "config.json"), "w") as f:
    json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 1000,
               "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 2,
               "num_key_value_heads": 1, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
               "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2}, f)
model_config = ModelConfig(model_dir, dtype="float32")
server_args = get_context().override_server_args(page_size=PAGE, chunked_prefill_size=CHUNK, device="cpu").install()

# What the scheduler builds for a full + SWA hybrid model (kv_cache_configurator, kv_cache_builder)
req_to_token_pool = ReqToTokenPool(8, 256, "cpu", False)
kvcache = SWAKVPool(size=FULL_TOKENS, size_swa=SWA_TOKENS, page_size=PAGE, dtype=torch.float32, head_num=1,
                    head_dim=4, swa_attention_layer_ids=[0], full_attention_layer_ids=[1], device="cpu",
                    enable_alt_stream=False)
allocator = SWATokenToKVPoolAllocator(FULL_TOKENS, SWA_TOKENS, page_size=PAGE, dtype=torch.float32, device="cpu",
                                      kvcache=kvcache, need_sort=False, req_to_token_pool=req_to_token_pool)
params = CacheInitParams(disable=False, req_to_token_pool=req_to_token_pool, token_to_kv_pool_allocator=allocator,
                         page_size=PAGE, chunked_prefill_size=CHUNK, sliding_window_size=WINDOW)
tree = create_tree_cache(TreeCacheBuildContext(
    server_args=server_args, params=params, is_hybrid_swa=True, is_hybrid_ssm=False,
    enable_hierarchical_cache=False, disable_radix_cache=False, tp_worker=None, model_config=model_config,
    tp_size=1, tp_rank=0, tp_group=None, full_tokens_per_layer=FULL_TOKENS))
spec = SpeculativeAlgorithm.from_string(None)


def request(rid, tokens, max_new_tokens):
    sp = SamplingParams(max_new_tokens=max_new_tokens)
    sp.normalize(None)
    sp.verify(1000)
    return Req(rid, "", array("q", tokens), sp, vocab_size=1000, eos_token_ids={2})


def admit(req, running):
    """Scheduler._get_new_batch_prefill_raw's admission of one waiting request."""
    adder = PrefillAdder(PAGE, tree, allocator, running, 0.7, 16384, CHUNK, 0)
    req.init_next_round_input(tree)
    return adder, adder.add_one_req(req, has_chunked_req=False, truncation_align_size=None)


running = ScheduleBatch(reqs=[], batch_is_full=False)
# r0: a 3-token prompt, one token generated; it finishes and its KV is cached
r0 = request("r0", [3, 6, 4], 1)
adder, res = admit(r0, running)
assert adder.can_run_list == [r0], res
batch = ScheduleBatch.init_new(adder.can_run_list, req_to_token_pool, allocator, tree, model_config, False, spec)
batch.prepare_for_extend()
r0.output_ids.append(7)
r0.update_finish_state()
assert r0.finished()
allocator.free_group_begin()
common.release_kv_cache(r0, tree, checkpoint=True)
allocator.free_group_end()

# r1: r0's prompt and 4 more tokens. The server is idle: nothing runs, nothing waits but r1.
r1 = request("r1", [3, 6, 4, 5, 4, 4, 3], 1)
print(f"idle: full available {allocator.full_available_size()} + evictable {tree.full_evictable_size()} "
      f"of {FULL_TOKENS}; SWA available {allocator.swa_available_size()} + evictable {tree.swa_evictable_size()} "
      f"of {SWA_TOKENS}")
for round_ in range(5):  # every scheduling round of the idle server makes the same decision
    adder, res = admit(r1, running)
    print(f"round {round_}: r1 matched {r1.prefix_len} cached tokens; admission -> {res.name}")
    if adder.can_run_list:
        sys.exit(0)
sys.exit("r1 is never admitted: with nothing running nothing is ever evicted, so the server waits forever")
