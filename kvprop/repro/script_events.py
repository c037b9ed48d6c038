"""The KV cache events check of a reproducer, as source text for the script (both vLLM targets).

It replays vLLM's events as a router would (``kvprop.check.events``): the keys stored and not
removed since the last clear, counted per block. vLLM's event does not tell a hit announced
again (the full report, ``emit_cached_block_events``) from a store, so the script notes the
events a lookup queues as it queues them (``watch_events`` wraps the manager's lookup and
its ``take_events``, calling through).
"""

EVENT_KINDS = ("events-reannounce-unheld", "events-unknown-removal")
EVENTS = """
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
"""
