"""A small language model as drafter, with its own KV cache kept in the same layout as the target's.

Never re-prefills: each round it first rolls its cache back to all but the last two tokens of each
sequence, then feeds those two. That one uniform step absorbs both cases left by the previous round
(the bonus token alone is new, or the last accepted draft it never fed plus the bonus) without any
per-row branching; recomputing one token's K/V costs next to nothing.
"""

from __future__ import annotations

import torch

from ..layouts import Layout, LayoutView
from ..sequence import Sequence
from .base import Draft, Drafter, Picker, pick_argmax


class ModelDrafter(Drafter):
    """Rows live in `pool` between rounds when one is given (EXSPEC), else in `layout` itself;
    rounds always run on `layout`."""

    def __init__(self, layout: Layout, pool: Layout | None = None) -> None:
        self.layout = layout
        self.pool = pool

    @property
    def _home(self) -> Layout:
        return self.pool if self.pool is not None else self.layout

    def add(self, seqs: list[Sequence]) -> None:
        self._home.prefill([s.prompt_ids for s in seqs])

    def propose(self, seqs: list[Sequence], k: int, pick: Picker = pick_argmax) -> Draft:
        device = self.layout.device
        lengths = torch.tensor([s.length for s in seqs], dtype=torch.long, device=device)
        self.layout.commit(lengths - 2)
        feed = torch.tensor([s.tail(2) for s in seqs], dtype=torch.long, device=device)
        tokens, logits = [], []
        for step in range(k):
            step_logits = self.layout.forward(feed, last_only=True)[:, -1]
            token = pick(step_logits, step)
            tokens.append(token)
            logits.append(step_logits)
            feed = token[:, None]
        return Draft(torch.stack(tokens, dim=1), torch.stack(logits, dim=1))

    def drop(self, keep: list[bool]) -> list[int]:
        return self._home.drop(keep)

    def load(self, rows: torch.Tensor, seqs: list[Sequence]) -> None:
        """All but the last two tokens of each row: `propose` feeds those two first."""
        if self.pool is not None:
            lengths = torch.tensor([s.length - 2 for s in seqs], dtype=torch.long, device=self.layout.device)
            self.layout.load_rows(self.pool, rows, lengths)

    def save(self, rows: torch.Tensor, seqs: list[Sequence]) -> None:
        """Only K/V of accepted tokens is valid, and the drafter may have fed rejected drafts beyond
        them: keep at most all but the last two tokens (what the next `load` takes anyway)."""
        if self.pool is not None:
            valid = torch.tensor([s.length - 2 for s in seqs], dtype=torch.long, device=self.layout.device)
            self.layout.save_rows(self.pool, rows, self.layout.lengths.clamp(max=valid))

    def stage(self, tokens: list[int]) -> None:
        self._home.stage(tokens)

    def unstage(self) -> None:
        self._home.unstage()

    def discard_staged(self) -> None:
        self._home.discard_staged()

    def counters(self) -> dict[str, float]:
        return self._home.counters()

    def views(self, seqs: list[Sequence], sample_rows: list[int]) -> list[LayoutView]:
        """Its cached K/V must hold each row's tokens up to what it last fed (at most all but the
        last two, which the next round feeds again); its commits are lazy, so lengths are not pinned.
        Pooled, the rectangle it drafted in is checked for structure and positions too."""
        home = self._home
        valid = [min(int(n), s.length - 2) for n, s in zip(home.lengths.tolist(), seqs)]
        if self.pool is None:
            return [LayoutView("drafter", home, None, [s.tokens[:v] for s, v in zip(seqs, valid)], sample_rows)]
        return [LayoutView("drafter pool", home, None, [s.tokens[:v] for s, v in zip(seqs, valid)], sample_rows),
                LayoutView("drafter group", self.layout, None, [], [])]
