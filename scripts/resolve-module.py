"""Print the requirement to install for top-level module argv[1], or exit 2 with why not.

The import-closure loops of scripts/vllm-env.sh and scripts/sglang-env.sh call it with the
environment's own python: it names the distribution that provides a missing module and the
versions that the installed distributions' requirements on it allow, and refuses anything a
CPU-only environment must never get this way (a CUDA torch or triton would come with it, or it
is a compiled part of an engine itself)."""
import importlib.metadata as md
import re
import sys

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

# Import name -> PyPI distribution, only where they differ (pip normalises - and _).
ALIAS = {
    "yaml": "pyyaml", "cv2": "opencv-python-headless", "PIL": "pillow",
    "google": "protobuf", "zmq": "pyzmq", "cpuinfo": "py-cpuinfo", "attr": "attrs",
    "tvm_ffi": "apache-tvm-ffi", "sklearn": "scikit-learn", "dateutil": "python-dateutil",
    "multipart": "python-multipart", "dotenv": "python-dotenv", "jwt": "pyjwt",
    "pkg_resources": "setuptools", "pythonjsonlogger": "python-json-logger",
    "bs4": "beautifulsoup4", "setproctitle": "setproctitle", "IPython": "ipython",
    "sentencepiece": "sentencepiece", "partial_json_parser": "partial-json-parser",
    "huggingface_hub": "huggingface-hub", "typing_extensions": "typing-extensions",
    "msgpack": "msgpack", "pynvml": "nvidia-ml-py", "orjson": "orjson",
    "lmformatenforcer": "lm-format-enforcer",
}
# Never from this loop: a CUDA torch or triton would come with them, and an engine's own
# compiled parts are not a missing dependency.
FORBIDDEN = re.compile(r"^(torch|torchvision|torchaudio|torchcodec|triton|triton-kernels|"
                       r"pytorch-triton.*|nvidia-.*|cuda-.*|vllm.*|sglang.*|sgl-.*|flashinfer.*|"
                       r"flash-attn.*|xformers|cupy.*|tilelang|deep-gemm|humming-kernels|"
                       r"quack-kernels|nvshmem.*|torch-memory-saver)$")

def norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()

module = sys.argv[1]
top = module.split(".")[0]
dist = norm(ALIAS.get(top, top))
if FORBIDDEN.match(dist) or top in ("torch", "triton", "vllm", "sglang", "sgl_kernel"):
    print(f"module {module!r} would need {dist!r}, which this CPU-only recipe never installs "
          "(a CUDA torch/triton, or a compiled part of the engine itself)")
    sys.exit(2)
# Every requirement on it that an installed distribution declares and applies here;
# extras-only ones count only when nothing else names it.
applies, extras_only = SpecifierSet(), SpecifierSet()
for d in md.distributions():
    for line in d.requires or ():
        try:
            r = Requirement(line)
        except Exception:  # noqa: BLE001
            continue
        if norm(r.name) != dist:
            continue
        if r.marker is None or r.marker.evaluate():
            applies &= r.specifier
        else:
            extras_only &= r.specifier
spec = applies if str(applies) or not str(extras_only) else extras_only
print(f"{dist}{spec}")
