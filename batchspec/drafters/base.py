"""The drafter interface the engine talks to."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from ..layouts.base import LayoutView, swap_remove_order
from ..sequence import Sequence

# A drafter that lags behind rows catches them up before drafting: lags up to this many tokens in one
# forward shared by all rows, longer ones in a forward of each row's own (a prefill, in effect).
SHARED_CATCH_UP = 32

# Turns one step of drafter logits [b, vocab] into tokens [b]; `step` is the draft index within the
# round (0-based), so seeded samplers can key noise by absolute position.
Picker = Callable[[torch.Tensor, int], torch.Tensor]


def pick_argmax(logits: torch.Tensor, step: int) -> torch.Tensor:
    return logits.argmax(dim=-1)


@dataclass
class Draft:
    """Drafts for a round. Row b proposes tokens[b, :lengths[b]]; the rest of its row is padding that
    the target is fed (the round's forward is rectangular) but that acceptance never takes.

    forced[b, j] marks slots whose token was not drawn from `logits` (an n-gram proposal in a hybrid
    draft): rejection sampling treats their q as a point mass. Without `logits`, every slot is one.

    confidence[b, j] in [0, 1] is how sure a drafter without logits is of a slot (prompt lookup: how
    long a suffix matched); adaptive speculation calibrates it into an acceptance probability as it
    does a model drafter's own probabilities.
    """

    tokens: torch.Tensor  # [b, k]
    logits: torch.Tensor | None  # [b, k, vocab], the drafter's raw logits (rejection sampling needs q)
    lengths: torch.Tensor | None = None  # [b]; None: every row proposes all k
    forced: torch.Tensor | None = None  # [b, k] bool; None: no slot is forced
    confidence: torch.Tensor | None = None  # [b, k] float; None: only `logits` say

    @property
    def width(self) -> int:
        return int(self.tokens.shape[1])

    def row_lengths(self) -> torch.Tensor:
        """Drafts each row proposes [b]."""
        if self.lengths is not None:
            return self.lengths
        return torch.full((self.tokens.shape[0],), self.width, dtype=torch.long, device=self.tokens.device)

    def capped(self, caps: torch.Tensor) -> Draft:
        """At most caps[b] drafts for row b, and no column beyond the longest row (the verify forward
        feeds the longest row's drafts and nothing more)."""
        lengths = torch.minimum(self.row_lengths(), caps.to(self.tokens.device))
        width = int(lengths.max()) if lengths.numel() else 0
        return Draft(
            self.tokens[:, :width],
            None if self.logits is None else self.logits[:, :width],
            None if bool((lengths == width).all()) else lengths,
            None if self.forced is None else self.forced[:, :width],
            None if self.confidence is None else self.confidence[:, :width],
        )


def empty_draft(rows: int, device: torch.device) -> Draft:
    """No drafts at all: the round is a plain decoding step."""
    return Draft(torch.zeros((rows, 0), dtype=torch.long, device=device), None)


class Steering(Protocol):
    """Decides, while a drafter drafts, whether another drafting step is worth its cost.

    A drafter that supports it calls `proceed(step)` before computing draft `step` (0-based; False:
    stop here, `step` drafts are all this round gets) and `observed(step, logits, tokens, forced)`
    once it has drafted it: the drafter's logits [b, vocab] at that step, the drafted tokens [b] and
    which of them were forced [b] (None: none).
    """

    def proceed(self, step: int) -> bool: ...

    def drafting(self) -> torch.Tensor:
        """Bool [b]: the rows to draft for this round, once `proceed(0)` said to draft at all (a row
        left out is not caught up, and its drafts are not proposed)."""
        ...

    def observed(self, step: int, logits: torch.Tensor, tokens: torch.Tensor, forced: torch.Tensor | None) -> None: ...


class Drafter(ABC):
    """Keeps whatever per-row state it needs in the same row order as the engine's rows.

    The engine drives it through this interface only: `add` rows (or build one in chunks with `stage`
    and `unstage`), `propose` drafts, `drop` finished rows, and, for engines whose rows live in a pool
    between rounds (EXSPEC), `load` the round's rows from the pool and `save` them back. A drafter
    that keeps state it can check exposes it in `views`. Stateless drafters ignore all but `propose`.

    Adaptive speculation adds `propose_steered` (draft while a `Steering` says it pays), `skip` (a
    round passed without drafts) and `backlog` (what catching a row up would feed it); all have
    defaults, so a drafter that knows none of them still works.
    """

    def add(self, seqs: list[Sequence]) -> None:
        """Rows appended after the existing ones (their prompts are known, plus the first token).
        A drafter that keeps no per-row state (prompt lookup reads the sequences) has nothing to do."""

    @abstractmethod
    def propose(self, seqs: list[Sequence], k: int, pick: Picker = pick_argmax) -> Draft:
        """k draft tokens for each row (or fewer, with `Draft.lengths`), continuing each sequence's
        current tokens."""

    def drop(self, keep: list[bool]) -> list[int]:
        """Remove rows, mirroring the target layout's `drop` (same order returned); nothing to remove
        for a drafter without per-row state."""
        return swap_remove_order(keep)

    def propose_steered(self, seqs: list[Sequence], k: int, pick: Picker, steer: Steering) -> Draft:
        """Up to k drafts per row, drafting step by step only while `steer` says so. The default
        drafts all k at once (a drafter that cannot stop early); the engine trims afterwards."""
        return self.propose(seqs, k, pick)

    def backlog(self, seqs: list[Sequence]) -> list[int]:
        """Tokens per row this drafter must be fed before it can draft for it (what plain steps
        committed, a prompt it has not prefilled yet): the speculation policy weighs that cost."""
        return [0] * len(seqs)

    def last_catch_up(self) -> float:
        """Seconds the last `propose` spent catching rows up rather than drafting (a deferred
        prefill): not a drafting step's cost, so the cost model does not learn from it."""
        return 0.0

    def skip(self, seqs: list[Sequence]) -> None:
        """The round runs without drafts: forget anything fed beyond the committed tokens, since the
        sequences will grow without this drafter seeing it (a later `propose` catches up)."""

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
