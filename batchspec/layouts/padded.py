"""The paper's EQSPEC layout: one left-padded rectangle, realigned after every round.

Row b has pads[b] pad slots then lengths[b] committed tokens, pads[b] + lengths[b] == width for all
rows (invariant I1). Positions count real tokens only (I2), so the first real token has position 0.
After acceptance, rows have different lengths; `commit` re-pads on the left to the new width with
one gather over every layer's K/V (the realignment whose cost the ragged layout avoids).
"""

from __future__ import annotations

import torch

from ..kv import causal_visible
from .base import Layout


class PaddedLayout(Layout):
    def __init__(self, model: torch.nn.Module, max_rows: int, capacity: int) -> None:
        super().__init__(model, max_rows, capacity)
        self.pads = torch.zeros(0, dtype=torch.long, device=self.device)
        self.width = 0
        self.realign_count = 0

    def prefill(self, prompts: list[list[int]]) -> torch.Tensor:
        """Prefill each prompt at its own length straight into its place in the rectangle (right-
        aligned, pads left): the paper's batched left-padded prefill without computing the pads."""
        if self.num_rows:
            raise RuntimeError("the padded layout prefills whole batches only (static scheduling)")
        lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long, device=self.device)
        width = int(lengths.max())
        logits = self._prefill_runs(prompts, 0, align_to=width)
        self.pads, self.lengths, self.width = width - lengths, lengths, width
        return logits

    def _feed(self, tokens: torch.Tensor, logits_to_keep: int) -> torch.Tensor:
        """Append n tokens to every row at slots [width, width + n)."""
        n = tokens.shape[1]
        kv_len = self.width + n
        slots = torch.arange(kv_len, device=self.device)
        queries = torch.arange(self.width, kv_len, device=self.device)
        real = slots[None, :] >= self.pads[:, None]  # [b, kv_len]
        # Causal by slot (every row's queries sit at slots [width, kv_len)), real keys only.
        visible = real[:, None, :] & causal_visible(queries[None], kv_len)  # [b, n, kv_len]
        # A pad query sees only itself: never an all-masked row (NaN in sdpa), never a real key.
        visible = visible | (slots[None, None, :] == queries[None, :, None])
        positions = (queries[None, :] - self.pads[:, None]).clamp(min=0)
        logits = self._run(slice(0, self.num_rows), tokens, positions, visible, self.width, logits_to_keep)
        self.width = kv_len
        return logits

    def forward(self, tokens: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        logits = self._feed(tokens, 1 if last_only else 0)
        self.lengths = self.lengths + tokens.shape[1]
        return logits

    def commit(self, lengths: torch.Tensor) -> None:
        """Unpad, keep each row's first lengths[b] tokens, re-pad on the left to the new width."""
        lengths = lengths.to(self.device)
        width = int(lengths.max()) if self.num_rows else 0
        pads = width - lengths
        if not torch.equal(pads, self.pads):
            dest = torch.arange(width, device=self.device)
            source = (dest[None, :] - pads[:, None] + self.pads[:, None]).clamp(min=0)
            self.store.gather_slots(self.num_rows, source)
            self.realign_count += 1
        self.pads, self.lengths, self.width = pads, lengths, width

    def load_rows(self, pool: Layout, rows: torch.Tensor, lengths: torch.Tensor) -> None:
        """Become a rectangle of `pool` rows `rows` (stored from slot 0), keeping `lengths` tokens
        of each: left-pad them to a common width (no padding at all when the lengths are equal)."""
        width = int(lengths.max())
        pads = width - lengths
        source = (torch.arange(width, device=self.device)[None, :] - pads[:, None]).clamp(min=0)
        self.store.copy_rows(pool.store, rows, torch.arange(len(rows), device=self.device), source)
        self.pads, self.lengths, self.width = pads, lengths, width

    def save_rows(self, pool: Layout, rows: torch.Tensor, lengths: torch.Tensor) -> None:
        """Write the first `lengths[b]` tokens of each row back to `pool` rows `rows`, from slot 0,
        and empty this layout."""
        span = int(lengths.max())
        source = (torch.arange(span, device=self.device)[None, :] + self.pads[:, None]).clamp(max=self.width - 1)
        pool.store.copy_rows(self.store, torch.arange(len(rows), device=self.device), rows, source)
        pool.lengths[rows] = lengths
        self.pads = self.lengths = torch.zeros(0, dtype=torch.long, device=self.device)
        self.width = 0

    def _reorder(self, index: torch.Tensor) -> None:
        self.pads = self.pads[index]

    def row_slots(self, row: int) -> tuple[int, int]:
        return int(self.pads[row]), int(self.lengths[row])

    def violations(self) -> list[str]:
        problems = []
        if self.num_rows and not bool(((self.pads + self.lengths) == self.width).all()):
            problems.append(f"I1 rectangular alignment: pads + lengths != width {self.width}")
        if self.num_rows and bool((self.pads < 0).any()):
            problems.append("negative padding")
        return problems
