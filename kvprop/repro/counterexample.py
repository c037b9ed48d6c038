"""A counterexample on disk: the trace as found, then minimised, and its regression test.

Names carry a digest of what was found (allocator, configuration, operations), so two
different finds never share a file, and a file is never overwritten by a different
counterexample: a name that is taken by other content gets a numbered suffix.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

from kvprop.errors import ConfigError
from kvprop.repro import regress
from kvprop.search import trace as tr
from kvprop.search.trace import Trace


def check_out(out: Path) -> Path:
    """``out`` is a directory kvprop can write into (created if missing); checked before a search,
    so a find is never lost to an unwritable folder."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {str(out)!r} exists and is not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".kvprop-write-check-"):
            pass
    except OSError as e:
        raise ConfigError(f"--out {str(out)!r} is not a writable directory ({e.strerror})") from None
    return out


def name_for(trace: Trace) -> str:
    """``<kind>_<driver>_seed<seed>_<digest>``: the digest names the allocator, configuration and operations."""
    identity = json.dumps(
        {k: v for k, v in tr.to_dict(trace).items() if k in ("variant", "target", "config", "steps", "drain")},
        sort_keys=True,
    )
    digest = hashlib.blake2b(identity.encode(), digest_size=4).hexdigest()
    kind = trace.failure.kind if trace.failure else "trace"
    return re.sub(r"\W+", "_", f"{kind}_{trace.driver}_seed{trace.seed}_{digest}", flags=re.ASCII).strip("_").lower()


def _write_new(path: Path, text: str) -> Path:
    """Write ``text`` at ``path``, or at ``path`` with a numbered suffix if ``path`` holds something else."""
    candidate, n = path, 1
    while candidate.exists() and candidate.read_text(encoding="utf-8", errors="replace") != text:
        n += 1
        candidate = path.with_name(f"{path.stem}_{n}{path.suffix}")
    tmp = candidate.with_name(f".{candidate.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, candidate)  # never a half-written counterexample
    return candidate


def write_found(trace: Trace, out: Path, name: str) -> Path:
    """The trace exactly as the search found it (before minimising)."""
    return _write_new(Path(out) / f"{name}.found.json", json.dumps(tr.to_dict(trace), indent=1) + "\n")


def keep_log(log: Path, out: Path, name: str) -> Path:
    """The target's output in a find's run, moved beside the find as ``<name>.log`` (a numbered
    name if that one is taken); where it was, if it cannot be moved."""
    target, n = Path(out) / f"{name}.log", 1
    while target.exists():
        n += 1
        target = Path(out) / f"{name}_{n}.log"
    try:
        shutil.move(str(log), target)
    except OSError:
        return log
    return target


def write(trace: Trace, out: Path, name: str | None = None) -> tuple[Path, Path]:
    """The (minimised) trace file and its generated regression test."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    name = name or name_for(trace)
    trace_path = _write_new(out / f"{name}.json", json.dumps(tr.to_dict(trace), indent=1) + "\n")
    test_path = _write_new(out / f"test_{name}.py", regress.render(trace, source=trace_path.name))
    return trace_path, test_path
