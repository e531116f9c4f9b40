"""What a drafter hands the engine: the drafts of one round (`Draft`), and how a drafting step turns
logits into tokens (`Picker`). A neutral module, so that sampling and speculation, which read
drafts, need not import the drafters that make them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

# A drafter that lags behind rows catches them up before drafting: lags up to this many tokens in one
# forward shared by all rows, longer ones in a forward of each row's own (a prefill, in effect).
SHARED_CATCH_UP = 32


@dataclass(frozen=True)
class CatchUp:
    """One forward a drafter ran to catch rows up before drafting (what `Drafter.catch_ups` reports
    for the step trace and the cost model): `rows` (indices in the round) fed `tokens` each, in one
    forward `shared` by them or a forward of one row alone; `complete` False for a piece of a long
    catch-up that later steps continue."""

    rows: list[int]
    tokens: list[int]
    shared: bool
    complete: bool
    seconds: float


class Backlog(NamedTuple):
    """What catching each row up would feed a drafter before it can draft for the row (`lags` [b]
    tokens: what plain steps committed, a prompt not prefilled yet) and whether that forward runs on
    the drafter's prompt path (`fast` [b]; `Costs.prompt_time` prices it, `Costs.draft_time` the
    others). The engine asks once a round, before planning it."""

    lags: list[int]
    fast: list[bool]


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
