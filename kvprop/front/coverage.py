"""``kvprop coverage``: how much of the target's allocator the walks reach, measured by coverage.py.

Walks run in this process, one after another (``walk_seed(seed, i)`` for i = 0, 1, ...,
as fuzz worker 0 draws them) until the time budget is spent, under a ``coverage.Coverage``
with branch measurement that is started before the allocator's modules are imported, so
their import-time lines (``def``, ``class``, imports) count as executed. Finds are counted,
not reported: ``kvprop fuzz`` is the command that finds.

What is measured:

- ``kvprop`` (the default): every module of kvprop's own allocator, ``kvprop/allocator/``;
- ``vllm``: vLLM's allocator, ``vllm/v1/core/`` ``block_pool.py``, ``kv_cache_coordinator.py``,
  ``kv_cache_manager.py`` and ``single_type_kv_cache_manager.py``;
- ``sglang``: SGLang's radix caches and token allocators (``SGLANG_TREE_FILES``,
  ``SGLANG_ALLOCATOR_FILES``, and ``radix_cache.py`` before 0.5.19), under ``sglang/srt/mem_cache/``;
- ``package.module:factory``: the module's file and every ``.py`` file under its package's
  directory (a top-level module: its file alone).

The figures are coverage.py's: per file statements, missed statements, branches (branch
exits), partial branches, and the percent of statements and branches together; per class
(its lines from the first decorator to its last line, methods included) the same figures;
and the functions never entered (no executed line in the body). Only the walk driver runs.
"""

from __future__ import annotations

import ast
import importlib.util
import math
import os
import sys
import time
import warnings
from pathlib import Path

import attrs

from kvprop.errors import ConfigError
from kvprop.front.coverage_figures import ZERO, Figures, Report, Scope, render, tabulate

VLLM_FILES = ("block_pool.py", "kv_cache_coordinator.py", "kv_cache_manager.py", "single_type_kv_cache_manager.py")
VLLM_SCHEDULER_FILES = ("sched/scheduler.py",)
VLLM_ASYNC_SCHEDULER_FILE = "sched/async_scheduler.py"  # the pipelined scheduler, where the release has it
# the offloading connector's scheduler side, relative to the vllm package (0.23.0 on)
VLLM_CONNECTOR_FILE = "distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py"
# as kvprop.targets (not imported here)
NAMES = "'kvprop', 'vllm', 'vllm-scheduler', 'sglang' or 'package.module:factory'"
MAX_OPS = 10_000
PROGRESS_EVERY = 10.0

__all__ = ["ZERO", "Figures", "Report", "check", "measure", "render", "scope", "tabulate", "VLLM_FILES"]


# ---- what a target's allocator is ------------------------------------------------------------


def _py_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*.py") if "__pycache__" not in p.parts)


def _scope_of(files, include, measured) -> Scope:
    files = tuple(sorted({os.path.realpath(f) for f in files}))
    if not files:
        raise ConfigError(f"{measured}: no Python file to measure")
    root = os.path.commonpath([os.path.dirname(f) for f in files])
    return Scope(files, tuple(include), measured, root)


def _vllm_scope(target: str = "vllm") -> Scope:
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        from kvprop.targets.vllm.loading import INSTALL_HINT  # kvprop's own advice: how to build a vLLM environment

        raise ConfigError(
            f"target {target!r} needs vLLM importable, but there is no module named 'vllm'; {INSTALL_HINT}"
        )
    core = Path(next(iter(spec.submodule_search_locations))) / "v1" / "core"
    names = VLLM_FILES + (VLLM_SCHEDULER_FILES if target == "vllm-scheduler" else ())
    if target == "vllm-scheduler" and (core / VLLM_ASYNC_SCHEDULER_FILE).is_file():
        names += (VLLM_ASYNC_SCHEDULER_FILE,)
    files = [core / name for name in names]
    missing = [str(f.relative_to(core)) for f in files if not f.is_file()]
    if missing:
        raise ConfigError(f"target {target!r}: this vLLM ({core}) has no {missing}; kvprop measures {list(names)}")
    measured = "vLLM's allocator" + (" and scheduler" if target == "vllm-scheduler" else "")
    measured += ": vllm/v1/core/" + ", ".join(names)
    connector = core.parent.parent / VLLM_CONNECTOR_FILE
    if target == "vllm-scheduler" and connector.is_file():
        files.append(connector)
        measured += f", vllm/{VLLM_CONNECTOR_FILE}"
    return _scope_of(files, [str(f.resolve()) for f in files], measured)


# SGLang's radix caches and token allocators, relative to sglang/srt/mem_cache: the tree classes
# its scheduler's factory builds (RadixCache for full attention before 0.5.19, UnifiedRadixCache
# with its Python tree core otherwise) and the allocators kvprop's shapes build.
SGLANG_TREE_FILES = ("unified_radix_cache.py", "unified_cache/unified_tree_core.py")
SGLANG_LEGACY_TREE_FILE = "radix_cache.py"  # what full attention builds on 0.5.18
SGLANG_ALLOCATOR_FILES = ("allocator/base.py", "allocator/token.py", "allocator/paged.py", "allocator/swa.py")
# What the scheduler's KV path runs beside them, measured where the release has the file: the
# unified tree's components (full attention and the window), the window's slot frees and the
# batch's allocation (common.py, allocation.py), the cache protocol, and the pools.
SGLANG_PATH_FILES = (
    "unified_cache/components/base.py",
    "unified_cache/components/full.py",
    "unified_cache/components/swa.py",
    "base_prefix_cache.py",
    "common.py",
    "allocation.py",
    "memory_pool.py",
    "swa_memory_pool.py",
)


def _sglang_scope() -> Scope:
    from kvprop.targets.sglang.loading import INSTALL_HINT, check_release  # kvprop's advice; imports no SGLang

    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            f"target 'sglang' needs SGLang importable, but there is no module named 'sglang'; {INSTALL_HINT}"
        )
    from importlib.metadata import version

    release = check_release(version("sglang"))
    mem_cache = Path(next(iter(spec.submodule_search_locations))) / "srt" / "mem_cache"
    names: tuple[str, ...] = SGLANG_TREE_FILES + SGLANG_ALLOCATOR_FILES
    if release < (0, 5, 19):
        names = (SGLANG_LEGACY_TREE_FILE, *names)
    files = [mem_cache / name for name in names]
    missing = [name for name, f in zip(names, files, strict=True) if not f.is_file()]
    if missing:
        raise ConfigError(f"target 'sglang': this SGLang ({mem_cache}) has no {missing}; kvprop measures {list(names)}")
    beside = tuple(name for name in SGLANG_PATH_FILES if (mem_cache / name).is_file())
    names += beside
    files += [mem_cache / name for name in beside]
    measured = "SGLang's radix cache, allocators, pools and KV path: sglang/srt/mem_cache/" + ", ".join(names)
    return _scope_of(files, [str(f.resolve()) for f in files], measured)


def _path_scope(target: str) -> Scope:
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"target must be {NAMES}, got {target!r}")
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())  # as kvprop.targets.load_factory finds it
    try:
        spec = importlib.util.find_spec(module_name)
    except (ImportError, ValueError) as e:
        raise ConfigError(f"target {target!r}: cannot import {module_name!r} ({e})") from e
    except Exception as e:  # noqa: BLE001 - a parent package's own code failed: the user's input
        raise ConfigError(f"target {target!r}: importing {module_name!r} raised {type(e).__name__}: {e}") from e
    if spec is None or not spec.origin or not os.path.isfile(spec.origin):
        raise ConfigError(f"target {target!r}: cannot import {module_name!r} (no such module, or not a .py file)")
    origin = Path(spec.origin).resolve()
    if spec.submodule_search_locations:  # the module is a package: its directory
        directory = origin.parent
    elif "." in module_name:  # its package's directory
        directory = origin.parent
    else:  # a top-level module: its file alone
        return _scope_of([origin], [str(origin)], f"{origin.name} (the target's module; it has no package)")
    files = _py_files(directory)
    return _scope_of(
        files, [str(directory / "*")], f"{origin.name} and its package directory {directory.name}/ ({len(files)} files)"
    )


def scope(target: str | None) -> Scope:
    """The files ``kvprop coverage`` measures for ``target``; a ConfigError if it has none."""
    if target in (None, "kvprop"):
        directory = Path(__file__).resolve().parent.parent / "allocator"
        return _scope_of(_py_files(directory), [str(directory / "*")], "kvprop's own allocator: kvprop/allocator/")
    if target in ("vllm", "vllm-scheduler"):
        return _vllm_scope(target)
    if target in ("sglang", "sglang-rust"):  # the Python code around either tree core
        return _sglang_scope()
    if not isinstance(target, str):
        raise ConfigError(f"target must be {NAMES}, got {target!r}")
    return _path_scope(target)


# Imported untraced before measuring starts, so that the budget goes to walks, not to imports under
# the tracer: what the walks need and nothing measured (none of these imports a measured module; were
# one to, the report would name it under ``imported_before``).
WARM: dict[str, tuple[str, ...]] = {
    "vllm": ("vllm", "vllm.sampling_params", "vllm.v1.kv_cache_interface", "vllm.v1.core.kv_cache_utils")
}
WARM["vllm-scheduler"] = (*WARM["vllm"], "vllm.config")


def _warm(target) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in ("torch", *WARM.get(target, ())):
            if name.startswith("vllm"):
                os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # as kvprop.targets.vllm.loading does
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - building the target under measurement says what is wrong
                return


def _imported_before(files) -> list[str]:
    """Measured modules already imported (their import-time lines cannot count as executed)."""
    wanted = set(files)
    found = []
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if path and os.path.realpath(path) in wanted and _has_statements(os.path.realpath(path)):
            found.append(name)
    return sorted(found)


def _has_statements(path: str) -> bool:
    try:
        body = ast.parse(Path(path).read_text(encoding="utf-8")).body
    except (OSError, SyntaxError, ValueError):
        return True
    first = body[0] if body else None
    docstring = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
    return len(body) > int(docstring)


# ---- the measurement ------------------------------------------------------------------------


VLLM_TARGETS = ("vllm", "vllm-scheduler")


def targets_of(target) -> list:
    """The targets a measurement walks: ``A+B`` alternates walks between vLLM's two targets
    (what the harness reaches of vLLM's KV core, driven both ways); anything else is one."""
    if not isinstance(target, str) or "+" not in target:
        return [target]
    names = target.split("+")
    if len(set(names)) != len(names) or not set(names) <= set(VLLM_TARGETS):
        raise ConfigError(
            f"target {target!r}: several targets must be distinct ones of {list(VLLM_TARGETS)}, joined by '+'"
        )
    return names


def check(target=None, variant=None, seconds: float = 60.0, driver: str = "walk", max_ops: int = 200) -> Scope:
    """The measured files, after checking the arguments that need no import of the target;
    bad input is a ConfigError (an unknown variant is found by ``measure``)."""
    targets = targets_of(target)
    if len(targets) > 1:
        for one in targets:
            check(one, variant, seconds, driver, max_ops)
        return scope("vllm-scheduler" if "vllm-scheduler" in targets else "vllm")
    if driver != "walk":
        raise ConfigError(f"kvprop coverage runs the walk driver only, not {driver!r}")
    if not isinstance(seconds, (int, float)) or not math.isfinite(seconds) or seconds <= 0:
        raise ConfigError(f"seconds must be a finite number > 0, got {seconds!r}")
    if not isinstance(max_ops, int) or not 1 <= max_ops <= MAX_OPS:
        raise ConfigError(f"max_ops must be an integer in [1, {MAX_OPS:,}], got {max_ops!r}")
    if target not in (None, "kvprop") and variant not in (None, "correct"):
        raise ConfigError(f"variant {variant!r} applies to the kvprop target only, not to target {target!r}")
    return scope(target)


PROBE_ATTEMPTS = 64


def measure(
    target=None,
    variant=None,
    seconds: float = 60.0,
    seed: int = 0,
    driver: str = "walk",
    max_ops: int = 200,
    device=None,
    html=None,
    progress=None,
    journal=None,
) -> Report:
    """Walk ``target`` for ``seconds`` under coverage.py and report what of its allocator ran.

    ``html``: a directory for coverage.py's HTML report. ``progress(runs, steps, elapsed)``
    is called about every ``PROGRESS_EVERY`` seconds. Bad input is a ConfigError. ``kvprop
    coverage`` runs it in a supervised worker, whose ``journal`` records each walk."""
    try:
        import coverage
    except ImportError:
        raise ConfigError("kvprop coverage needs coverage.py: pip install 'coverage>=7'") from None

    sc = check(target, variant, seconds, driver, max_ops)
    html_dir = None
    if html is not None:
        html_dir = Path(html)
        if html_dir.exists() and not html_dir.is_dir():
            raise ConfigError(f"--html {str(html)!r} is a file; give a directory")
    targets = targets_of(target)
    for one in targets:
        _warm(one)
    imported_before = _imported_before(sc.files)
    cov = coverage.Coverage(branch=True, include=list(sc.include), data_file=None, config_file=False)
    cov.set_option("run:disable_warnings", ["no-data-collected", "module-not-imported", "module-not-measured"])
    runs = steps = finds = refused = 0
    setup = time.monotonic()
    cov.start()
    try:
        if target in (None, "kvprop"):
            from kvprop.targets.variants import get_variant

            get_variant(variant)
        else:
            from kvprop.search.supervisor import probe_here
            from kvprop.targets import load_factory

            for one in targets:
                load_factory(one)
                refusal = probe_here(journal, one, variant, device, PROBE_ATTEMPTS)
                if refusal is not None:
                    raise ConfigError(
                        f"target {one!r} could not build any of {PROBE_ATTEMPTS} sampled configurations; "
                        f"first refusal: {refusal}"
                    )
        if device is not None:
            from kvprop.sim.memory import pick_device

            pick_device(device)
        from kvprop.search.walk import run_walk, walk_seed

        started = last = time.monotonic()
        while True:
            one = targets[runs % len(targets)]  # walk i's seed on one target, walk i + 1's on the next
            result = run_walk(
                walk_seed(seed, runs), variant, one, device=device, max_ops=max_ops, journal=journal, index=runs
            )
            runs += 1
            steps += result.steps_run
            finds += result.failure is not None
            refused += result.refused is not None
            now = time.monotonic()
            if now - started >= seconds:
                break
            if progress is not None and now - last >= PROGRESS_EVERY:
                last = now
                progress(runs, steps, now - started)
    finally:
        cov.stop()
    elapsed = time.monotonic() - started
    setup = started - setup
    files, classes, never, empty, functions = tabulate(cov, sc)
    specs: tuple = ()
    if any(one in VLLM_TARGETS for one in targets):  # the specs the release registers, driven or not
        from kvprop.targets.vllm.specs import census

        specs = tuple(attrs.asdict(row) for row in census())
    if html_dir is not None:
        from kvprop.front.output_paths import unwritable_is_usage

        with unwritable_is_usage(html_dir, "--html"):
            html_dir.mkdir(parents=True, exist_ok=True)
            cov.html_report(morfs=list(sc.files), directory=str(html_dir), title=f"kvprop coverage: {sc.measured}")
    return Report(
        target=target or "kvprop",
        variant=variant,
        driver=driver,
        seed=seed,
        max_ops=max_ops,
        budget=float(seconds),
        seconds=elapsed,
        setup_seconds=setup,
        runs=runs,
        steps=steps,
        finds=finds,
        refused=refused,
        measured=sc.measured,
        root=sc.root,
        files=tuple(files),
        classes=tuple(classes),
        never_entered=tuple(never),
        functions=tuple(functions),
        empty_files=tuple(empty),
        imported_before=tuple(imported_before),
        html=str(html_dir / "index.html") if html_dir is not None else None,
        specs=specs,
    )
