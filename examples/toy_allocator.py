"""A user's own KV-cache allocator for kvprop to test (docs/targets.md), written from the contract alone: one
full-attention group, block 0 null, reference counts, a prefix cache of whole blocks, an LRU free queue. ``TARGET``
declares the shapes it builds (kvprop draws only those); ``BROKEN_TARGET`` plants a bug."""

from collections import OrderedDict
from itertools import islice

from kvprop.allocator.specs import AllocatorConfig, FullAttention
from kvprop.errors import ConfigError
from kvprop.targets.protocol import Capabilities, Shapes, Target


class Block:
    __slots__ = ("block_id", "ref_cnt", "key")  # the engine reads block_id off the hits

    def __init__(self, block_id: int):
        self.block_id, self.ref_cnt, self.key = block_id, 0, None  # key: the block hash while cached


class ToyAllocator:
    """The calls a scheduler makes. The free queue's head is evicted first: a freed cached block joins the tail, one
    without a hash the head (nothing can hit it). A request's last block is freed first: a prefix outlives its tails."""

    def __init__(self, config: AllocatorConfig):
        self.block_size, self.caching = config.block_size, config.enable_caching
        self.blocks = [Block(i) for i in range(config.num_blocks)]
        self.free_queue = OrderedDict((b.block_id, b) for b in self.blocks[1:])
        self.cache: dict[int, dict[int, Block]] = {}  # hash -> blocks holding that prefix, oldest first
        self.tables: dict[str, list[Block]] = {}  # request id -> its blocks: admitted iff present
        self.num_cached: dict[str, int] = {}  # request id -> leading blocks already cached
        self.num_evictions = 0

    def get_computed_blocks(self, request):  # the longest cached run from the start, short of the last token
        hits = []
        if self.caching:
            for block_hash in request.block_hashes[: (request.num_tokens - 1) // self.block_size]:
                if not (holders := self.cache.get(block_hash)):
                    break
                hits.append(next(iter(holders.values())))
        return (hits,), len(hits) * self.block_size

    def allocate_slots(self, request, num_new_tokens, new_computed_blocks=None, **counts):
        """Slots for hits and the ``counts`` the engine names; None if the pool is short, changing nothing."""
        hits = list(new_computed_blocks[0]) if new_computed_blocks is not None else []
        extra = counts.get("num_new_computed_tokens", 0) + counts.get("num_external_computed_tokens", 0)
        computed = request.num_computed_tokens + extra
        wanted = -(-(computed + num_new_tokens + counts.get("num_lookahead_tokens", 0)) // self.block_size)  # ceil
        table = self.tables.get(request.request_id)
        held = table if table is not None else [block for block in hits if block.ref_cnt > 0]  # take no free block
        if wanted - len(held) > len(self.free_queue):
            return None
        if table is None:  # admission: the hits head its table, counted as cached already
            for block in hits:
                self._take(block)
            table = self.tables[request.request_id] = hits
            self.num_cached[request.request_id] = len(hits)
        new = [self._pop_free() for _ in range(wanted - len(table))]
        table.extend(new)
        if not counts.get("delay_cache_blocks"):  # delayed for a connector's load: cached once it has landed
            self.cache_blocks(request, min(computed + num_new_tokens, request.num_tokens))
        return new

    def _take(self, block: Block) -> None:  # a free hit leaves the queue, so nobody else can get it
        if block.ref_cnt == 0:
            del self.free_queue[block.block_id]
        block.ref_cnt += 1

    def _pop_free(self) -> Block:  # the head of the free queue, evicted from the prefix cache if it held a prefix
        _, block = self.free_queue.popitem(last=False)
        if block.key is not None:
            del self.cache[block.key][block.block_id]
            if not self.cache[block.key]:
                del self.cache[block.key]
            block.key = None
            self.num_evictions += 1
        block.ref_cnt = 1
        return block

    def cache_blocks(self, request, num_computed_tokens: int) -> None:  # those it fills, past those cached already
        if not self.caching:
            return
        start, full = self.num_cached[request.request_id], num_computed_tokens // self.block_size
        for i, block in enumerate(self.tables[request.request_id][start:full], start):
            block.key = key = request.block_hashes[i]
            self.cache.setdefault(key, {})[block.block_id] = block
        self.num_cached[request.request_id] = max(start, full)

    def free(self, request) -> None:
        self.free_popped_blocks(self.pop_blocks_for_free(request))

    def pop_blocks_for_free(self, request) -> list[int]:  # taken from the request, still referenced
        del self.num_cached[request.request_id]
        return [block.block_id for block in self.tables.pop(request.request_id)]

    def free_popped_blocks(self, block_ids: list[int]) -> None:  # later (deferred_frees), or at once by free
        table = [self.blocks[block_id] for block_id in block_ids]
        for block in reversed(table):
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = block
        for block in table:  # hashless ones to the head, so that the request's last block is first
            if block.ref_cnt == 0 and block.key is None:
                self.free_queue.move_to_end(block.block_id, last=False)

    def reset_prefix_cache(self) -> bool:  # refused while any request holds a block
        if len(self.free_queue) != len(self.blocks) - 1:
            return False
        for block in self.blocks:
            block.key = None
        self.cache.clear()
        return True

    def get_block_ids(self, request_id: str):
        return ([block.block_id for block in self.tables.get(request_id, ())],)


class ToyView:
    """What kvprop's invariants read, read-only; a key in kvprop's terms: (block hash, group 0)."""

    num_groups, null_block_id = 1, 0

    def __init__(self, allocator: ToyAllocator):
        self.a = allocator
        self.num_blocks, self.block_size = len(allocator.blocks), allocator.block_size

    num_free_blocks = property(lambda self: len(self.a.free_queue))
    num_evictions = property(lambda self: self.a.num_evictions)

    def ref_cnt(self, block_id: int) -> int:
        return self.a.blocks[block_id].ref_cnt

    def ref_cnts(self) -> list[int]:
        return [block.ref_cnt for block in self.a.blocks]

    def cache_key(self, block_id: int):
        key = self.a.blocks[block_id].key
        return None if key is None else (key, 0)

    def cache_keys(self) -> list:
        return [self.cache_key(block.block_id) for block in self.a.blocks]

    def cache_map_items(self):
        return [((key, 0), block_id) for key, holders in self.a.cache.items() for block_id in holders]

    def free_queue_ids(self) -> list[int]:  # the head, evicted next, first
        return list(self.a.free_queue)

    def free_queue_ids_backward(self) -> list[int]:
        return list(reversed(self.a.free_queue))

    def free_queue_prefix(self, n: int) -> list[int]:
        return list(islice(self.a.free_queue, n))

    def request_ids(self, group: int):
        return list(self.a.tables)

    def request_block_ids(self, group: int, request_id: str):
        table = self.a.tables.get(request_id)
        return None if table is None else [block.block_id for block in table]

    def num_cached_blocks(self, group: int, request_id: str):
        return self.a.num_cached.get(request_id)


def make_target(config: AllocatorConfig, allocator_class=ToyAllocator):
    """Refuses each field of ``config`` it does not serve, by name (lookahead, drafts and a connector
    reach allocate_slots as token counts, served)."""
    kind = type(config.groups[0]).__name__
    for refused, why in (
        (len(config.groups) != 1, f"one KV cache group only, got {len(config.groups)}"),
        (not isinstance(config.groups[0], FullAttention), f"FullAttention only, got {kind}"),
        (config.enable_kv_cache_events, "no KV cache events (enable_kv_cache_events=True)"),
        (config.eagle, "no EAGLE drop (eagle=True)"),
        (config.unit != config.block_size, f"hits on whole blocks only, got hash_unit={config.hash_unit}"),
        (config.retention_interval not in (None, 0), f"no retention, got {config.retention_interval}"),
    ):
        if refused:
            raise ConfigError(f"toy allocator: {why}")
    allocator = allocator_class(config)
    return allocator, ToyView(allocator)


class BrokenToyAllocator(ToyAllocator):
    """The planted bug: a hit on a free cached block takes a reference but leaves the block in
    the free queue, so the next allocation can hand it to another request while this one reads it."""

    def _take(self, block: Block) -> None:
        block.ref_cnt += 1


def make_broken_target(config: AllocatorConfig):
    return make_target(config, BrokenToyAllocator)


ONE_FULL_GROUP = Shapes(
    frozenset({"full"}), 1, kv_events=False, full_report=False, eagle=False, hits_inside_blocks=False, retention=False
)
DECLARED = Capabilities(evictions=True, deferred_frees=True)
TARGET = Target("toy", make_target, "a toy allocator", DECLARED, ONE_FULL_GROUP)
BROKEN_TARGET = Target("toy-broken", make_broken_target, "the toy, broken", DECLARED, ONE_FULL_GROUP)
