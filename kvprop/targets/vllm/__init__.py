"""vLLM's own ``KVCacheManager`` (``manager``) and ``Scheduler`` (``scheduler``) as kvprop's targets.

The registry (``kvprop.targets.protocol``) names each target's factory and shapes by module, so
that nothing here is imported until a target is built.
"""
