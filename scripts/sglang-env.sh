#!/usr/bin/env bash
# scripts/sglang-env.sh VERSION [DIR]
#
# Build a CPU-only virtual environment at DIR (default: .venv-sglang-VERSION in the repo)
# in which SGLang's prefix-cache code (its radix caches, the request-to-token pool and the
# token-to-KV pool allocators) imports and runs on CPU tensors. Any release from 0.5.18 on.
#
# - torch is the CPU build 2.13.0+cpu (pip's configured index serves it);
#   the "+cpu" local label means pip can never pick a same-numbered CUDA build.
# - SGLang and its import closure go in with --no-deps: resolving SGLang's own dependencies
#   would pull a CUDA torch, triton, flashinfer and nvidia-* wheels (gigabytes). Base pins
#   (known to work together) first; then a loop imports the modules kvprop drives, reads
#   `No module named 'X'`, installs X's distribution --no-deps (never torch/triton/CUDA
#   wheels) and retries, so any release gets what it imports without a per-release table.
#   The final check fails if any nvidia-*/triton distribution is present.
# - Two import shims (small stub packages written into the environment's site-packages,
#   with no dist-info, so no distribution named triton or torchvision is installed):
#     triton       SGLang imports triton at module level in nearly every module (memory_pool,
#                  the paged allocator's kernels, utils) to define GPU kernels with
#                  @triton.jit. The shim lets those decorators run at import; a kernel so
#                  defined raises when launched, and so does every other triton function.
#                  The CPU paths kvprop drives never launch one: the allocators take their
#                  torch paths when the platform does not support triton
#                  (current_platform.capabilities.supports_triton is False on CPU) and the
#                  radix caches only index tensors.
#     torchvision  imported at module level by two model-config helpers for image models
#                  (sglang.srt.configs.deepseek_ocr, sglang.srt.multimodal.internvl_utils:
#                  image transforms), which the sglang.srt.configs package that memory_pool
#                  imports loads. The shim lets them import; every name in it raises when
#                  used. The cache code never processes an image.
#   torch itself sees neither shim: its own imports of triton and torchvision fail as if
#   they were absent (torch would otherwise take the shim for a real triton at import and
#   build its kernels on it).
# - kvprop itself is installed editable (--no-deps) from this repository, with attrs,
#   hypothesis, pytest and coverage (for `kvprop coverage`).
# - The last step builds a RadixCache and a UnifiedRadixCache over a real ReqToTokenPool,
#   MHATokenToKVPool and token-to-KV allocator on CPU (page size 1 and 4) and runs
#   match_prefix, insert, inc_lock_ref and evict on them, checking the cache's running
#   totals and the allocator's free count.
# - Idempotent: exits early when DIR/.ok names VERSION and kvprop imports from this
#   repository (delete DIR to rebuild).
set -euo pipefail

if [ $# -lt 1 ] || [ $# -gt 2 ]; then
  echo "usage: $0 VERSION [DIR]   (any SGLang release from 0.5.18 on; e.g. 0.5.18 or 0.5.23)" >&2
  exit 2
fi
VERSION=$1
if ! [[ $VERSION =~ ^[0-9]+\.[0-9]+\.[0-9]+(\.post[0-9]+)?$ ]]; then
  echo "sglang-env: '$VERSION' is not an SGLang release number (e.g. 0.5.23)" >&2
  exit 2
fi
REPO=$(cd "$(dirname "$0")/.." && pwd)
DIR=${2:-$REPO/.venv-sglang-$VERSION}
case $DIR in /*) ;; *) DIR="$PWD/$DIR" ;; esac  # the steps below run in other directories
PY="$DIR/bin/python"

# kvprop is installed from this checkout, and its command and its pytest plugin load
kvprop_ok() {
  # (run from / so that a checkout in the working directory does not stand in for the install)
  [ -x "$PY" ] && [ "$(cd / && "$PY" -c 'import kvprop, os; print(os.path.dirname(os.path.dirname(os.path.abspath(kvprop.__file__))))' 2>/dev/null)" = "$REPO" ] \
    && "$DIR/bin/kvprop" --version >/dev/null 2>&1 \
    && (cd / && "$PY" -c "from importlib.metadata import entry_points as e; [p.load() for p in e(group='pytest11') if p.name == 'kvprop']") >/dev/null 2>&1
}

STAMP="sglang $VERSION"
# An environment built for this release from another checkout (a cache shared by clones):
# only kvprop is installed again, from this one.
if [ -e "$DIR/.ok" ] && [ "$(cat "$DIR/.ok")" = "$STAMP" ] && ! kvprop_ok; then
  "$PY" -m pip install --disable-pip-version-check -q --no-deps -e "$REPO" 2>&1 | grep -v 'is ignored' || true
  kvprop_ok && { echo "sglang-env: $DIR set up for sglang $VERSION; kvprop installed from $REPO"; exit 0; }
fi
if [ -e "$DIR/.ok" ] && [ "$(cat "$DIR/.ok")" = "$STAMP" ] && kvprop_ok; then
  echo "sglang-env: $DIR already set up for sglang $VERSION; skipping (delete it to rebuild)"
  exit 0
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
  echo "sglang-env: $1: $((now - _last)) s"
  _last=$now
}

rm -rf "$DIR"
python3 -m venv "$DIR"

# 1. CPU torch.
pipq "torch==2.13.0+cpu"
step "torch 2.13.0+cpu (+ its small deps)"

# 2. kvprop from this repository (editable, so the checkout is what runs) and its test
#    tooling, before SGLang and the --no-deps pins below (whose own requirements pip would
#    otherwise report as unmet when the tooling shares one, e.g. packaging). kvprop goes
#    in with --no-deps: its torch requirement is met by step 1.
pipq hypothesis==6.170.17 pytest==9.2.0 coverage==7.17.5 attrs==26.1.0
pipq --no-deps -e "$REPO"
step "kvprop (editable, --no-deps) + hypothesis, pytest, coverage, attrs"

# 3. SGLang itself, without its dependency tree.
pipq --no-deps "sglang==$VERSION"
step "sglang==$VERSION (--no-deps)"

# 4. Base pins: the import closure found on 0.5.18 and 0.5.23, at versions known to work
#    together. Step 6 adds whatever else a release imports, and what SGLang pins to one
#    version per release (transformers, tokenizers, huggingface-hub, openai, ...), so
#    nothing here is release-specific.
DEPS=(
  numpy==2.4.6 packaging==26.4 psutil==7.2.2 pyzmq==27.3.0 requests==2.34.2
  urllib3==2.8.0 certifi==2026.10.19.post1 idna==3.20 charset-normalizer==3.4.4
  pydantic==2.14.4 pydantic_core==2.50.5 typing-inspection==0.4.5 annotated-types==0.8.0
  tqdm==4.70.1 PyYAML==6.0.4 regex==2026.11.19 msgspec==0.23.0 pybase64==1.5.1
  pillow==13.0.0 orjson==3.13.0 starlette==1.10.0 anyio==4.16.0 sniffio==1.3.1
  ipython==9.18.1 traitlets==5.16.1 aiohttp==3.14.5 multidict==7.2.1 yarl==1.25.1
  propcache==0.5.4 aiohappyeyeballs==2.7.1 aiosignal==1.4.0 frozenlist==1.8.0 h11==0.16.0
  httpx==0.29.0 distro==1.9.0 safetensors==0.8.0 loguru==0.7.3 gguf==0.19.0
  partial-json-parser==0.2.1.1.post7
)
pipq --no-deps "${DEPS[@]}"
step "base pins (--no-deps, ${#DEPS[@]} pins)"

# 5. The import shims (see the header for what each replaces and why it is never called).
#    One module, _kvprop_import_shim, holds them; each shim package is an __init__.py that
#    installs it, so that any submodule (triton.language.extra.cuda, torchvision.transforms.v2,
#    ...) imports and every name in it is a placeholder that raises when called.
SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
cat > "$SITE/_kvprop_import_shim.py" <<'PYEOF'
"""Import shims for kvprop's CPU-only SGLang environment (written by scripts/sglang-env.sh).

SGLang defines GPU kernels at module level (@triton.jit, tl.constexpr annotations, lists of
triton.Config) and imports torchvision's image transforms at module level in code the
model-config modules pull in. On CPU kvprop imports those modules but never runs a kernel
or a transform: every name here is importable and usable in a definition, and raises
ShimCalled when called or launched.
"""
import importlib.abc
import importlib.machinery
import sys
import types


class ShimCalled(RuntimeError):
    """A triton kernel or a torchvision function was called in a CPU-only environment."""


class Placeholder:
    """Stands for any object of a shimmed package: usable in a definition, raising when run."""

    def __init__(self, name, *args, **kwargs):
        self._name = name

    def __call__(self, *args, **kwargs):
        # a decorator used bare (@triton.jit) or with arguments (@triton.autotune(...)),
        # or applied to a kernel defined before (autotune(...)(kernel)), returns a
        # placeholder for what it decorates; a kernel is launched as kernel[grid](...)
        if len(args) == 1 and not kwargs and callable(args[0]):
            return Placeholder(f"{self._name}({getattr(args[0], '__qualname__', args[0])})")
        if not args or kwargs:
            return Placeholder(f"{self._name}(...)")
        raise ShimCalled(f"{self._name} called: an import shim in this CPU-only environment")

    def __getitem__(self, grid):
        raise ShimCalled(f"{self._name}[...] launched: an import shim in this CPU-only environment")

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Placeholder(f"{self._name}.{attr}")

    def __repr__(self):
        return f"<import shim {self._name}>"


class constexpr:  # noqa: N801 - triton's own name
    """triton.language.constexpr: an annotation (x: tl.constexpr) and tl.constexpr(v) at import."""

    def __init__(self, value=None):
        self.value = value


class Config:
    """triton.Config: autotune config lists are built at import; it records its arguments."""

    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs


SPECIAL = {"triton.language": {"constexpr": constexpr}, "triton": {"Config": Config}}


def fill(module):
    """Make `module` a shim: its special names, a version, and placeholders for the rest."""
    name = module.__name__
    for key, value in SPECIAL.get(name, {}).items():
        setattr(module, key, value)
    if "." not in name:
        module.__version__ = "0.0.0"

    def __getattr__(attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Placeholder(f"{name}.{attr}")

    module.__getattr__ = __getattr__
    module.__path__ = []  # a package: its submodules come from the finder below


class Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports any submodule of a shimmed package as another shim module."""

    def __init__(self, top):
        self.top = top

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(self.top + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return types.ModuleType(spec.name)

    def exec_module(self, module):
        fill(module)


SHIMMED = ("triton", "torchvision")


def _torch_asks(name, importer_globals):
    """Whether a module of torch imports a shimmed package: torch must see neither as
    installed (it would take the shim for a real triton and build its own kernels on it)."""
    top = name.partition(".")[0]
    importer = (importer_globals or {}).get("__name__") or ""
    return top in SHIMMED and importer.partition(".")[0] == "torch"


def _importer_globals():
    """The globals of the module whose import statement is running a shim's __init__."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_globals.get("__name__")
        if not frame.f_code.co_filename.startswith("<frozen importlib") and name not in (
            __name__, *SHIMMED):
            return frame.f_globals
        frame = frame.f_back
    return {}


def _hide_from_torch():
    """Wrap __import__ so that torch's own imports of a shimmed package fail as if it were
    absent; every other importer gets the shim."""
    import builtins

    original = builtins.__import__
    if getattr(original, "_kvprop_shim", False):
        return

    def __import__(name, globals=None, locals=None, fromlist=(), level=0):
        if level == 0 and _torch_asks(name, globals):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return original(name, globals, locals, fromlist, level)

    __import__._kvprop_shim = True
    builtins.__import__ = __import__


def install(module):
    """Called by a shim package's __init__.py with the package itself."""
    _hide_from_torch()
    if _torch_asks(module.__name__, _importer_globals()):
        raise ModuleNotFoundError(f"No module named {module.__name__!r}", name=module.__name__)
    fill(module)
    if not any(isinstance(f, Finder) and f.top == module.__name__ for f in sys.meta_path):
        sys.meta_path.append(Finder(module.__name__))
PYEOF
for pkg in triton torchvision; do
  mkdir -p "$SITE/$pkg"
  cat > "$SITE/$pkg/__init__.py" <<PYEOF
"""Import shim for $pkg in kvprop's CPU-only SGLang environment (see _kvprop_import_shim)."""
import sys

import _kvprop_import_shim

_kvprop_import_shim.install(sys.modules[__name__])
PYEOF
done
step "import shims (triton, torchvision)"

# 6. The rest of the import closure, found by importing: the modules kvprop drives (the
#    radix caches of every kind the release has, the pools and allocators), read the
#    ModuleNotFoundError, install that module's distribution --no-deps and retry. The
#    version is the newest that meets every requirement on it that the installed
#    distributions declare (SGLang's own Requires-Dist among them). torch, triton, CUDA
#    wheels and SGLang's compiled kernels are never installed here.
MODULES="$DIR/.kvprop-sglang-modules.py"
cat > "$MODULES" <<'PYEOF'
"""The SGLang modules kvprop drives: required ones, then ones only some releases have."""
REQUIRED = (
    "sglang.srt.mem_cache.radix_cache",
    "sglang.srt.mem_cache.base_prefix_cache",
    "sglang.srt.mem_cache.cache_init_params",
    "sglang.srt.mem_cache.memory_pool",
    "sglang.srt.mem_cache.allocator",
    "sglang.srt.mem_cache.allocator.paged",
    "sglang.srt.mem_cache.allocator.swa",
    "sglang.srt.mem_cache.allocator.mamba",
    "sglang.srt.mem_cache.swa_memory_pool",
    "sglang.srt.mem_cache.unified_radix_cache",
)
OPTIONAL = (
    "sglang.srt.mem_cache.swa_radix_cache",
    "sglang.srt.mem_cache.mamba_radix_cache",
    "sglang.srt.mem_cache.pure_swa_radix_cache",
    "sglang.srt.mem_cache.chunk_cache",
    "sglang.srt.mem_cache.unified_memory_pool",
    "sglang.srt.mem_cache.allocator.unified_hybrid_swa",
    "sglang.srt.mem_cache.allocator.unified_mamba",
)
PYEOF
CHECK="$DIR/.kvprop-import-check.py"
cat > "$CHECK" <<'PYEOF'
"""Exit 0 when every module kvprop drives imports; 3 and 'missing-module: NAME' on the last
line when a third-party module is missing; 1 (with the traceback) on any other failure."""
import importlib
import importlib.metadata
import importlib.util
import os
import re
import sys
import traceback

here = os.path.dirname(os.path.abspath(__file__))
spec = importlib.util.spec_from_file_location("modules", os.path.join(here, ".kvprop-sglang-modules.py"))
mods = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mods)
try:
    for name in mods.REQUIRED:
        importlib.import_module(name)
    for name in mods.OPTIONAL:
        if importlib.util.find_spec(name) is not None:
            importlib.import_module(name)
except BaseException as e:  # noqa: BLE001 - report whatever stops the import
    traceback.print_exc()
    seen, err = set(), e
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        # a distribution a package checks for at import (transformers checks its own
        # requirements): importlib.metadata's PackageNotFoundError names it in a sentence
        if isinstance(err, importlib.metadata.PackageNotFoundError):
            found = re.search(r"'([A-Za-z0-9][A-Za-z0-9_.-]*)", str(err))
            if found:
                print(f"missing-module: {found.group(1)}")
                sys.exit(3)
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
  out=$(cd "$DIR" && PYTHONWARNINGS=ignore "$PY" "$CHECK" 2>&1) || rc=$?
  [ $rc -eq 0 ] && break
  if [ $rc -ne 3 ]; then
    echo "$out" | tail -30 >&2
    echo "sglang-env: sglang $VERSION: importing the cache modules failed with something other than a missing module (above); not fixable by installing one" >&2
    exit 1
  fi
  module=$(echo "$out" | sed -n 's/^missing-module: //p' | tail -1)
  rounds=$((rounds + 1))
  if [ $rounds -gt 40 ]; then
    echo "sglang-env: sglang $VERSION: still missing module '$module' after 40 rounds (added: ${ADDED[*]})" >&2
    exit 1
  fi
  if [ "${LAST_MODULE:-}" = "$module" ]; then
    echo "$out" | tail -30 >&2
    echo "sglang-env: sglang $VERSION: module '$module' is still missing after installing $LAST_REQ; its PyPI name differs (add it to ALIAS in scripts/resolve-module.py) or a shim lacks it" >&2
    exit 1
  fi
  req=$("$PY" "$RESOLVE" "$module") || {
    echo "$out" | tail -30 >&2
    echo "sglang-env: sglang $VERSION: missing module '$module': $req" >&2
    exit 1
  }
  if ! pipq --no-deps "$req"; then
    echo "sglang-env: sglang $VERSION: missing module '$module', and 'pip install --no-deps $req' failed" >&2
    exit 1
  fi
  name=${req%%[<>=!~ ]*}
  pinned="$name==$("$PY" -c 'import importlib.metadata as m, sys; print(m.version(sys.argv[1]))' "$name")"
  echo "sglang-env: round $rounds: No module named '$module' -> $pinned (wanted: $req)"
  ADDED+=("$pinned")
  LAST_MODULE=$module
  LAST_REQ=$req
done
printf '%s\n' ${ADDED[@]+"${ADDED[@]}"} > "$DIR/.closure-added"
step "import closure loop ($rounds rounds, added: ${ADDED[*]:-none})"

# 7. Guard: CPU torch only, no CUDA wheels or triton distribution, and SGLang's radix cache
#    runs over its real pools on CPU.
PYTHONWARNINGS=ignore "$PY" - "$VERSION" <<'PYEOF'
import importlib.metadata as md
import sys

import torch

bad = sorted(
    d.metadata["Name"]
    for d in md.distributions()
    if d.metadata["Name"].lower().startswith(("nvidia-", "triton", "torchvision", "pytorch-triton"))
)
assert not bad, f"CUDA packages crept in: {bad}"
assert torch.__version__.endswith("+cpu"), torch.__version__
assert torch.version.cuda is None, torch.version.cuda
assert md.version("sglang") == sys.argv[1], (md.version("sglang"), sys.argv[1])

from sglang.srt.mem_cache.allocator import (  # noqa: E402
    PagedTokenToKVPoolAllocator,
    TokenToKVPoolAllocator,
)
from sglang.srt.mem_cache.base_prefix_cache import (  # noqa: E402
    EvictParams,
    InsertParams,
    MatchPrefixParams,
)
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey  # noqa: E402


def pools(page_size):
    """A KV pool of 64 slots, its allocator (paged above one slot a page) and a request pool."""
    size = 64
    kv = MHATokenToKVPool(size, page_size, torch.float16, head_num=1, head_dim=8, layer_num=1,
                          device="cpu", enable_memory_saver=False, enable_alt_stream=False)
    if page_size == 1:
        alloc = TokenToKVPoolAllocator(size, torch.float16, "cpu", kv, need_sort=False)
    else:
        alloc = PagedTokenToKVPoolAllocator(size, page_size, torch.float16, "cpu", kv, need_sort=False)
    req_pool = ReqToTokenPool(4, 32, "cpu", enable_memory_saver=False)
    return alloc, req_pool


def run(page_size):
    alloc, req_pool = pools(page_size)
    cache = RadixCache(CacheInitParams(disable=False, req_to_token_pool=req_pool,
                                       token_to_kv_pool_allocator=alloc, page_size=page_size))
    free0 = alloc.available_size()
    tokens = list(range(100, 108))
    indices = alloc.alloc(len(tokens))
    assert indices is not None and len(indices) == 8, indices
    assert alloc.available_size() == free0 - 8
    res = cache.insert(InsertParams(key=RadixKey(tokens), value=indices))
    assert res.prefix_len == 0, res
    assert cache.evictable_size() == 8 and cache.protected_size() == 0
    m = cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens[:4] + [1, 2, 3, 4])))
    matched = m.device_prefix_len if hasattr(m, "device_prefix_len") else len(m.device_indices)
    assert matched == 4, matched
    cache.inc_lock_ref(m.last_device_node)
    assert (cache.evictable_size(), cache.protected_size()) == (4, 4)
    cache.evict(EvictParams(num_tokens=8))
    assert (cache.evictable_size(), cache.protected_size()) == (0, 4)
    assert alloc.available_size() == free0 - 4, (alloc.available_size(), free0)
    cache.dec_lock_ref(m.last_device_node)
    cache.evict(EvictParams(num_tokens=8))
    assert (cache.evictable_size(), cache.protected_size()) == (0, 0)
    assert alloc.available_size() == free0, (alloc.available_size(), free0)


def run_unified(page_size):
    """The unified tree (the default tree cache from 0.5.19 on; SWA and Mamba models' on
    0.5.18) with its full-attention component: a lock protects the matched prefix."""
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    alloc, req_pool = pools(page_size)
    cache = UnifiedRadixCache(CacheInitParams(
        disable=False, req_to_token_pool=req_pool, token_to_kv_pool_allocator=alloc,
        page_size=page_size, tree_components=(ComponentType.FULL,)))
    free0 = alloc.available_size()
    indices = alloc.alloc(8)
    cache.insert(InsertParams(key=RadixKey(array("q", range(100, 108))), value=indices))
    m = cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", [100, 101, 102, 103, 1, 2, 3, 4]))))
    cache.inc_lock_ref(m.last_device_node)
    assert (cache.evictable_size(), cache.protected_size()) == (4, 4)
    cache.evict(EvictParams(num_tokens=8))
    assert (cache.evictable_size(), cache.protected_size()) == (0, 4)
    assert alloc.available_size() == free0 - 4, (alloc.available_size(), free0)
    return type(cache.tree_core).__name__


from array import array  # noqa: E402

for page in (1, 4):
    run(page)
    core = run_unified(page)
print(f"sglang-env: torch {torch.__version__}, sglang {sys.argv[1]}: RadixCache and UnifiedRadixCache "
      f"({core}) over ReqToTokenPool and the token-to-KV allocator run match_prefix/insert/evict on "
      "CPU (page size 1 and 4)")
PYEOF
step "cache check"
kvprop_ok || { echo "sglang-env: kvprop does not import from $REPO in $DIR" >&2; exit 1; }

echo "$STAMP" > "$DIR/.ok"
echo "sglang-env: $DIR ready in $(($(date +%s) - start)) s"
