"""What every layout provides; the engine and drafters only talk to this interface."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..costs import wall_clock
from ..kv import SlotStore, causal_visible, context_limit, forward_slots, num_layers, use_exact_attention
from ..roles import prompt_pass

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
    - chunked prefill, for layouts with per-row cursors only: `stage(chunk)` feeds the next chunk of
      one prompt into a row outside every round, `unstage()` makes the complete prompt the last row,
      `discard_staged()` forgets it (its request was aborted).
    The positions and visibility mask of the last forward are kept for the invariant checker; the
    positions are the layout's own, before the context clamp in `_run` (which only touches queries
    whose logits are discarded), so the checker sees every query's real position.
    """

    staged = 0  # tokens in the staging row (layouts that cannot stage never have any)

    def __init__(self, model: torch.nn.Module, max_rows: int, capacity: int) -> None:
        use_exact_attention(model)  # the same attention bits as plain decoding's (`batchspec.reference`)
        self.model = model
        self.device = next(model.parameters()).device
        self.store = SlotStore(num_layers(model), max_rows, capacity)
        self.limit = context_limit(model)
        self.lengths = torch.zeros(0, dtype=torch.long, device=self.device)
        self.last_positions: torch.Tensor | None = None
        self.last_visible: torch.Tensor | None = None
        self.prefill_fed = 0  # token positions computed by prefill forwards (prompt tokens + any padding)
        # prompt tokens looked up in the prefix cache, and those whose K/V it filled (layouts using one)
        self.prefix_queries = 0
        self.prefix_hits = 0

    @property
    def num_rows(self) -> int:
        return int(self.lengths.shape[0])

    def clock(self) -> float:
        """The clock this layout's forwards are timed by (the engine's phases, a drafter's catch-ups):
        the wall clock, waiting for queued GPU work. Asked of the layout, not read directly, so that a
        layout that bills its forwards at a cost table (`batchspec.bench.replay`) is timed by that."""
        return wall_clock(self.device)

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
        """One forward over `rows`: tokens [b, n] at `positions` [b, n], written from `write_start`,
        query i of row b seeing slot kv_start + j iff visible[b, i, j]."""
        self.last_positions, self.last_visible = positions, visible
        fed = positions
        if self.limit is not None:
            # Positions past the context only ever occur for draft slots whose predictions lie beyond
            # max_new_tokens (validated upstream) and are discarded; clamping keeps absolute-position
            # models from indexing out of range.
            fed = positions.clamp(max=self.limit - 1)
        self.store.attend(rows, write_start, kv_start + visible.shape[-1], kv_start)
        return forward_slots(self.model, self.store, tokens, fed, visible, logits_to_keep)

    @abstractmethod
    def prefill(self, prompts: list[list[int]]) -> torch.Tensor:
        """Append one row per prompt, each computed at its own length (no padding is ever fed);
        returns each new row's last-position logits [k, vocab]."""

    def _prefill_runs(self, prompts: list[list[int]], first_row: int, align_to: int | None = None,
                      cached: list[int] | None = None) -> torch.Tensor:
        """Prefill prompts into rows first_row, first_row + 1, ...: each run of consecutive prompts
        of equal length (and equal `cached`) is one forward (no padding). Rows start at slot 0, or end
        at slot `align_to` (a left-padded rectangle), attending only to their own slots. `cached[i]`:
        slots [0, cached[i]) of prompt i's row already hold its first tokens' K/V (from a prefix
        cache), so only the rest is fed, at its own positions. Returns last-position logits."""
        cached = cached or [0] * len(prompts)
        logits = []
        with prompt_pass():
            for start, count in equal_runs([(len(p), c) for p, c in zip(prompts, cached)]):
                logits.append(self._prefill_run(prompts[start : start + count], cached[start], first_row + start, align_to))
        return torch.cat(logits)

    def _prefill_run(self, prompts: list[list[int]], skip: int, first_row: int, align_to: int | None) -> torch.Tensor:
        """One forward of prompts of one length, each row's first `skip` tokens cached: last-position logits."""
        size, count = len(prompts[0]), len(prompts)
        ids = torch.tensor([p[skip:] for p in prompts], dtype=torch.long, device=self.device)
        positions = torch.arange(skip, size, device=self.device).expand(count, size - skip)
        offset = 0 if align_to is None else align_to - size
        rows = slice(first_row, first_row + count)
        out = self._run(rows, ids, positions, causal_visible(positions, size), offset + skip, 1, kv_start=offset)
        self.prefill_fed += ids.numel()
        return out[:, -1]

    def begin_stage(self, prompt: list[int], reach: int | None = None) -> int:
        """Chunked prefill: start staging `prompt`; what is in already (`staged`, 0 without a cache)."""
        raise self._whole_prompts_only()

    def stage(self, tokens: list[int]) -> torch.Tensor:
        """Chunked prefill (see the contract): the chunk's last-position logits [vocab]."""
        raise self._whole_prompts_only()

    def unstage(self) -> None:
        raise self._whole_prompts_only()

    def discard_staged(self) -> None:
        raise self._whole_prompts_only()

    def _whole_prompts_only(self) -> NotImplementedError:
        """Why a layout without per-row cursors cannot stage: a row's place depends on the others'."""
        return NotImplementedError(f"{type(self).__name__} prefills whole prompts only")

    @abstractmethod
    def forward(self, tokens: torch.Tensor, last_only: bool = False) -> torch.Tensor: ...

    @abstractmethod
    def commit(self, lengths: torch.Tensor) -> None: ...

    def remember(self, row: int, ids: list[int]) -> None:
        """Row `row` holds the K/V of `ids` from slot 0: a layout with a prefix cache keeps them there
        (`RaggedLayout`); others keep nothing."""

    def counters(self) -> dict[str, float]:
        """Layout-specific running totals the engine reports in EngineStats.extra (e.g. the time a
        stateful layout spends keeping states); none by default."""
        return {}

    def row_slots(self, row: int) -> tuple[int, int]:
        """(first slot, count) of row's committed tokens in the store; with per-row cursors every row
        starts at slot 0."""
        return 0, int(self.lengths[row])

    def violations(self) -> list[str]:
        """Structural invariants of this layout that do not hold right now (empty = fine); with
        per-row cursors, that no cursor has run past the store."""
        if self.num_rows and int(self.lengths.max()) > self.store.capacity:
            return [f"a cursor is past the KV capacity ({self.store.capacity})"]
        return []

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


@dataclass
class LayoutView:
    """What the invariant checker verifies of one layout after a round.

    expected_lengths: each row's committed length (None where commits are lazy, as for drafters);
    prefixes[b]: token ids whose K/V row b must hold; sample_rows: rows whose K/V is recomputed and
    compared (a forward per row, so only a sample); prompt_lengths[b]: how many of prefixes[b] are
    row b's prompt, which a model with a prompt path computes by it (None: no such model).
    """

    name: str
    layout: Layout
    expected_lengths: list[int] | None
    prefixes: list[list[int]]
    sample_rows: list[int]
    prompt_lengths: list[int] | None = None


def swap_remove_order(keep: list[bool]) -> list[int]:
    """New row order after dropping rows: kept rows stay put, except that kept rows beyond the new
    row count fill the holes left below it. The result lists old indices."""
    n = sum(keep)
    movers = iter([i for i in range(n, len(keep)) if keep[i]])
    return [i if keep[i] else next(movers) for i in range(n)]


def equal_runs(keys: Sequence[object]) -> list[tuple[int, int]]:
    """(index of the first, count) for each maximal run of consecutive equal keys."""
    runs: list[tuple[int, int]] = []
    for i, key in enumerate(keys):
        if runs and keys[runs[-1][0]] == key:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


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
