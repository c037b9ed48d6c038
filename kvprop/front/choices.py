"""The command line's choices, apart from the commands that use them, so that parsing imports nothing heavy.

``kvprop --help``, ``--version``, ``kvprop COMMAND --help`` and every argument error parse
the whole command line; the modules that run the commands import the engine and torch,
which would make each of those take seconds. Their old homes re-export these names.
"""

from __future__ import annotations

from kvprop.targets.protocol import REGISTRY

# ``kvprop report``: the targets whose finds it writes as reproducers needing only vLLM
REPORTED = ("vllm", "vllm-scheduler")

# ``kvprop bisect``: the engines whose releases have environments: package -> (its name, the
# make target that builds one), and the targets that drive an engine's own code
ENGINES = {"vllm": ("vLLM", "vllm-env VLLM_VERSION"), "sglang": ("SGLang", "sglang-env SGLANG_VERSION")}
ENGINE_TARGETS = tuple(name for name, t in REGISTRY.items() if t.package in ENGINES)

# ``kvprop bench``: its parts; vllm and sglang need their engine's environment, ray the ray
# extra (kvprop.front.ray_bench)
PARTS = ("startup", "throughput", "supervision", "scaling", "time_to_find", "vllm", "sglang", "ray", "targets")
DEFAULT_PARTS = tuple(part for part in PARTS if part not in ("vllm", "sglang", "ray"))
