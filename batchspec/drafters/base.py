"""The drafter interface the engine talks to."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..layouts.base import LayoutView
from ..sequence import Sequence

# Turns one step of drafter logits [b, vocab] into tokens [b]; `step` is the draft index within the
# round (0-based), so seeded samplers can key noise by absolute position.
Picker = Callable[[torch.Tensor, int], torch.Tensor]


def pick_argmax(logits: torch.Tensor, step: int) -> torch.Tensor:
    return logits.argmax(dim=-1)


@dataclass
class Draft:
    tokens: torch.Tensor  # [b, k]
    logits: torch.Tensor | None  # [b, k, vocab], the drafter's raw logits (rejection sampling needs q)


class Drafter(ABC):
    """Keeps whatever per-row state it needs in the same row order as the engine's rows.

    The engine drives it through this interface only: `add` rows (or build one in chunks with `stage`
    and `unstage`), `propose` drafts, `drop` finished rows, and, for engines whose rows live in a pool
    between rounds (EXSPEC), `load` the round's rows from the pool and `save` them back. A drafter
    that keeps state it can check exposes it in `views`. Stateless drafters ignore all but `propose`.
    """

    @abstractmethod
    def add(self, seqs: list[Sequence]) -> None:
        """Rows appended after the existing ones (their prompts are known, plus the first token)."""

    @abstractmethod
    def propose(self, seqs: list[Sequence], k: int, pick: Picker = pick_argmax) -> Draft:
        """k draft tokens for each row, continuing each sequence's current tokens."""

    @abstractmethod
    def drop(self, keep: list[bool]) -> list[int]:
        """Remove rows, mirroring the target layout's `drop` (same order returned)."""

    def stage(self, tokens: list[int]) -> None:
        """Chunked prefill: the next chunk of the prompt being admitted (fed to the target too)."""

    def unstage(self) -> None:
        """Chunked prefill: the staged prompt is complete and becomes the last row."""

    def discard_staged(self) -> None:
        """Chunked prefill: the staged prompt's request was aborted."""

    def load(self, rows: torch.Tensor, seqs: list[Sequence]) -> None:
        """Pool engines: make pool rows `rows` (holding `seqs`) the rows of the next `propose`."""

    def save(self, rows: torch.Tensor, seqs: list[Sequence]) -> None:
        """Pool engines: write the round's rows back to pool rows `rows` after acceptance."""

    def counters(self) -> dict[str, float]:
        """Running totals for EngineStats.extra (its layouts' counters, for a model drafter)."""
        return {}

    def views(self, seqs: list[Sequence], sample_rows: list[int]) -> list[LayoutView]:
        """What the invariant checker should verify of this drafter's state (nothing by default)."""
        return []
