"""A step trace: one JSON line per piece of work an engine step ran, with its wall time.

A row waits for every piece of the step it is in (a prefill chunk, a drafter catch-up, the round),
so the longest gap a row saw between two emissions is the longest step, and the trace says what
filled it. The engine records into the `StepTrace` it was given (`build_engine(trace=...)`) or into
`NO_TRACE`, which writes nothing; the record fields are documented in docs/cli.md.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from .draft import CatchUp


class NullTrace:
    """Records nothing: the engine's recorder when no trace was asked for."""

    enabled = False  # the engine skips building a record's fields (host copies of per-row counts)

    def begin(self, step: int) -> None:
        """Step `step` (0-based, per engine) starts now."""

    def record(self, piece: str, seconds: float, **fields: Any) -> None:
        """One piece of the current step: its kind, wall seconds and what it ran."""

    def record_round(self, requests: list[int], catch_ups: Iterable[CatchUp], seconds: float, **fields: Any) -> None:
        """A round's pieces: each drafter catch-up forward (`rows` index into `requests`), then the
        round itself."""
        for c in catch_ups:
            self.record("catch_up", c.seconds, requests=[requests[b] for b in c.rows], tokens=c.tokens,
                        shared=c.shared, complete=c.complete)
        self.record("round", seconds, requests=requests, **fields)

    def close(self) -> None:
        """Nothing more will be recorded."""

    def __enter__(self) -> NullTrace:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


NO_TRACE = NullTrace()


class StepTrace(NullTrace):
    """Writes each record as one JSON line to `path` (truncated on open), flushed at once so that a
    run that is interrupted or crashes still leaves the steps up to that point. `context` fields are
    added to every record (the bench names the method and part it is running)."""

    enabled = True

    def __init__(self, path: str | Path) -> None:
        self.file: TextIO = open(path, "w", encoding="utf-8")
        self.context: dict[str, Any] = {}
        self.step = 0
        self.started = 0.0

    def begin(self, step: int) -> None:
        self.step, self.started = step, time.time()

    def record(self, piece: str, seconds: float, **fields: Any) -> None:
        line = {**self.context, "step": self.step, "t": round(self.started, 6), "piece": piece,
                "s": round(seconds, 6), **fields}
        self.file.write(json.dumps(line) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()

    def __enter__(self) -> StepTrace:
        return self
