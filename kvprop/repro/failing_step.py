"""The pool and the block tables around a find's failing operation, for ``REPORT.md``'s picture.

While a trace is replayed for a report, the state after each operation is kept (the last
one is "before" the failing operation), and the state at the find is taken as the find is
raised, before anything else runs; the blocks the violation names are the ones marked.
"""

from __future__ import annotations

from kvprop.errors import Violation
from kvprop.repro.picture import Snapshot, snapshot, svg


class FailingStep:
    """Wraps a harness's ``apply`` and ``drain`` to see the find as it is raised."""

    def __init__(self, harness) -> None:
        self.engine = harness.engine
        self.before: Snapshot = snapshot(self.engine, "before the first operation")
        self.after: Snapshot | None = None
        self.blocks: set[int] = set()
        self.why_not: str | None = None
        harness.apply = self._noting(harness.apply)
        harness.drain = self._noting(harness.drain)

    def _noting(self, fn):
        def call(*args):
            try:
                return fn(*args)
            except Violation as e:
                self.blocks = set(e.blocks or ())
                self._take_after()
                raise
            except Exception:
                self._take_after()
                raise

        return call

    def _take_after(self) -> None:
        try:
            self.after = snapshot(self.engine, "at the find")
        except Exception as e:  # the target's state cannot be read back: said in the report
            self.why_not = f"the pool could not be read at the find ({type(e).__name__}: {e})"

    def passed(self, index: int, op) -> None:
        """Operation ``index`` passed: its state is the one before the next."""
        name = op if isinstance(op, str) else type(op).__name__
        self.before = snapshot(self.engine, f"after operation {index} ({name})")

    def picture(self, title: str) -> str | None:
        """The SVG of before and at the find, or None (``why_not`` says why)."""
        if self.after is None:
            self.why_not = self.why_not or "the find was raised outside an operation"
            return None
        return svg(self.before, self.after, self.blocks, title)
