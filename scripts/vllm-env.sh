#!/usr/bin/env bash
# scripts/vllm-env.sh VERSION [DIR]
#
# Build a CPU-only virtual environment at DIR (default: .venv-vllm-VERSION in the repo)
# in which kvprop can drive vLLM's own v1 KVCacheManager (`--target vllm`).
#
# - torch is the CPU build 2.13.0+cpu (pip's configured index serves it);
#   the "+cpu" local label means pip can never pick a same-numbered CUDA build.
# - vLLM and its import closure go in with --no-deps: resolving vLLM's own dependencies
#   would pull a CUDA torch and triton (gigabytes). Base pins (known to work together)
#   first; then a loop runs kvprop's vllm target, reads `No module named 'X'`, installs
#   X's distribution --no-deps (never torch/triton/CUDA wheels) and retries, so any
#   release gets what it imports without a per-release table. The final check fails if
#   any nvidia-*/triton distribution is present.
# - kvprop itself is installed editable (--no-deps) from this repository, with attrs,
#   hypothesis, pytest and coverage (for `kvprop coverage`).
# - Idempotent: exits early when DIR/.ok names VERSION and kvprop imports from this
#   repository (delete DIR to rebuild).
set -euo pipefail

if [ $# -lt 1 ] || [ $# -gt 2 ]; then
  echo "usage: $0 VERSION [DIR]   (any release from 0.22 on; e.g. 0.23.0, the last release with the cross-group bug, or 0.24.0)" >&2
  exit 2
fi
VERSION=$1
REPO=$(cd "$(dirname "$0")/.." && pwd)
DIR=${2:-$REPO/.venv-vllm-$VERSION}
case $DIR in /*) ;; *) DIR="$PWD/$DIR" ;; esac  # the steps below run in other directories
PY="$DIR/bin/python"

# kvprop is installed from this checkout, and its command and its pytest plugin load (an entry
# point moved since the install leaves ones that do not)
kvprop_ok() {
  # (run from / so that a checkout in the working directory does not stand in for the install)
  [ -x "$PY" ] && [ "$(cd / && "$PY" -c 'import kvprop, os; print(os.path.dirname(os.path.dirname(os.path.abspath(kvprop.__file__))))' 2>/dev/null)" = "$REPO" ] \
    && "$DIR/bin/kvprop" --version >/dev/null 2>&1 \
    && (cd / && "$PY" -c "from importlib.metadata import entry_points as e; [p.load() for p in e(group='pytest11') if p.name == 'kvprop']") >/dev/null 2>&1
}

# The stamp names what the environment was checked for: the manager target ("VERSION") and,
# since the scheduler target, vLLM's Scheduler too ("VERSION scheduler"). An environment
# stamped for the manager alone keeps its packages and reruns the closure loop (step 5).
STAMP="$VERSION scheduler"
REUSE=
# An environment built for this release from another checkout (a cache shared by clones):
# only kvprop is installed again, from this one.
if [ -e "$DIR/.ok" ] && [ "$(cat "$DIR/.ok")" = "$STAMP" ] && ! kvprop_ok; then
  "$PY" -m pip install --disable-pip-version-check -q --no-deps -e "$REPO" 2>&1 | grep -v 'is ignored' || true
  kvprop_ok && { echo "vllm-env: $DIR set up for vllm $VERSION; kvprop installed from $REPO"; exit 0; }
fi
if [ -e "$DIR/.ok" ] && kvprop_ok; then
  # coverage.py joined the test tooling later: an environment built before gets it here
  "$PY" -c 'import coverage' 2>/dev/null \
    || "$PY" -m pip install --disable-pip-version-check -q coverage 2>&1 | grep -v 'is ignored' || true
  if [ "$(cat "$DIR/.ok")" = "$STAMP" ]; then
    echo "vllm-env: $DIR already set up for vllm $VERSION; skipping (delete it to rebuild)"
    exit 0
  fi
  [ "$(cat "$DIR/.ok")" = "$VERSION" ] && REUSE=1
fi

start=$(date +%s)
_last=$start
# pip install, quiet; drops pip's noise about absent file:// index
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

if [ -n "$REUSE" ]; then
  echo "vllm-env: $DIR has vllm $VERSION for the manager target; completing its import closure for the scheduler"
else
rm -rf "$DIR"
python3 -m venv "$DIR"

# 1. CPU torch.
pipq "torch==2.13.0+cpu"
step "torch 2.13.0+cpu (+ its small deps)"

# 2. vLLM itself, without its dependency tree.
pipq --no-deps "vllm==$VERSION"
step "vllm==$VERSION (--no-deps)"

# 3. Base pins: the import closure found on 0.23.0 and 0.24.0, at versions known to
#    work together. Step 5 adds
#    whatever else a release imports, so nothing here is release-specific.
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
pipq --no-deps "${DEPS[@]}"
step "base pins (--no-deps, ${#DEPS[@]} pins)"

# 4. kvprop from this repository (editable, so the checkout is what runs) and its test
#    tooling. --no-deps: its torch/numpy requirements are already met by the pins above.
#    Installed before the closure loop, whose check runs kvprop's own vllm target.
pipq hypothesis==6.170.17 pytest==9.2.0 coverage==7.17.5 attrs==26.1.0
pipq --no-deps -e "$REPO"
step "kvprop (editable, --no-deps) + hypothesis, pytest, coverage, attrs"
fi

# 5. The rest of the import closure, found by importing: run what `--target vllm` runs
#    (kvprop.targets.vllm's imports, then building one allocator), read the
#    ModuleNotFoundError, install that module's distribution --no-deps and retry. The
#    version is the newest that meets every requirement on it that the installed
#    distributions declare (vLLM's own Requires-Dist among them, e.g. fastapi<0.137 on
#    0.33.0). torch, triton, CUDA wheels and vLLM itself are never installed here.
CHECK="$DIR/.kvprop-import-check.py"
cat > "$CHECK" <<'PYEOF'
"""Exit 0 when kvprop's vllm target builds an allocator; 3 and 'missing-module: NAME' on
the last line when a module is missing; 1 (with the traceback) on any other failure."""
import sys
import traceback

try:
    from kvprop.allocator.specs import AllocatorConfig, FullAttention, SlidingWindow
    from kvprop.allocator.specs import EngineConfig
    from kvprop.targets.vllm.config import build_scheduler
    from kvprop.targets.vllm.manager import make_target

    config = AllocatorConfig((FullAttention(4), SlidingWindow(4, 16)), 13)
    make_target(config)
    # the scheduler target: vLLM's ModelConfig inspects the architecture in a subprocess on some
    # releases, which hides a missing module; importing the model's code shows it here
    import vllm.model_executor.models.llama  # noqa: F401

    build_scheduler(EngineConfig(config, token_budget=8))
except BaseException as e:  # noqa: BLE001 - report whatever stops the import
    traceback.print_exc()
    seen, err = set(), e
    while err is not None and id(err) not in seen:  # kvprop wraps it in a ConfigError
        seen.add(id(err))
        if isinstance(err, ModuleNotFoundError) and err.name:
            print(f"missing-module: {err.name}")
            sys.exit(3)
        err = err.__cause__ or err.__context__
    sys.exit(1)
PYEOF
# which distribution provides a missing module, at which versions (shared with the other recipe)
RESOLVE="$REPO/scripts/resolve-module.py"

rounds=0
ADDED=()
while :; do
  rc=0
  out=$(cd "$DIR" && VLLM_LOGGING_LEVEL=ERROR PYTHONWARNINGS=ignore "$PY" "$CHECK" 2>&1) || rc=$?
  [ $rc -eq 0 ] && break
  if [ $rc -ne 3 ]; then
    echo "$out" | tail -30 >&2
    echo "vllm-env: vllm $VERSION: building kvprop's vllm target failed with something other than a missing module (above); not fixable by installing one" >&2
    exit 1
  fi
  module=$(echo "$out" | sed -n 's/^missing-module: //p' | tail -1)
  rounds=$((rounds + 1))
  if [ $rounds -gt 30 ]; then
    echo "vllm-env: vllm $VERSION: still missing module '$module' after 30 rounds (added: ${ADDED[*]})" >&2
    exit 1
  fi
  if [ "${LAST_MODULE:-}" = "$module" ]; then
    echo "vllm-env: vllm $VERSION: module '$module' is still missing after installing $LAST_REQ; its PyPI name differs: add it to ALIAS in scripts/resolve-module.py" >&2
    exit 1
  fi
  req=$("$PY" "$RESOLVE" "$module") || {
    echo "vllm-env: vllm $VERSION: missing module '$module': $req" >&2
    exit 1
  }
  if ! pipq --no-deps "$req"; then
    echo "vllm-env: vllm $VERSION: missing module '$module', and 'pip install --no-deps $req' failed" >&2
    exit 1
  fi
  name=${req%%[<>=!~ ]*}
  pinned="$name==$("$PY" -c 'import importlib.metadata as m, sys; print(m.version(sys.argv[1]))' "$name")"
  echo "vllm-env: round $rounds: No module named '$module' -> $pinned (wanted: $req)"
  ADDED+=("$pinned")
  LAST_MODULE=$module
  LAST_REQ=$req
done
printf '%s\n' ${ADDED[@]+"${ADDED[@]}"} > "$DIR/.closure-added"
step "import closure loop ($rounds rounds, added: ${ADDED[*]:-none})"

# 6. Guard: CPU torch only, no CUDA wheels, the manager imports, kvprop's target loads.
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
from kvprop.allocator.specs import EngineConfig  # noqa: E402
from kvprop.targets.vllm.config import build_scheduler  # noqa: E402
from kvprop.targets.vllm.manager import make_target  # noqa: E402

config = AllocatorConfig((FullAttention(4), SlidingWindow(4, 16)), 13)
allocator, view = make_target(config)
assert view.num_free_blocks == 12, view.num_free_blocks
scheduler = build_scheduler(EngineConfig(config, token_budget=8))
assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 12
print(f"vllm-env: torch {torch.__version__}, vllm {vllm.__version__}: kvprop's vllm targets build an allocator and a scheduler")
PYEOF
step "import check"
kvprop_ok || { echo "vllm-env: kvprop does not import from $REPO in $DIR" >&2; exit 1; }

echo "$STAMP" > "$DIR/.ok"
echo "vllm-env: $DIR ready in $(($(date +%s) - start)) s"
