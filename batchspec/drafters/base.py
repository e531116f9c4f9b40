"""The drafter interface the engine talks to."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Protocol

import torch

from ..draft import SHARED_CATCH_UP, Backlog, CatchUp, Draft, Picker, empty_draft, pick_argmax
from ..layouts.base import LayoutView, swap_remove_order
from ..sequence import Sequence

__all__ = ["SHARED_CATCH_UP", "CatchUp", "Draft", "Drafter", "NoDrafter", "Picker", "Steering", "empty_draft", "pick_argmax"]

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

    def pieces(self) -> torch.Tensor:
        """Long [b], read once `proceed(0)` has answered, whatever it answered: tokens of a catch-up
        to feed row b alone this step although it does not draft (what is left of the step's token
        budget cannot hold the whole catch-up, so later steps continue it); 0 for every other row."""
        ...

    def observed(self, step: int, logits: torch.Tensor, tokens: torch.Tensor, forced: torch.Tensor | None) -> None: ...


class Drafter(ABC):
    """Keeps whatever per-row state it needs in the same row order as the engine's rows.

    The engine drives it through this interface only: `add` rows (or build one in chunks with `stage`
    and `unstage`), `propose` drafts, `drop` finished rows, and, for engines whose rows live in a pool
    between rounds (EXSPEC), `load` the round's rows from the pool and `save` them back. A drafter
    that keeps state it can check exposes it in `views`. Stateless drafters ignore all but `propose`.

    Adaptive speculation adds `propose_steered` (draft while a `Steering` says it pays), `skip` (a
    round passed without drafts) and `backlog` (what catching a row up would feed it, and by which
    path); all have defaults, so a drafter that knows none of them still works.
    """

    # Whether `propose_steered` drafts nothing unless the steering's `proceed(0)` says to: the policy
    # may then settle a round as a plain step without asking it (`AdaptiveSpeculation.idle`). Not so
    # for drafters whose proposals cost nothing and are weighed only once drafted (prompt lookup).
    asks_first = False

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

    def backlog(self, seqs: list[Sequence]) -> Backlog:
        """Per row, the tokens this drafter must be fed before it can draft for it and whether that
        catch-up runs on its prompt path: the speculation policy weighs that cost. By default
        nothing to feed (a drafter without per-row state)."""
        return Backlog([0] * len(seqs), [False] * len(seqs))

    def catch_ups(self) -> list[CatchUp]:
        """The forwards the last `propose` (or `skip`) ran catching rows up rather than drafting (a
        deferred prefill): not a drafting step's cost, so the cost model does not learn from them,
        and pieces of their own in the step trace."""
        return []

    def skip(self, seqs: list[Sequence]) -> None:
        """The round runs without drafts: forget anything fed beyond the committed tokens, since the
        sequences will grow without this drafter seeing it (a later `propose` catches up)."""

    def begin_stage(self, prompt: list[int], staged: int) -> None:
        """Chunked prefill: the target starts staging `prompt` holding its first `staged` tokens
        already (from the prefix cache); the next `stage` continues from there."""

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


class NoDrafter(Drafter):
    """The drafter of plain decoding: proposes nothing and keeps no state, so the engine calls every
    drafter hook unconditionally (a round plans no drafting step for it: the engine's K is 0)."""

    def propose(self, seqs: list[Sequence], k: int, pick: Picker = pick_argmax) -> Draft:
        return empty_draft(len(seqs), torch.device("cpu"))
