"""Per-row KV cursors: no padding to keep aligned, nothing ever moves.

Row b's tokens occupy slots [0, lengths[b]) of its buffer row. A forward of n tokens writes them at
lengths[b] + arange(n), gives them positions lengths[b] + arange(n), and lets query i see slots
j <= lengths[b] + i. Committing is setting `lengths`: rejected drafts' slots lie beyond the cursor,
invisible, and are overwritten by the next round.
"""

from __future__ import annotations

import torch

from ..kv import causal_visible
from .base import Layout


class RaggedLayout(Layout):
    """Rows [0, num_rows) take part in rounds. A prompt prefilled in chunks (`stage`) is built in
    row num_rows, outside every round, and joins as the last row when complete (`unstage`)."""

    def prefill(self, prompts: list[list[int]]) -> torch.Tensor:
        """Append rows, each prompt written from slot 0 at its own length."""
        logits = self._prefill_runs(prompts, self.num_rows)
        self._append([len(p) for p in prompts])
        return logits

    def add_empty(self, count: int) -> None:
        """Append rows holding nothing yet (a drafter that prefills them only once it drafts for them)."""
        self._append([0] * count)

    def _append(self, lengths: list[int]) -> None:
        """Rows num_rows, num_rows + 1, ... join the rounds holding `lengths` tokens from slot 0."""
        self.lengths = torch.cat([self.lengths, torch.tensor(lengths, dtype=torch.long, device=self.device)])

    def _feed_one(self, row: int, start: int, tokens: list[int]) -> torch.Tensor:
        """One forward of `tokens` into buffer row `row` from slot `start`, no other row computing
        anything; the last position's logits [vocab]."""
        positions = (start + torch.arange(len(tokens), device=self.device))[None]
        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
        visible = causal_visible(positions, start + len(tokens))
        return self._run(slice(row, row + 1), ids, positions, visible, start, 1)[0, -1]

    def feed_row(self, row: int, tokens: list[int]) -> None:
        """Feed tokens to one row right after its committed ones (a prefill of what it lacks, at its own
        length) and commit them."""
        start = int(self.lengths[row])
        self._feed_one(row, start, tokens)
        self.lengths = self.lengths.clone()
        self.lengths[row] = start + len(tokens)

    def stage(self, tokens: list[int]) -> torch.Tensor:
        """The chunk goes into the staging row, row num_rows, after the chunks before it."""
        logits = self._feed_one(self.num_rows, self.staged, tokens)
        self.staged += len(tokens)
        self.prefill_fed += len(tokens)
        return logits

    def unstage(self) -> None:
        """The staging row already sits where the last row goes: only its cursor is new."""
        self._append([self.staged])
        self.staged = 0

    def discard_staged(self) -> None:
        """Only the counter goes: the staging row's slots lie past every cursor, so the next stage or
        row overwrites them."""
        self.staged = 0

    def drop(self, keep: list[bool]) -> list[int]:
        """Drop rows; a prompt being staged follows the last row down (one row copy, only when rows
        were dropped while it was being prefilled)."""
        before = self.num_rows
        order = super().drop(keep)
        if self.staged and self.num_rows != before:
            self.store.move_rows([self.num_rows], [before])
        return order

    def forward(self, tokens: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        n = tokens.shape[1]
        steps = torch.arange(n, device=self.device)
        positions = self.lengths[:, None] + steps
        kv_len = int(self.lengths.max()) + n
        visible = causal_visible(positions, kv_len)
        logits = self._run(slice(0, self.num_rows), tokens, positions, visible, self.lengths, 1 if last_only else 0)
        self.lengths = self.lengths + n
        return logits

    def commit(self, lengths: torch.Tensor) -> None:
        self.lengths = lengths.to(self.device)
