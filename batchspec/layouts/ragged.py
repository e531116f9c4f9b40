"""Per-row KV cursors: no padding to keep aligned, nothing ever moves.

Row b's tokens occupy slots [0, lengths[b]) of its buffer row. A forward of n tokens writes them at
lengths[b] + arange(n), gives them positions lengths[b] + arange(n), and lets query i see slots
j <= lengths[b] + i. Committing is setting `lengths`: rejected drafts' slots lie beyond the cursor,
invisible, and are overwritten by the next round.
"""

from __future__ import annotations

import torch

from .base import Layout, right_padded


class RaggedLayout(Layout):
    def prefill(self, prompts: list[list[int]]) -> torch.Tensor:
        """Append rows: right-padded prompts written from slot 0; each real query sees only its own
        row's earlier tokens, pad queries see garbage that no real query ever attends to."""
        ids, lengths = right_padded(prompts, self.device)
        first = self.num_rows
        width = ids.shape[1]
        steps = torch.arange(width, device=self.device)
        positions = steps.expand(len(prompts), width)
        visible = (steps[None, :] <= steps[:, None]).expand(len(prompts), width, width)
        logits = self._run(
            slice(first, first + len(prompts)), ids, positions, visible, 0, (lengths - 1)[:, None]
        )
        self.lengths = torch.cat([self.lengths, lengths])
        return logits[:, 0]

    def forward(self, tokens: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        n = tokens.shape[1]
        steps = torch.arange(n, device=self.device)
        positions = self.lengths[:, None] + steps
        kv_len = int(self.lengths.max()) + n
        visible = torch.arange(kv_len, device=self.device)[None, None, :] <= positions[:, :, None]
        logits = self._run(slice(0, self.num_rows), tokens, positions, visible, self.lengths, 1 if last_only else 0)
        self.lengths = self.lengths + n
        return logits

    def commit(self, lengths: torch.Tensor) -> None:
        self.lengths = lengths.to(self.device)

    def row_slots(self, row: int) -> tuple[int, int]:
        return 0, int(self.lengths[row])

    def violations(self) -> list[str]:
        problems = []
        if self.num_rows and int(self.lengths.max()) > self.store.capacity:
            problems.append(f"a cursor is past the KV capacity ({self.store.capacity})")
        return problems
