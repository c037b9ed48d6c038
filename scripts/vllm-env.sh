#!/usr/bin/env bash
# scripts/vllm-env.sh VERSION [DIR]
#
# Build a CPU-only virtual environment at DIR (default: .venv-vllm-VERSION in the repo)
# in which kvprop can drive vLLM's own v1 KVCacheManager (`--target vllm`).
#
# - torch is the CPU build 2.13.0+cpu from /opt/wheels (pip's configured find-links);
#   the "+cpu" local label means pip can never pick a same-numbered CUDA build.
# - vLLM and its import closure go in with --no-deps at exact pins: resolving vLLM's own
#   dependencies would pull a CUDA torch and triton (gigabytes). The final check fails if
#   any nvidia-*/triton distribution is present.
# - kvprop itself is installed editable (--no-deps) from this repository, with attrs,
#   hypothesis and pytest.
# - Idempotent: exits early when DIR/.ok names VERSION and kvprop imports from this
#   repository (delete DIR to rebuild).
set -euo pipefail

if [ $# -lt 1 ] || [ $# -gt 2 ]; then
  echo "usage: $0 VERSION [DIR]   (e.g. 0.23.0, the last release with the cross-group bug, or 0.24.0)" >&2
  exit 2
fi
VERSION=$1
REPO=$(cd "$(dirname "$0")/.." && pwd)
DIR=${2:-$REPO/.venv-vllm-$VERSION}
PY="$DIR/bin/python"

kvprop_ok() {
  [ -x "$PY" ] && [ "$("$PY" -c 'import kvprop, os; print(os.path.dirname(os.path.dirname(os.path.abspath(kvprop.__file__))))' 2>/dev/null)" = "$REPO" ]
}

if [ -e "$DIR/.ok" ] && [ "$(cat "$DIR/.ok")" = "$VERSION" ] && kvprop_ok; then
  echo "vllm-env: $DIR already set up for vllm $VERSION; skipping (delete it to rebuild)"
  exit 0
fi

start=$(date +%s)
_last=$start
rm -rf "$DIR"
python3 -m venv "$DIR"

# pip install, quiet; drops pip's noise about this machine's absent file:// index
# folders ("... is ignored: it is neither a file nor a directory") but keeps pip's
# exit status.
pipq() {
  local rc=0
  "$PY" -m pip install --disable-pip-version-check -q "$@" 2>&1 \
    | { grep -v 'is ignored: it is neither a file nor a directory' || true; } || rc=$?
  return $rc
}
step() {  # step LABEL: print seconds since the previous step
  local now
  now=$(date +%s)
  echo "vllm-env: $1: $((now - _last)) s"
  _last=$now
}

# 1. CPU torch.
pipq "torch==2.13.0+cpu"
step "torch 2.13.0+cpu (+ its small deps)"

# 2. vLLM itself, without its dependency tree.
pipq --no-deps "vllm==$VERSION"
step "vllm==$VERSION (--no-deps)"

# 3. The import closure of vllm.v1.core.kv_cache_manager, found by importing until
#    nothing was missing on 0.23.0 and 0.24.0 (see /work/shared/vllm-on-cpu.md).
DEPS=(
  numpy==2.4.6 packaging==26.4 psutil==7.2.2 pyzmq==27.3.0 urllib3==2.8.0
  regex==2026.11.19 msgspec==0.23.0 pydantic==2.14.4 pydantic_core==2.50.5
  typing-inspection==0.4.5 annotated-types==0.8.0 cbor2==6.3.0 transformers==5.24.0
  huggingface_hub==2.4.0 tokenizers==0.23.3 safetensors==0.8.0 tqdm==4.70.1
  httpx2==2.16.2 httpcore2==2.16.2 h11==0.16.0 idna==3.20 truststore==0.10.5
  PyYAML==6.0.4 aiohttp==3.14.5 multidict==7.2.1 attrs==26.1.0 yarl==1.25.1
  propcache==0.5.4 aiohappyeyeballs==2.7.1 aiosignal==1.4.0 frozenlist==1.8.0
  requests==2.34.2 certifi==2026.10.19.post1 openai-harmony==0.0.8 openai==3.57.0
  sniffio==1.3.1 anyio==4.16.0 pillow==13.0.0 pybase64==1.5.1 cachetools==8.0.2
  cloudpickle==3.1.3 uvloop==0.23.0 py-cpuinfo==9.0.0 prometheus_client==0.26.0
  llguidance==1.7.6 xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2
)
if [ "$VERSION" = "0.23.0" ]; then
  DEPS+=(gguf==0.19.0)  # 0.23.0 imports it on this path; 0.24.0 does not
fi
pipq --no-deps "${DEPS[@]}"
step "import closure (--no-deps, ${#DEPS[@]} pins)"

# 4. kvprop from this repository (editable, so the checkout is what runs) and its test
#    tooling. --no-deps: its torch/numpy requirements are already met by the pins above.
pipq hypothesis pytest attrs==26.1.0
pipq --no-deps -e "$REPO"
step "kvprop (editable, --no-deps) + hypothesis, pytest, attrs"

# 5. Guard: CPU torch only, no CUDA wheels, the manager imports, kvprop's target loads.
VLLM_LOGGING_LEVEL=ERROR PYTHONWARNINGS=ignore "$PY" - "$VERSION" <<'PYEOF'
import importlib.metadata as md
import sys

import torch

bad = sorted(
    d.metadata["Name"]
    for d in md.distributions()
    if d.metadata["Name"].lower().startswith(("nvidia-", "triton"))
)
assert not bad, f"CUDA packages crept in: {bad}"
assert torch.__version__.endswith("+cpu"), torch.__version__
assert torch.version.cuda is None, torch.version.cuda
import vllm  # noqa: E402

assert vllm.__version__ == sys.argv[1], (vllm.__version__, sys.argv[1])
from kvprop.allocator.specs import AllocatorConfig, FullAttention, SlidingWindow  # noqa: E402
from kvprop.targets.vllm import make_target  # noqa: E402

allocator, view = make_target(AllocatorConfig((FullAttention(4), SlidingWindow(4, 16)), 13))
assert view.num_free_blocks == 12, view.num_free_blocks
print(f"vllm-env: torch {torch.__version__}, vllm {vllm.__version__}: kvprop's vllm target builds an allocator")
PYEOF
step "import check"
kvprop_ok || { echo "vllm-env: kvprop does not import from $REPO in $DIR" >&2; exit 1; }

echo "$VERSION" > "$DIR/.ok"
echo "vllm-env: $DIR ready in $(($(date +%s) - start)) s"
