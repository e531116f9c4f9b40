"""What every layout provides; the engine and drafters only talk to this interface."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from ..kv import SlotStore, context_limit, forward_slots, num_layers

FILLER_TOKEN = 0  # fed in pad positions; masked out, so its value never matters (no pad token needed)


class Layout(ABC):
    """Rows of one model's KV buffer.

    Contract, shared by both layouts:
    - `lengths[b]` is how many tokens of row b have committed K/V.
    - `prefill(prompts)` appends rows and returns each new row's last-position logits.
    - `forward(tokens)` feeds n tokens to every row right after its committed tokens, returns their
      logits and tentatively extends `lengths` by n.
    - `commit(lengths)` keeps only the first `lengths[b]` tokens of each row (rejected drafts go).
    - `drop(keep)` removes rows; it returns the new row order (old indices) so callers can mirror it.
    The positions and visibility mask of the last forward are kept for the invariant checker.
    """

    def __init__(self, model: torch.nn.Module, max_rows: int, capacity: int) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.store = SlotStore(num_layers(model), max_rows, capacity)
        self.limit = context_limit(model)
        self.lengths = torch.zeros(0, dtype=torch.long, device=self.device)
        self.last_positions: torch.Tensor | None = None
        self.last_visible: torch.Tensor | None = None

    @property
    def num_rows(self) -> int:
        return int(self.lengths.shape[0])

    def _run(
        self,
        rows: slice,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        visible: torch.Tensor,
        write_start: int | torch.Tensor,
        logits_to_keep: int | torch.Tensor,
    ) -> torch.Tensor:
        if self.limit is not None:
            # Positions past the context only ever occur for draft slots whose predictions lie beyond
            # max_new_tokens (validated upstream) and are discarded; clamping keeps absolute-position
            # models from indexing out of range.
            positions = positions.clamp(max=self.limit - 1)
        self.last_positions, self.last_visible = positions, visible
        self.store.attend(rows, write_start, visible.shape[-1])
        return forward_slots(self.model, self.store, tokens, positions, visible, logits_to_keep)

    @abstractmethod
    def prefill(self, prompts: list[list[int]]) -> torch.Tensor: ...

    @abstractmethod
    def forward(self, tokens: torch.Tensor, last_only: bool = False) -> torch.Tensor: ...

    @abstractmethod
    def commit(self, lengths: torch.Tensor) -> None: ...

    @abstractmethod
    def row_slots(self, row: int) -> tuple[int, int]:
        """(first slot, count) of row's committed tokens in the store."""

    @abstractmethod
    def violations(self) -> list[str]:
        """Structural invariants of this layout that do not hold right now (empty = fine)."""

    def drop(self, keep: list[bool]) -> list[int]:
        """Remove rows whose `keep` is False by moving the last kept rows into the holes (only the
        moved rows are copied). Returns, for each new row, its old index."""
        order = swap_remove_order(keep)
        holes = [new for new, old in enumerate(order) if new != old]
        self.store.move_rows(holes, [order[h] for h in holes])
        index = torch.tensor(order, dtype=torch.long, device=self.device)
        self.lengths = self.lengths[index]
        self._reorder(index)
        return order

    def _reorder(self, index: torch.Tensor) -> None:
        """Reorder per-row state beyond `lengths` (subclasses with more state override)."""


def swap_remove_order(keep: list[bool]) -> list[int]:
    """New row order after dropping rows: kept rows stay put, except that kept rows beyond the new
    row count fill the holes left below it. The result lists old indices."""
    n = sum(keep)
    movers = iter([i for i in range(n, len(keep)) if keep[i]])
    return [i if keep[i] else next(movers) for i in range(n)]


def right_padded(prompts: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts as one right-padded [k, P] tensor, plus their lengths."""
    lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long, device=device)
    width = int(lengths.max())
    ids = torch.full((len(prompts), width), FILLER_TOKEN, dtype=torch.long, device=device)
    for b, p in enumerate(prompts):
        ids[b, : len(p)] = torch.tensor(p, dtype=torch.long)
    return ids, lengths


def left_padded(
    prompts: Sequence[Sequence[int]], device: torch.device, pad_id: int = FILLER_TOKEN
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts as one left-padded [k, P] tensor (real tokens end at the last column, as EQSPEC's
    rectangle and transformers' `generate` want them), plus its attention mask (1 = real token)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, width - len(p) :] = torch.tensor(list(p), dtype=torch.long)
        mask[b, width - len(p) :] = 1
    return ids.to(device), mask.to(device)
