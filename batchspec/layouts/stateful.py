"""Rows of a model with recurrent state (SSM / linear-attention layers, pure or hybrid).

For such layers the KV-cursor trick of the ragged layout does not apply: every token fed rewrites a
recurrent state and a convolution window, rejected drafts included. So the model never writes a
committed state here (`batchspec.kv.StateStore` keeps committed and working states apart), and a
commit keeps the state after exactly the accepted tokens of each row, in one of two ways:

- `snapshot` (the default): a forward of n tokens runs as n single-token steps, and after each the
  working state of every row is kept as that step's snapshot; committing j tokens of a row takes its
  j-th snapshot. Verification follows the recurrent dependency token by token, on the model's own
  single-token path (the very path plain decoding takes).
- `replay`: a forward of n tokens is one multi-token forward (the model's chunked scan); a commit
  restores the committed state of rows that rejected something and feeds their accepted tokens
  again, one forward per distinct accepted count (rows that accepted everything keep the working state).

`scripts/stateful_cost.py` measures both; docs/stateful.md records why snapshot is the default.

Attention layers of hybrid models keep per-row K/V cursors exactly as the ragged layout does
(positions lengths[b] + arange(n), query i sees slots <= lengths[b] + i): committing moves the cursor.

Prefill runs each prompt alone at its own length (pad tokens would enter the state), all but its
last token as a fresh prefill, then the last tokens of all new rows as one tentative step: a drafter
rolls back to all but the last token of the prompt on its first round, and that step is recoverable.
A row handed to a new request starts from the zero state, whatever its previous occupant left.
"""

from __future__ import annotations

import time

import torch

from ..kv import StatefulSlotStore, StateKey, causal_visible, forward_slots
from ..roles import prompt_pass
from .base import Layout


class StatefulLayout(Layout):
    """Per-row committed states plus per-row K/V cursors for attention layers (hybrids).

    `lengths[b]` counts the tokens fed to row b (as in every layout); `committed[b]` <= lengths[b]
    counts those whose state is committed. Tokens between the two are tentative until `commit`.
    `state_time` sums the seconds spent keeping states (snapshots, restores, replays, clears).
    """

    strategy = "snapshot"

    def __init__(self, model: torch.nn.Module, max_rows: int, capacity: int) -> None:
        super().__init__(model, max_rows, capacity)
        self.store = StatefulSlotStore(model, max_rows, capacity)
        self.committed = torch.zeros(0, dtype=torch.long, device=self.device)
        # replay: token t fed to row b since its last commit is pending[b, t]
        self.pending = torch.zeros((max_rows, 0), dtype=torch.long, device=self.device)
        self.state_time = 0.0
        self.replay_forwards = 0

    # ---- the Layout contract ----------------------------------------------------------------------
    def prefill(self, prompts: list[list[int]]) -> torch.Tensor:
        with prompt_pass():
            return self._prefill(prompts)

    def _prefill(self, prompts: list[list[int]]) -> torch.Tensor:
        """Each prompt but its last token fed row by row, then the rows' last tokens in one step."""
        first, count = self.num_rows, len(prompts)
        self.prefill_fed += sum(map(len, prompts))
        new = torch.tensor([len(p) - 1 for p in prompts], dtype=torch.long, device=self.device)
        self.lengths = torch.cat([self.lengths, new])
        self.committed = torch.cat([self.committed, new])
        start = time.perf_counter()
        self.store.states.clear(torch.arange(first, first + count, device=self.device))
        self.state_time += time.perf_counter() - start
        for i, prompt in enumerate(prompts):
            if len(prompt) > 1:
                row = slice(first + i, first + i + 1)
                ids = torch.tensor([prompt[:-1]], dtype=torch.long, device=self.device)
                self._feed(row, ids, torch.zeros(1, dtype=torch.long, device=self.device), fresh=True, logits_to_keep=1)
                start = time.perf_counter()
                self.store.states.accept_working(torch.tensor([first + i], device=self.device))
                self.state_time += time.perf_counter() - start
        last = torch.tensor([[p[-1]] for p in prompts], dtype=torch.long, device=self.device)
        # Rows of one-token prompts have no state yet; before any state exists, the step is a prefill.
        return self._step(slice(first, first + count), last, fresh=not self.store.states.allocated)[:, -1]

    def forward(self, tokens: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        rows = slice(0, self.num_rows)
        if self.strategy == "snapshot":
            steps = [self._step(rows, tokens[:, t : t + 1], fresh=False) for t in range(tokens.shape[1])]
            return steps[-1] if last_only else torch.cat(steps, dim=1)
        self._remember(rows, tokens)
        logits = self._feed(rows, tokens, self.lengths, fresh=False, logits_to_keep=1 if last_only else 0)
        self.lengths = self.lengths + tokens.shape[1]
        return logits

    def commit(self, lengths: torch.Tensor) -> None:
        """Keep the state after the first lengths[b] tokens of each row: anything from its committed
        length up to what it was fed."""
        lengths = lengths.to(self.device)
        keep, fed = lengths - self.committed, self.lengths - self.committed
        if bool((keep < 0).any()) or bool((keep > fed).any()):
            raise RuntimeError(
                f"cannot commit lengths {lengths.tolist()}: states are kept from {self.committed.tolist()} "
                f"to {self.lengths.tolist()} tokens only"
            )
        start = time.perf_counter()
        if self.strategy == "snapshot":
            self.store.states.keep_steps(keep)
        else:
            self._replay(keep, fed)
        self.state_time += time.perf_counter() - start
        self.committed = lengths.clone()
        self.lengths = lengths.clone()

    def counters(self) -> dict[str, float]:
        return {"state_time": self.state_time, "state_replay_forwards": self.replay_forwards}

    def violations(self) -> list[str]:
        problems = super().violations()
        if bool((self.committed > self.lengths).any()):
            problems.append("a committed state is ahead of the tokens fed")
        return problems

    def committed_state(self, row: int) -> tuple[int, dict[StateKey, torch.Tensor]]:
        """(tokens committed, their recurrent/conv states) of one row, for the invariant checker."""
        return int(self.committed[row]), self.store.states.committed(row)

    def _reorder(self, index: torch.Tensor) -> None:
        self.committed = self.committed[index]
        if self.pending.shape[1]:
            self.pending[: len(index)] = self.pending[index]

    # ---- forwards -----------------------------------------------------------------------------------
    def _feed(
        self,
        rows: slice | torch.Tensor,
        tokens: torch.Tensor,
        start: torch.Tensor,
        fresh: bool,
        logits_to_keep: int,
    ) -> torch.Tensor:
        """Feed tokens [b, n] to `rows` (a slice, or row indices for replays) right after `start[b]`
        tokens: ragged positions and masks for the attention layers, the rows' states for the rest."""
        n = tokens.shape[1]
        positions = start[:, None] + torch.arange(n, device=self.device)
        kv_len = int(start.max()) + n
        visible = causal_visible(positions, kv_len)
        if self.limit is not None:
            positions = positions.clamp(max=self.limit - 1)
        self.last_positions, self.last_visible = positions, visible
        self.store.attend(rows, start, kv_len, fresh=fresh)
        try:
            return forward_slots(self.model, self.store, tokens, positions, visible, logits_to_keep)
        finally:
            self.store.finish()

    def _step(self, rows: slice, tokens: torch.Tensor, fresh: bool) -> torch.Tensor:
        """One tentative token [b, 1] for `rows`, remembered so that a commit can keep or drop it."""
        lengths = self.lengths[rows]
        step = lengths - self.committed[rows]
        logits = self._feed(rows, tokens, lengths, fresh=fresh, logits_to_keep=1)
        start = time.perf_counter()
        if self.strategy == "snapshot":
            self.store.states.snapshot(rows, step)
        else:
            self._remember(rows, tokens)
        self.state_time += time.perf_counter() - start
        self.lengths[rows] += 1
        return logits

    # ---- replay -------------------------------------------------------------------------------------
    def _remember(self, rows: slice, tokens: torch.Tensor) -> None:
        """Write tokens [b, n] after each row's tentative tokens so far (replay strategy)."""
        offset = self.lengths[rows] - self.committed[rows]
        need = int(offset.max()) + tokens.shape[1]
        if self.pending.shape[1] < need:
            grown = self.pending.new_zeros((self.pending.shape[0], need))
            grown[:, : self.pending.shape[1]] = self.pending
            self.pending = grown
        columns = offset[:, None] + torch.arange(tokens.shape[1], device=self.device)
        self.pending[rows].scatter_(1, columns, tokens)

    def _replay(self, keep: torch.Tensor, fed: torch.Tensor) -> None:
        """Rows that kept everything fed commit their working state; the others go back to their
        committed state and are fed their kept tokens again (one forward per distinct count)."""
        states = self.store.states
        states.accept_working(((keep == fed) & (fed > 0)).nonzero().flatten())
        partial = keep < fed
        states.restore(partial.nonzero().flatten())
        for count in sorted(set(keep[partial & (keep > 0)].tolist())):
            rows = (partial & (keep == count)).nonzero().flatten()
            self._feed(rows, self.pending[rows, :count], self.committed[rows], fresh=False, logits_to_keep=1)
            states.accept_working(rows)
            self.replay_forwards += 1


class ReplayStatefulLayout(StatefulLayout):
    """The replay strategy (measured against snapshots by scripts/stateful_cost.py)."""

    strategy = "replay"
