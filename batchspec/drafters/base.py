"""The drafter interface the engine talks to."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

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
    """Keeps whatever per-row state it needs in the same row order as the engine's active rows."""

    @abstractmethod
    def add(self, seqs: list[Sequence]) -> None:
        """Rows appended after the existing ones (their prompts are known, plus the first token)."""

    @abstractmethod
    def propose(self, seqs: list[Sequence], k: int, pick: Picker = pick_argmax) -> Draft:
        """k draft tokens for each row, continuing each sequence's current tokens."""

    @abstractmethod
    def drop(self, keep: list[bool]) -> list[int]:
        """Remove rows, mirroring the target layout's `drop` (same order returned)."""
