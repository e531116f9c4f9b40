"""Deliberately wrong batched speculative decoding: one published failure mode per method.

These exist only so that the audit (`batchspec audit`) can be shown to catch what the paper's
forensic table reports about published code; never use them for output. Each is the correct
engine with exactly one thing broken:

- `naive-kv`: rejected drafts' K/V stay in the cache (for target and drafter). `commit` keeps every
  fed token, so later tokens attend to rejected drafts and their positions count them too (BSP's
  "rejected tokens' KV kept; position ids desynchronised").
- `naive-positions`: position ids come from one counter shared by the whole batch and advanced by
  every token fed, instead of each row's committed length (rows drift apart as soon as a draft is
  rejected or rows have different prompt lengths).
- `naive-bonus`: at the first rejected draft the row emits the drafter's token instead of the
  target's correction (DSD's "bonus sampled from the draft").
- `naive-state` (targets with recurrent state only): a rollback as transformers' own `crop` does it
  (issue #49036): the attention K/V cursors and the convolution windows go back to the accepted
  length, the recurrent state does not: it keeps every fed token, rejected drafts included.

The method registry (`batchspec.methods`) names these classes; this module is imported only when
one of these methods is built.
"""

from __future__ import annotations

import torch

from ..draft import Draft
from ..engine import Engine
from ..kv import SlotStore
from ..layouts.ragged import RaggedLayout
from ..layouts.stateful import StatefulLayout
from ..sequence import Sequence


def _grown(store: SlotStore, capacity: int) -> SlotStore:
    """A copy of `store` with room for `capacity` slots per row (same rows, same K/V)."""
    grown = SlotStore(store.num_layers, store.max_rows, capacity)
    if store.data is not None:
        shape = list(store.data.shape)
        shape[4] = capacity
        grown.data = store.data.new_zeros(shape)
        grown.data[:, :, :, :, : store.capacity] = store.data
    return grown


class KeptRejectedKVLayout(RaggedLayout):
    """`naive-kv`: committing never drops anything, so rejected drafts stay visible forever."""

    def forward(self, tokens: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        # Each round keeps all k+1 fed tokens while the sequence grows by fewer, so the cache outgrows
        # the capacity the engine sized for correct commits: grow it (doubling) instead of failing.
        needed = int(self.lengths.max()) + tokens.shape[1]
        if needed > self.store.capacity:
            self.store = _grown(self.store, max(needed, 2 * self.store.capacity))
        return super().forward(tokens, last_only)

    def commit(self, lengths: torch.Tensor) -> None:
        """The bug: keep every fed token's K/V (the cursor stays after the rejected drafts)."""


class SharedPositionLayout(RaggedLayout):
    """`naive-positions`: K/V slots and masks are per row and correct, position ids are not."""

    def __init__(self, model: torch.nn.Module, max_rows: int, capacity: int) -> None:
        super().__init__(model, max_rows, capacity)
        self.counter = 0
        self._prefilling = False

    def prefill(self, prompts: list[list[int]]) -> torch.Tensor:
        """Correct positions for the prompts; the shared counter then starts after the longest."""
        if not self.num_rows:  # a new batch restarts the shared counter
            self.counter = 0
        self._prefilling = True
        try:
            logits = super().prefill(prompts)
        finally:
            self._prefilling = False
        self.counter += max(len(p) for p in prompts)
        return logits

    def _run(
        self,
        rows: slice,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        visible: torch.Tensor,
        write_start: int | torch.Tensor,
        logits_to_keep: int | torch.Tensor,
        kv_start: int = 0,
    ) -> torch.Tensor:
        # The bug: every row gets the same positions, counter + arange(n), and the counter advances by
        # every fed token, rejected or not.
        if not self._prefilling:
            n = tokens.shape[1]
            positions = (self.counter + torch.arange(n, device=self.device)).expand_as(positions)
            self.counter += n
        return super()._run(rows, tokens, positions, visible, write_start, logits_to_keep, kv_start)


class DrafterBonusEngine(Engine):
    """`naive-bonus`: greedy acceptance, but the token after the accepted drafts is the drafter's."""

    def _accept(
        self, draft: Draft, logits: torch.Tensor, seqs: list[Sequence]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, count = super()._accept(draft, logits, seqs)
        # The bug: where a row rejects draft j, it emits draft j itself instead of the target's token.
        # After k acceptances the drafter has proposed nothing further, so that bonus stays the target's.
        k = draft.tokens.shape[1]
        return torch.cat([draft.tokens, tokens[:, k:]], dim=1), count


class NaiveStateLayout(StatefulLayout):
    """`naive-state`: commits roll back K/V cursors and convolution windows, not recurrent states."""

    def commit(self, lengths: torch.Tensor) -> None:
        # The bug: the recurrent state after every fed token (rejected drafts included) survives the commit.
        fed = self.store.states.working("recurrent")
        super().commit(lengths)
        self.store.states.overwrite(fed)
