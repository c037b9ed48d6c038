"""Paths a command writes its output to: checked before the work that fills them, so that an
unwritable one is unusable input (exit 2) naming it, never an error of kvprop at the end of a
long run."""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path

from kvprop.errors import ConfigError


def writable_folder(path, option: str) -> Path:
    """``path`` as a folder kvprop can write into, created if missing; checked before the work
    that fills it, so that an unwritable one is unusable input (exit 2) naming it, not an error
    of kvprop at the end of a long run."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{option} {str(path)!r} is a file; give a directory")
    with unwritable_is_usage(path, option):
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".kvprop-write-check-"):
            pass
    return path


def writable_file(path, option: str, make_folder: bool = True) -> Path:
    """``path`` as a file kvprop can write: not a folder, in a folder it can write into (created
    if missing when ``make_folder``); checked before the work whose result it takes."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{option} {str(path)!r} is a directory; give a file's path")
    if not make_folder and not path.parent.is_dir():
        raise ConfigError(f"{option} {str(path)!r}: its folder does not exist")
    with unwritable_is_usage(path, option):
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=".kvprop-write-check-"):
            pass
    return path


@contextlib.contextmanager
def unwritable_is_usage(path, option: str):
    """A write to a path the user named that fails is unusable input (a ConfigError naming the
    option and the path), never an error of kvprop itself."""
    try:
        yield
    except OSError as e:
        raise ConfigError(f"{option} {str(path)!r} cannot be written: {e.strerror or e}") from None
