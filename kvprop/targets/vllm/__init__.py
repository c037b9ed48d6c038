"""vLLM's own allocator as kvprop's targets: its v1 ``KVCacheManager`` and its ``Scheduler``, one concern a module.

kvprop's engine drives vLLM's allocator exactly as it drives its own (``--target vllm``), or lets
vLLM's scheduler run every step (``--target vllm-scheduler``); either way the invariants read
vLLM's block pool, coordinator and per-group managers in kvprop's terms. vLLM stays untouched:
nothing is patched, only read.

Two translations make the shared invariants apply unchanged:

- cache keys: vLLM keys a cached block by its own 32-byte chained hash plus the group id;
  the view reports (kvprop's hash of the same block, group id), from the pairs recorded
  whenever a request's block hashes grow (same tokens, same block size, same index);
- calls: only keyword arguments the installed vLLM's signatures accept are passed
  (checked with ``inspect.signature``), so the same code drives every release that keeps
  these calls; one it cannot drive is a ``ConfigError`` that says why.

The modules:

- ``loading``: vLLM's API, imported once and quietly (a missing vLLM says how to get one);
- ``releases``: what each release accepts, and how ``kvprop agree`` walks it;
- ``config``: vLLM's configurations and KV cache specs from kvprop's, and the manager and
  scheduler built from them;
- ``shapes``: the shapes each target builds for the release installed (what the sampler draws);
- ``manager``: the ``KVCacheManager`` as kvprop's allocator, and the ``vllm`` target's factory;
- ``view``: vLLM's allocator state in kvprop's terms;
- ``scheduler``: the ``Scheduler`` in charge of every step (the ``vllm-scheduler`` target);
- ``offload``: the worker side of vLLM's offloading connector, for the scheduler target.

The registry (``kvprop.targets.protocol``) names each target's factory and shapes by module,
so that nothing here is imported until a target is built. Needs vLLM importable (CPU is
enough: the allocator is pure Python). Build an environment with
``make vllm-env VLLM_VERSION=0.24.0`` (``scripts/vllm-env.sh``).
"""
