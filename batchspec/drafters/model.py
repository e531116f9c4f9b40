"""A small language model as drafter, with its own KV cache kept in the same layout as the target's.

Never re-prefills: each round it rolls its cache back to all but the last two tokens of each
sequence, then feeds those two. That one uniform step absorbs both cases left by a round it drafted
in (the bonus token alone is new, or the last accepted draft it never fed plus the bonus) without any
per-row branching; recomputing one token's K/V costs next to nothing.

Rounds without drafts (adaptive speculation turned them down) do not involve it at all, so the
sequences run ahead of its cache. It first `skip`s such a round: its cursors fall back to committed
tokens only (drafts it fed are not the sequence's). At the next `propose`, every row that lags by
more than the usual two tokens is caught up by one extra forward that feeds each row what it has
not seen but its last two tokens (ragged per row: right-padded to the longest catch-up, the padding
slots lying beyond each row's cursor afterwards); the usual two-token step follows. So a row never
re-prefills, whatever the number of rounds without drafts, and rounds with drafts cost what they did.
"""

from __future__ import annotations

import torch

from ..layouts import Layout, LayoutView
from ..layouts.base import FILLER_TOKEN
from ..sequence import Sequence
from .base import Draft, Drafter, Picker, Steering, empty_draft, pick_argmax


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
        return self.draft(seqs, k, pick)

    def propose_steered(self, seqs: list[Sequence], k: int, pick: Picker, steer: Steering) -> Draft:
        return self.draft(seqs, k, pick, steer)

    def draft(
        self,
        seqs: list[Sequence],
        k: int,
        pick: Picker = pick_argmax,
        steer: Steering | None = None,
        forced: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> Draft:
        """Up to k drafts per row (fewer if `steer` stops it). `forced` = (tokens [b, k], lengths [b])
        replaces row b's first lengths[b] picks by those tokens, which are then what it feeds (a hybrid
        drafter's n-gram proposals): its cache always holds exactly the drafts it proposed."""
        if steer is not None and not steer.proceed(0):
            self.skip(seqs)
            return empty_draft(len(seqs), self.layout.device)
        feed = self._catch_up(seqs)
        tokens, logits, forced_slots = [], [], []
        for step in range(k):
            step_logits = self.layout.forward(feed, last_only=True)[:, -1]
            token = pick(step_logits, step)
            use = None
            if forced is not None:
                use = step < forced[1]
                token = torch.where(use, forced[0][:, step], token)
                forced_slots.append(use)
            tokens.append(token)
            logits.append(step_logits)
            if steer is not None:
                steer.observed(step, step_logits, token, use)
                if step + 1 < k and not steer.proceed(step + 1):
                    break
            feed = token[:, None]
        return Draft(torch.stack(tokens, dim=1), torch.stack(logits, dim=1),
                     forced=torch.stack(forced_slots, dim=1) if forced is not None else None)

    def _committed(self, seqs: list[Sequence]) -> torch.Tensor:
        """How many leading tokens of each row its cache surely holds at the start of a round: what it
        fed, but at most all but the last token of the sequence. Right after a round it drafted in, the
        drafts it fed beyond the accepted ones sit at or after that point (the target's token at the
        first rejection differs from the rejected draft); after a `skip`, it holds committed tokens only."""
        real = torch.tensor([s.length for s in seqs], dtype=torch.long, device=self.layout.device)
        return torch.minimum(self.layout.lengths, real - 1)

    def _catch_up(self, seqs: list[Sequence]) -> torch.Tensor:
        """Roll back to all but the last two tokens of each row, first feeding, in one ragged forward,
        what rows lagging further behind have not seen; returns the last two tokens [b, 2] to feed."""
        device = self.layout.device
        target = torch.tensor([s.length - 2 for s in seqs], dtype=torch.long, device=device)
        have = torch.minimum(self._committed(seqs), target)
        if bool((have < target).any()):
            self.layout.commit(have)
            starts, ends = have.tolist(), target.tolist()
            width = max(e - b for b, e in zip(starts, ends))
            # tail() copies only the span from b on, not the whole sequence
            rows = [s.tail(s.length - b)[: e - b] + [FILLER_TOKEN] * (width - (e - b)) for s, b, e in zip(seqs, starts, ends)]
            self.layout.forward(torch.tensor(rows, dtype=torch.long, device=device), last_only=True)
        self.layout.commit(target)
        return torch.tensor([s.tail(2) for s in seqs], dtype=torch.long, device=device)

    def skip(self, seqs: list[Sequence]) -> None:
        self.layout.commit(self._committed(seqs))

    def drop(self, keep: list[bool]) -> list[int]:
        return self._home.drop(keep)

    def load(self, rows: torch.Tensor, seqs: list[Sequence]) -> None:
        """What the pool holds of each row, at most all but its last two tokens: `propose` feeds those
        two first (and anything the row lags by before them)."""
        if self.pool is not None:
            wanted = torch.tensor([s.length - 2 for s in seqs], dtype=torch.long, device=self.layout.device)
            self.layout.load_rows(self.pool, rows, torch.minimum(self.pool.lengths[rows], wanted))

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
