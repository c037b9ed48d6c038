"""Ctrl-C and SIGTERM, remembered as well as raised.

Python raises ``KeyboardInterrupt`` wherever the main thread happens to be when the signal
arrives; inside a finalizer or a weakref callback (multiprocessing runs several while it
starts a queue) the exception is printed as "ignored" and lost, and a search, a minimiser or
``kvprop bugs`` went on as if nothing had been asked (seen under load: ``kvprop bugs`` ran
on past a SIGTERM sent right after its header). The handler also sets ``requested``, which
the long loops check, so that an interrupt is never lost.
"""

from __future__ import annotations

import signal
import threading

requested = threading.Event()


def handler(signum, frame) -> None:
    requested.set()
    raise KeyboardInterrupt


def install() -> None:
    """Ctrl-C and SIGTERM both interrupt, and are remembered."""
    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


def check() -> None:
    """Raise ``KeyboardInterrupt`` if an interrupt was asked for and lost."""
    if requested.is_set():
        raise KeyboardInterrupt
