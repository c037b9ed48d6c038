"""The README's examples run, so the README cannot drift from what kvprop does.

Convention, for README.md:

- A fenced block tagged ``console`` is a shell session. A line starting with ``$ `` is a
  command; the lines after it, up to the next command or the block's end, are what it
  prints (stdout and stderr together). A command's exit status is 0 unless the line ends in
  a comment ``# exit N``. Every console block of the README runs in order, in one temporary
  folder (files one command writes are there for the next), with this interpreter's
  ``kvprop`` and ``pytest`` first on the PATH.
- In expected output a line that is exactly ``...`` stands for any number of lines, none
  included, and ``[...]`` inside a line for any text within that line: for what
  legitimately varies (times, rates, lines that come and go with the machine's speed, what
  the installed vLLM release reports). Trailing spaces and trailing blank lines are ignored.
- A fenced block tagged ``sh`` holds ``make`` commands only; each is checked with
  ``make -n`` (nothing runs). Every ``make TARGET`` and ``kvprop COMMAND`` quoted anywhere
  in the README must name a real target or command.
"""

from __future__ import annotations

import difflib
import os
import re
import subprocess
import sys
from pathlib import Path

import attrs
import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
ANY_LINES = "..."
ANY_TEXT = "[...]"
EXIT = re.compile(r"\s+#\s*exit\s+(\d+)\s*$")
FENCE = re.compile(r"^(\s*)```(\w*)\s*$")
MAX_LINES = 200


@attrs.frozen
class Example:
    line: int  # where the command stands in the README, 1-based
    command: str
    status: int
    expected: tuple[str, ...]


def blocks(text: str) -> list[tuple[str, int, list[str]]]:
    """(tag, line of the first content line, content lines) of every fenced block, indentation
    of the fence removed from its lines."""
    found, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, tag, start = len(opening.group(1)), opening.group(2), i + 1
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            i += 1
        found.append((tag, start + 1, [line[indent:] for line in lines[start:i]]))
        i += 1
    return found


def console_examples(text: str) -> list[Example]:
    examples = []
    for tag, first, lines in blocks(text):
        if tag != "console":
            continue
        current = None
        for n, line in enumerate(lines, first):
            if line.startswith("$ "):
                current = (n, line[2:], [])
                examples.append(current)
            elif current is None:
                raise ValueError(f"README.md:{n}: a console block starts with output, not a `$ ` command")
            else:
                current[2].append(line)
    result = []
    for n, line, expected in examples:
        status = EXIT.search(line)
        command = EXIT.sub("", line) if status else line
        result.append(Example(n, command, int(status.group(1)) if status else 0, tuple(expected)))
    return result


def make_commands(text: str) -> list[tuple[int, str]]:
    commands = []
    for tag, first, lines in blocks(text):
        if tag != "sh":
            continue
        for n, line in enumerate(lines, first):
            command = line.split("#", 1)[0].strip()
            if command:
                commands.append((n, command))
    return commands


def _trimmed(lines) -> list[str]:
    out = [line.rstrip() for line in lines]
    while out and not out[-1]:
        out.pop()
    return out


def matches(expected, actual) -> bool:
    """Whether ``actual`` lines fit ``expected`` lines, with ``...`` and ``[...]`` as wildcards."""
    pattern = "".join(
        r"(?:[^\n]*\n)*?" if line == ANY_LINES else "[^\n]*".join(map(re.escape, line.split(ANY_TEXT))) + r"\n"
        for line in _trimmed(expected)
    )
    return re.fullmatch(pattern, "".join(line + "\n" for line in _trimmed(actual))) is not None


TEXT = README.read_text(encoding="utf-8")
EXAMPLES = console_examples(TEXT)


@pytest.fixture(scope="module")
def session(tmp_path_factory) -> dict[int, tuple[int, str]]:
    """Every console command run in order in one temporary folder: line -> (status, output)."""
    folder = tmp_path_factory.mktemp("readme")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVPROP_", "PYTEST_"))}
    env |= {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}", "PYTHONUNBUFFERED": "1"}
    ran = {}
    for example in EXAMPLES:
        done = subprocess.run(
            ["bash", "-c", example.command],
            cwd=folder,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=180,
        )
        ran[example.line] = (done.returncode, done.stdout)
    return ran


@pytest.mark.parametrize("example", EXAMPLES, ids=[f"line{e.line}" for e in EXAMPLES])
def test_a_console_example_prints_what_the_readme_shows(session, example):
    status, output = session[example.line]
    diff = "\n".join(difflib.unified_diff(list(example.expected), output.splitlines(), "README", "actual", lineterm=""))
    assert (status, matches(example.expected, output.splitlines())) == (example.status, True), (
        f"README.md:{example.line}: $ {example.command}\nexit {status}\n{diff}"
    )


def test_the_readme_has_console_examples_and_stays_short():
    assert (len(EXAMPLES) > 0, len(TEXT.splitlines()) <= MAX_LINES) == (True, True)


@pytest.mark.parametrize("line,command", make_commands(TEXT))
def test_a_make_command_the_readme_shows_is_one_make_would_run(line, command):
    words = command.split()
    assert words[0] == "make", f"README.md:{line}: an sh block holds make commands only"
    done = subprocess.run(["make", "-n", *words[1:]], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, f"README.md:{line}: {command}: {done.stderr}"


def quoted(text: str, word: str) -> set[str]:
    """The names after ``word`` in the README's code: inline spans and fenced blocks."""
    code = re.findall(r"`([^`\n]+)`", text) + [line for _, _, lines in blocks(text) for line in lines]
    return {name for span in code for name in re.findall(rf"\b{word} ([a-z][a-z-]*)\b", span)}


def test_every_make_target_the_readme_names_exists():
    missing = [
        target
        for target in sorted(quoted(TEXT, "make"))
        if subprocess.run(["make", "-n", target], cwd=ROOT, capture_output=True).returncode != 0
    ]
    assert missing == []


def test_every_kvprop_command_the_readme_names_exists():
    from kvprop.front.cli import build_parser

    commands = next(a.choices for a in build_parser()._subparsers._group_actions)  # the COMMAND argument
    assert sorted(quoted(TEXT, "kvprop") - set(commands)) == []


@pytest.mark.parametrize(
    "expected,actual,fits",
    [
        (["a", "...", "d"], ["a", "b", "c", "d"], True),
        (["a", "...", "b"], ["a", "b"], True),
        (["took [...]s", "done"], ["took 2.5s", "done"], True),
        (["a", "c"], ["a", "b"], False),
        (["took [...]s"], ["took 2.5s", "extra"], False),
        (["a", "..."], ["b"], False),
    ],
)
def test_the_wildcards_match_what_they_say_and_nothing_more(expected, actual, fits):
    assert matches(expected, actual) == fits
