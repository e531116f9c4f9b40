"""Per-row KV cursors: no padding to keep aligned, nothing ever moves.

Row b's tokens occupy slots [0, lengths[b]) of its buffer row. A forward of n tokens writes them at
lengths[b] + arange(n), gives them positions lengths[b] + arange(n), and lets query i see slots
j <= lengths[b] + i. Committing is setting `lengths`: rejected drafts' slots lie beyond the cursor,
invisible, and are overwritten by the next round.

With a prefix cache (`use_prefix_cache`), a new row's first slots are filled from it and only the
rest of its prompt is fed, which is exact because a row's slots start at 0 whatever else is in the
batch: the K/V of its first n tokens sits at slots [0, n) at positions 0..n-1 however it got there
(docs/methods.md, "Prefix cache").
"""

from __future__ import annotations

import torch

from ..kv import PrefixCache, causal_visible
from ..roles import prompt_pass
from .base import Layout


class RaggedLayout(Layout):
    """Rows [0, num_rows) take part in rounds. A prompt prefilled in chunks (`stage`) is built in
    row num_rows, outside every round, and joins as the last row when complete (`unstage`)."""

    def __init__(self, model: torch.nn.Module, max_rows: int, capacity: int) -> None:
        super().__init__(model, max_rows, capacity)
        self.prefix: PrefixCache | None = None
        self.space = ""  # this model's name in the prefix cache
        self._staging: list[int] = []  # the prompt `begin_stage` started; its first `staged` tokens are in

    def use_prefix_cache(self, cache: PrefixCache, space: str) -> None:
        """Fill new rows from `cache` (under this model's `space`) and keep their prompts in it."""
        self.prefix, self.space = cache, space

    def _reuse(self, row: int, ids: list[int], limit: int) -> int:
        """Fill row `row` from the prefix cache with the K/V of the longest cached prefix of `ids`, at
        most `limit` tokens; returns how many (0 without a cache)."""
        if self.prefix is None:
            return 0
        hit = self.prefix.fill(self.space, ids, self.store, row, limit)
        self.prefix_queries += len(ids)
        self.prefix_hits += hit
        return hit

    def remember(self, row: int, ids: list[int]) -> None:
        if self.prefix is not None:
            self.prefix.insert(self.space, ids, self.store, row)

    def prefill(self, prompts: list[list[int]]) -> torch.Tensor:
        """Append rows, each prompt written from slot 0 at its own length; a prompt's cached prefix
        is filled, not fed, but never its last token, whose logits are returned."""
        first = self.num_rows
        cached = [self._reuse(first + i, p, len(p) - 1) for i, p in enumerate(prompts)]
        logits = self._prefill_runs(prompts, first, cached=cached)
        for i, p in enumerate(prompts):
            self.remember(first + i, p)
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
        length) and commit them. An empty row (a lazy drafter's) is filled from the prefix cache as far
        as it holds `tokens` (no logits are wanted) and keeps them in it."""
        start = int(self.lengths[row])
        cached = self._reuse(row, tokens, len(tokens)) if start == 0 else 0
        if cached < len(tokens):
            self._feed_one(row, start + cached, tokens[cached:])
        if start == 0:
            self.remember(row, tokens)
        self.lengths = self.lengths.clone()
        self.lengths[row] = start + len(tokens)

    def begin_stage(self, prompt: list[int], reach: int | None = None) -> int:
        """The staging row starts with the prompt's cached prefix, all but its last token at most, or
        exactly `reach` tokens (a drafter mirroring the target's staging row: what its own cache lacks
        of them is fed now). Returns `staged`."""
        limit = len(prompt) - 1 if reach is None else reach
        cached = self._reuse(self.num_rows, prompt, limit)
        self.staged, self._staging = cached, prompt
        if reach is not None and cached < reach:
            self.stage(prompt[cached:reach])
        return self.staged

    def stage(self, tokens: list[int]) -> torch.Tensor:
        """The chunk goes into the staging row, row num_rows, after the chunks before it."""
        with prompt_pass():
            logits = self._feed_one(self.num_rows, self.staged, tokens)
        self.staged += len(tokens)
        self.prefill_fed += len(tokens)
        return logits

    def unstage(self) -> None:
        """The staging row already sits where the last row goes: only its cursor is new (and its
        prompt goes into the prefix cache)."""
        self.remember(self.num_rows, self._staging[: self.staged])
        self._append([self.staged])
        self.discard_staged()

    def discard_staged(self) -> None:
        """Only the counter goes: the staging row's slots lie past every cursor, so the next stage or
        row overwrites them."""
        self.staged = 0
        self._staging = []

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
