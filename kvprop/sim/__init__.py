"""The simulated server around an allocator.

Requests (tokens, block hashes, fingerprint prefixes), the engine (scheduler with chunked
prefill, decode, preemption, aborts, external loads), the connector to an external KV
tier, and paged device memory as a torch tensor. It drives any allocator through the
manager-facade calls and offers hooks where blocks change hands; it judges nothing. It may
import ``kvprop.allocator`` and ``kvprop.errors``.
"""
