"""Prefill: waiting requests into rows, whole prompts at admission or in chunks under a step's budget.

With a budget (the continuous scheduler's default), one prompt at a time is fed at most `budget`
tokens a step into a staging row outside every round (`Rows.stage`) and joins the rounds once
complete, so a long prompt never stalls the rows already decoding for long. How much of it is in
is the staging layout's own count (`Rows.staged`), not kept here a second time.
"""

from __future__ import annotations

from collections import deque

import torch

from .rows import Rows
from .scheduler import Scheduler
from .sequence import Sequence
from .stats import EngineStats
from .trace import NullTrace

# Prompts whose prefill completed this step, with the target's last prompt logits [b, vocab].
Started = list[tuple[list[Sequence], torch.Tensor]]


class Prefill:
    """Admits what the scheduler allows into rows and feeds their prompts (target and drafter)."""

    def __init__(self, scheduler: Scheduler, budget: int | None) -> None:
        self.scheduler = scheduler
        self.budget = budget  # prompt tokens a step may feed (None: whole prompts at admission)
        self.staging: Sequence | None = None  # the prompt being fed in chunks

    def run(self, waiting: deque[Sequence], running: int, rows: Rows, trace: NullTrace,
            stats: EngineStats) -> tuple[Started, int]:
        """Feed this step's prompt tokens, with `running` rows decoding: the prompts now complete and
        the token positions the target computed, both counted in `stats` with the time it took."""
        home, start = rows.home, rows.clock()
        fed, queries, hits = home.prefill_fed, home.prefix_queries, home.prefix_hits
        if self.budget is None:
            started = self._whole(waiting, running, rows, trace)
        else:
            started = self._chunks(waiting, running, rows, trace)
        fed = home.prefill_fed - fed
        stats.prefill_fed += fed
        stats.prefix_cache_queries += home.prefix_queries - queries
        stats.prefix_cache_hits += home.prefix_hits - hits
        stats.prefill_time += rows.clock() - start
        return started, fed

    def abort(self, request_id: int, rows: Rows) -> Sequence | None:
        """The staging prompt if it is `request_id`'s (its rows are discarded), else None."""
        if self.staging is None or self.staging.index != request_id:
            return None
        seq, self.staging = self.staging, None
        rows.discard_staged()
        return seq

    def _whole(self, waiting: deque[Sequence], running: int, rows: Rows, trace: NullTrace) -> Started:
        admitted = self.scheduler.take(waiting, running, rows.max_rows - running)
        if not admitted:
            return []
        admitted.sort(key=lambda s: len(s.prompt_ids))  # equal lengths adjacent: one forward each
        start = rows.clock()
        logits = rows.prefill(admitted)
        trace.record("prefill", rows.clock() - start, requests=[s.index for s in admitted],
                     tokens=[len(s.prompt_ids) for s in admitted], complete=True)
        return [(admitted, logits)]

    def _chunks(self, waiting: deque[Sequence], running: int, rows: Rows, trace: NullTrace) -> Started:
        """Up to `budget` prompt tokens, finishing the staging prompt before taking the next."""
        started: Started = []
        budget = self.budget or 0
        while budget > 0:
            if self.staging is None:
                busy = running + len(started)
                taken = self.scheduler.take(waiting, busy, min(1, rows.max_rows - busy))
                if not taken:
                    break
                self.staging = taken[0]
                rows.begin_stage(self.staging.prompt_ids)  # its cached prefix costs no budget
            seq = self.staging
            start = rows.clock()
            chunk = seq.prompt_ids[rows.staged : rows.staged + budget]
            logits = rows.stage(chunk)
            budget -= len(chunk)
            complete = rows.staged == len(seq.prompt_ids)
            if complete:
                rows.unstage()
                self.staging = None
                started.append(([seq], logits[None]))
            trace.record("prefill", rows.clock() - start, requests=[seq.index], tokens=[len(chunk)],
                         complete=complete)
        return started
