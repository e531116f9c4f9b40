"""Online acceptance estimates (LibraSpec's per-draft acceptance): a calibration table shared by all
rows and each row's own recent history."""

from __future__ import annotations

import math

import torch

from ..sequence import Sequence

BINS = 10  # confidence bins; one more for drafts without a confidence (n-gram proposals)
NO_CONFIDENCE = BINS
SAMPLED, FORCED = 0, 1  # a draft drawn from the drafter's distribution, or proposed deterministically
# Pseudo-observations behind every prior, so a few outcomes move an estimate but a few rejections do not
# turn a row off (the replay that chose 8: docs/results/history.md, "Constants in the code").
PRIOR_WEIGHT = 8.0
ROW_PRIOR = 1.0  # ... behind a row's correction factor (1 when nothing is known): rows differ a lot
POSITION_PRIOR = 0.6  # acceptance expected of a draft before anything is known
LOOKUP_PRIOR = 0.5  # ... of a draft without a confidence
GLOBAL_DECAY = 0.998  # per round: calibration follows drift over a few hundred rounds
ROW_DECAY = 0.9  # per round of the row: its own history over the last ten or so
MAX_ACCEPTANCE = 0.999


class _RowHistory:
    """One sequence's recent drafts, per position: accepted, verified, and what the calibration
    table expected of them (for the row's correction factor). Decayed per round: the three are views
    of one tensor, so that aging is one operation."""

    def __init__(self, k_max: int) -> None:
        self.counts = torch.zeros(3, k_max, dtype=torch.float64)
        self.hits, self.trials, self.expected = self.counts.unbind()


class AcceptanceModel:
    """Online acceptance estimates: a calibration table (source x position x confidence bin) shared
    by all rows, and each row's own recent acceptance per position."""

    def __init__(self, k_max: int) -> None:
        self.k_max = k_max
        centers = (torch.arange(BINS, dtype=torch.float64) + 0.5) / BINS
        self.prior = torch.cat([centers, torch.tensor([LOOKUP_PRIOR], dtype=torch.float64)]).expand(2, k_max, -1)
        # hits and trials, each as views of one tensor, so that aging takes two operations
        self.cells = torch.zeros(2, 2, k_max, BINS + 1, dtype=torch.float64)
        self.cell_hits, self.cell_trials = self.cells.unbind()
        self.positions = torch.zeros(2, k_max, dtype=torch.float64)
        self.position_hits, self.position_trials = self.positions.unbind()
        self.rows: dict[int, _RowHistory] = {}

    def _history(self, seqs: list[Sequence]) -> list[_RowHistory]:
        out = []
        for s in seqs:
            if s.index not in self.rows:
                self.rows[s.index] = _RowHistory(self.k_max)
            out.append(self.rows[s.index])
        return out

    # The estimates before a round are computed in Python floats on the tables' lists (the same float64
    # arithmetic as tensor operations, element by element): they are asked every round, and at batch
    # 1-8 a few tensor operations on [b, k_max] cost more than the arithmetic itself.
    def _overall(self) -> tuple[list[float], list[float]]:
        """[k_max] the rate of all rows at each position, and the pseudo-trials behind it. Each
        position's prior is the rate of the position before it (the first's, POSITION_PRIOR): a
        position is judged only in rounds that drafted that far, so with a fixed prior a position
        never drafted stays at the prior, and a prior below what the drafter achieves would never be
        tested (as a replay showed: docs/results/history.md, "Constants in the code")."""
        hits, trials = self.positions.tolist()
        trials = [n + PRIOR_WEIGHT for n in trials]
        rates, prior = [], POSITION_PRIOR
        for h, n in zip(hits, trials):
            prior = (h + PRIOR_WEIGHT * prior) / n
            rates.append(prior)
        return rates, trials

    def _shrunk(self, seqs: list[Sequence], overall: list[float]) -> list[list[float]]:
        """[b][k_max] each row's own recent rate, shrunk towards `overall`."""
        counts = torch.stack([h.counts for h in self._history(seqs)]).tolist()  # [b][hits, trials, expected][k_max]
        return [[min((h + PRIOR_WEIGHT * o) / (n + PRIOR_WEIGHT), MAX_ACCEPTANCE) for h, n, o in zip(hits, trials, overall)]
                for hits, trials, _ in counts]

    def expected_rows(self, seqs: list[Sequence]) -> list[list[float]]:
        """[b][k_max] each row's acceptance probability per draft position, before drafting: its own
        recent rate, shrunk towards the rate of all rows at that position."""
        return self._shrunk(seqs, self._overall()[0])

    def optimistic(self, seqs: list[Sequence]) -> torch.Tensor:
        """[b, k_max] as `expected_rows`, with the rate of all rows raised by one standard deviation of
        what its trials tell (a Beta posterior's): high while little is known, the rate itself once
        much is. For investments whose return is learning as much as tokens (`leave_out`)."""
        overall, trials = self._overall()
        raised = [o + math.sqrt(o * (1 - o) / (n + 1)) for o, n in zip(overall, trials)]
        return torch.tensor(self._shrunk(seqs, raised), dtype=torch.float64)

    def _cells(self, position: torch.Tensor, confidence: torch.Tensor, source: torch.Tensor) -> tuple:
        bins = torch.where(torch.isnan(confidence), NO_CONFIDENCE,
                           (confidence.nan_to_num(0.0) * BINS).long().clamp(0, BINS - 1))
        return source, position, bins

    def _table(self, cells: tuple) -> torch.Tensor:
        return (self.cell_hits[cells] + PRIOR_WEIGHT * self.prior[cells]) / (self.cell_trials[cells] + PRIOR_WEIGHT)

    def calibrate(self, seqs: list[Sequence], position: int, confidence: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        """[b] acceptance probability of each row's draft at `position` given the drafter's
        confidence in it (NaN: none) and its source, corrected by how the row has fared against the
        table lately."""
        cells = self._cells(torch.full_like(source, position), confidence.double(), source)
        history = self._history(seqs)
        hits = torch.stack([h.hits.sum() for h in history])
        expected = torch.stack([h.expected.sum() for h in history])
        factor = (hits + ROW_PRIOR) / (expected + ROW_PRIOR)
        return (self._table(cells) * factor).clamp(0.0, MAX_ACCEPTANCE)

    def record(self, seqs: list[Sequence], lengths: torch.Tensor, accepted: torch.Tensor,
               confidence: torch.Tensor, source: torch.Tensor) -> None:
        """Outcomes of one round: row b verified lengths[b] drafts and accepted accepted[b]; slots after
        the first rejection were never judged and teach nothing."""
        width = confidence.shape[1]
        if width == 0:  # a plain step: nothing judged, the estimates only age
            self.age(seqs)
            return
        slots = torch.arange(width)[None, :]
        judged = (slots < lengths[:, None]) & (slots <= accepted[:, None])
        hit = (slots < accepted[:, None]).double() * judged
        position = slots.expand_as(judged)
        cells = self._cells(position, confidence.double(), source)
        expected = self._table(cells) * judged
        self.age(seqs)
        index = tuple(c[judged] for c in cells)
        self.cell_hits.index_put_(index, hit[judged], accumulate=True)
        self.cell_trials.index_put_(index, torch.ones_like(hit[judged]), accumulate=True)
        self.position_hits[:width] += hit.sum(dim=0)
        self.position_trials[:width] += judged.double().sum(dim=0)
        for history, h, j, e in zip(self._history(seqs), hit, judged.double(), expected):
            for values, new in ((history.hits, h), (history.trials, j), (history.expected, e)):
                values[:width] += new

    def age(self, seqs: list[Sequence]) -> None:
        """One round older: outcomes shared by all rows count GLOBAL_DECAY times as much, and those
        of these rows ROW_DECAY times."""
        self.cells.mul_(GLOBAL_DECAY)
        self.positions.mul_(GLOBAL_DECAY)
        for history in self._history(seqs):
            history.counts.mul_(ROW_DECAY)

    def forget(self, seqs: list[Sequence]) -> None:
        for s in seqs:
            self.rows.pop(s.index, None)
