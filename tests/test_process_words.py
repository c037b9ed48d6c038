"""The code, tests, scripts, configuration, the README and every document under docs/ speak of
the project itself, never of how it was built: no stop numbers, sessions, issue history or
paths of a particular machine."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHECKED = (
    "kvprop",
    "tests",
    "scripts",
    "bench",
    "examples",
    "findings",
    ".ci",
    "Makefile",
    "setup.cfg",
    "pyproject.toml",
)
CHECKED += ("constraints.txt", "conftest.py", "README.md", "docs")
WORDS = re.compile(
    r"\bstop[ -]\d+\b|\bthis session\b|\bthe speed issue\b|\bsubmitted code\b|\bthis machine\b|/work/|/opt/wheels",
    re.IGNORECASE,
)
THIS_FILE = Path(__file__).relative_to(ROOT).as_posix()


def test_no_tracked_file_speaks_of_how_the_project_was_built():
    tracked = subprocess.run(["git", "ls-files", *CHECKED], cwd=ROOT, capture_output=True, text=True, check=True)
    found = [
        f"{path}:{n}: {line.strip()[:80]}"
        for path in tracked.stdout.split()
        if path != THIS_FILE and (ROOT / path).is_file()
        for n, line in enumerate((ROOT / path).read_text(encoding="utf-8", errors="replace").splitlines(), 1)
        if WORDS.search(line)
    ]
    assert found == []
