"""The doors into kvprop, above every layer: the command line (``cli`` parses, ``commands``
and the modules beside it run each command; ``bisect`` replays a find across vLLM releases),
the benchmarks, coverage of a target, the facts of docs/design.md and the pytest plugin.

May import every layer; nothing below imports it.
"""
