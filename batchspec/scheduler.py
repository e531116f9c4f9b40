"""Scheduling policies: which waiting requests get rows, and which rows run the next round.

A policy sees only sequences and row counts, never caches: the engine asks it how many requests to
admit (`take`) and which rows to run (`select`), and does the rest.

- static: whole batches; the next batch is admitted once the previous one has fully finished.
- continuous: a finished row is refilled at once (prefilling only the new row) while the others
  keep decoding.
- pool (EXSPEC): rows live in a pool (a sliding window of sequences, each with its own K/V); each
  round runs a same-length group of `batch_size` rows when the window has one (stacked with no
  padding), else the least recently run rows (realigned); the window refills as rows finish,
  `batch_size` new rows per step so the first requests start decoding before the whole window is in.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import defaultdict, deque

from .config import SpecConfig
from .sequence import Sequence


class Scheduler(ABC):
    """A policy. `pooled` policies keep rows in a pool and run rounds on groups of them."""

    pooled = False

    def __init__(self, spec: SpecConfig) -> None:
        self.batch_size = spec.batch_size

    @abstractmethod
    def take(self, waiting: deque[Sequence], running: int, free_rows: int) -> list[Sequence]:
        """Pop the requests to admit now (`running` rows are busy, `free_rows` are free)."""

    def select(self, running: list[Sequence], round_index: int) -> list[int]:
        """Indices into `running` of the rows the next round runs: every row, unless pooled."""
        return list(range(len(running)))

    def counters(self) -> dict[str, float]:
        """Policy-specific counters for EngineStats.extra."""
        return {}


class StaticScheduler(Scheduler):
    def take(self, waiting: deque[Sequence], running: int, free_rows: int) -> list[Sequence]:
        if running:
            return []
        return [waiting.popleft() for _ in range(min(free_rows, len(waiting)))]


class ContinuousScheduler(Scheduler):
    def take(self, waiting: deque[Sequence], running: int, free_rows: int) -> list[Sequence]:
        return [waiting.popleft() for _ in range(min(free_rows, len(waiting)))]


class PoolScheduler(Scheduler):
    """EXSPEC's cross-batch scheduling over a window of `window_size` pooled rows."""

    pooled = True

    def __init__(self, spec: SpecConfig) -> None:
        super().__init__(spec)
        self.window_size = spec.window_size or 4 * spec.batch_size
        self.sort_by_length = spec.sort_by_length
        self.last_run: dict[int, int] = {}
        self.grouped_rounds = 0
        self.fallback_rounds = 0

    def take(self, waiting: deque[Sequence], running: int, free_rows: int) -> list[Sequence]:
        count = min(free_rows, len(waiting), self.batch_size)
        if not self.sort_by_length:
            return [waiting.popleft() for _ in range(count)]
        chosen = sorted(waiting, key=lambda s: len(s.prompt_ids))[:count]
        for s in chosen:
            waiting.remove(s)
        return chosen

    def select(self, running: list[Sequence], round_index: int) -> list[int]:
        """A same-length group if the window has one (the one whose rows waited longest), else the
        least recently run rows."""
        by_length: dict[int, list[int]] = defaultdict(list)
        for r, s in enumerate(running):
            by_length[s.length].append(r)
        want = min(self.batch_size, len(running))
        waited = lambda r: self.last_run.get(running[r].index, -1)  # noqa: E731
        full = [rows for rows in by_length.values() if len(rows) >= want]
        if full:
            self.grouped_rounds += 1
            group = sorted(min(full, key=lambda rows: min(map(waited, rows))), key=waited)[:want]
        else:
            self.fallback_rounds += 1
            group = sorted(range(len(running)), key=waited)[:want]
        for r in group:
            self.last_run[running[r].index] = round_index
        # Only the window's rows are remembered: a long-running server would otherwise keep one entry
        # per request it ever served.
        self.last_run = {s.index: self.last_run[s.index] for s in running if s.index in self.last_run}
        return group

    def counters(self) -> dict[str, float]:
        return {"grouped_rounds": self.grouped_rounds, "fallback_rounds": self.fallback_rounds}


SCHEDULER_CLASSES: dict[str, type[Scheduler]] = {
    "static": StaticScheduler,
    "continuous": ContinuousScheduler,
    "pool": PoolScheduler,
}


def make_scheduler(spec: SpecConfig) -> Scheduler:
    return SCHEDULER_CLASSES[spec.scheduler](spec)
