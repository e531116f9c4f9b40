"""EXSPEC, the paper's cross-batch scheduling: a pool of sequences, same-length groups first.

Every admitted sequence keeps its own K/V in a pool (one row per sequence, stored from slot 0, for
target and drafter), inside a sliding window of W >= B sequences. Each round takes B rows of the
window: a group of equal committed length when one exists (stacked with no padding at all), else
the B least recently run rows, left-padded into a rectangle (the fallback realignment). The round
runs on that rectangle exactly as in EQSPEC, then each row's kept tokens go back to its pool row.
Finished rows leave the window at once and waiting prompts refill it.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Iterator

import torch

from .drafters import Drafter, ModelDrafter
from .engine import Engine
from .layouts import Layout, LayoutView, PaddedLayout, RaggedLayout
from .sequence import Sequence


class ExspecEngine(Engine):
    """Engine whose rounds run on groups chosen from a pool (`--method exspec`)."""

    def _setup(self, requests: int, capacity: int) -> None:
        wanted = min(self.spec.window_size or 4 * self.spec.batch_size, requests)
        self.window_size = self._rows_within_budget(wanted, capacity)
        self.group_size = min(self.spec.batch_size, self.window_size)
        self.pool = RaggedLayout(self.target, self.window_size, capacity)
        self.target_layout = PaddedLayout(self.target, self.group_size, capacity)
        self.drafter = self.custom_drafter
        if self.draft_model is not None:
            self.drafter = ModelDrafter(
                PaddedLayout(self.draft_model, self.group_size, capacity),
                pool=RaggedLayout(self.draft_model, self.window_size, capacity),
            )
        self.stats.extra.update(grouped_rounds=0, fallback_rounds=0)

    def _loop(self, seqs: list[Sequence]) -> Iterator[Sequence]:
        order = sorted(seqs, key=lambda s: len(s.prompt_ids)) if self.spec.sort_by_length else seqs
        waiting = deque(order)
        window: list[Sequence] = []  # window[r] lives in pool row r
        self._last_run: dict[int, int] = {}
        while waiting or window:
            new = [waiting.popleft() for _ in range(min(self.window_size - len(window), len(waiting)))]
            if new:
                self._admit(new, self.pool, self.drafter)
                window.extend(new)
            yield from self._retire(window)
            if not window:
                continue
            rows = self._select(window)
            self._group_rows = torch.tensor(rows, dtype=torch.long, device=self.pool.device)
            self._window = window
            group = [window[r] for r in rows]
            self._load(group)
            self._round(group)
            for s in group:
                self._last_run[s.index] = self.stats.rounds
            yield from self._retire(window)

    def _select(self, window: list[Sequence]) -> list[int]:
        """Pool rows for the next round: a same-length group if the window has one (the one whose
        rows waited longest), else the least recently run rows."""
        by_length: dict[int, list[int]] = defaultdict(list)
        for r, s in enumerate(window):
            by_length[s.length].append(r)
        want = min(self.group_size, len(window))
        waited = lambda r: self._last_run.get(window[r].index, -1)  # noqa: E731
        full = [rows for rows in by_length.values() if len(rows) >= want]
        if full:
            self.stats.extra["grouped_rounds"] += 1
            best = min(full, key=lambda rows: min(map(waited, rows)))
            return sorted(best, key=waited)[:want]
        self.stats.extra["fallback_rounds"] += 1
        return sorted(range(len(window)), key=waited)[:want]

    def _load(self, group: list[Sequence]) -> None:
        """Stack the group's pool rows into the working rectangles (target: all tokens but the
        last, which it is fed first; the drafter takes its own share)."""
        lengths = torch.tensor([s.length - 1 for s in group], dtype=torch.long, device=self.pool.device)
        self.target_layout.load_rows(self.pool, self._group_rows, lengths)
        if self.drafter is not None:
            self.drafter.load(self._group_rows, group)

    def _commit(self, active: list[Sequence]) -> None:
        """Write the kept tokens straight back to the pool: no realignment inside the rectangle,
        which is rebuilt for whichever group runs next."""
        lengths = torch.tensor([s.length - 1 for s in active], dtype=torch.long, device=self.pool.device)
        self.target_layout.save_rows(self.pool, self._group_rows, lengths)
        if self.drafter is not None:
            self.drafter.save(self._group_rows, active)

    def _row_holders(self) -> list[Layout | Drafter]:
        """Per-row state outlives a round only in the pools (the rectangles are rebuilt each round)."""
        return [self.pool] + ([self.drafter] if self.drafter is not None else [])

    def _views(self, active: list[Sequence]) -> list[LayoutView]:
        """The pools after the group's tokens went back, checked on the group's rows."""
        window, rows = self._window, self._group_rows.tolist()
        target = LayoutView("target pool", self.pool, [s.length - 1 for s in window],
                            [s.tokens[:-1] for s in window], rows)
        return [target] + (self.drafter.views(window, rows) if self.drafter is not None else [])
