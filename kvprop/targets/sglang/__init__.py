"""SGLang's own KV-cache code driven through whole request lives on a CPU.

``SglangScheduler`` builds the pools, allocator and radix tree SGLang's scheduler builds (its own
``create_tree_cache`` factory picks the tree) and runs the scheduler's request bookkeeping over
them: every KV decision (admission, chunking, allocation, eviction, caching, release,
retraction) is a call into SGLang; only the orchestration between those calls is kvprop's.
``kvprop.check.sglang`` checks the result in SGLang's own terms after every step. SGLang is imported only
when a scheduler is first built (``loading``), so kvprop imports without it.
"""
