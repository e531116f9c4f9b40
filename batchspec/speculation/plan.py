"""A round's plan and the speculation-policy interface; the fixed policy (K every round)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

from ..draft import Draft
from ..sequence import Sequence

if TYPE_CHECKING:
    from .adaptive import RoundSteering


@dataclass
class RoundPlan:
    """What the engine asks the drafter for: up to `steps` drafter steps (0: a plain decoding step),
    steered by `steer` when the policy adapts; `declined`: a plain step the policy chose, where it
    could have drafted."""

    steps: int
    steer: RoundSteering | None = None
    declined: bool = False


class RoundTimes(NamedTuple):
    """A round's wall time by phase, seconds: drafter steps, the target's verify forward, everything
    else (acceptance, commits), and the drafter's catch-ups (deferred prefills, apart from its steps)."""

    draft: float
    verify: float
    other: float
    catch_up: float = 0.0

    @property
    def total(self) -> float:
        return self.draft + self.verify + self.other + self.catch_up


class Speculation(ABC):
    """A speculation policy: plans a round, trims what the drafter proposed, learns from the outcome."""

    weighs_backlog = False  # whether `plan` reads the drafter's backlog (the engine asks for it only then)

    @abstractmethod
    def plan(self, seqs: list[Sequence], backlog: list[int] | None = None, allowance: int | None = None,
             fast: list[bool] | None = None) -> RoundPlan:
        """The round for these rows; backlog[b]: tokens the drafter must be fed (catch up on) before
        it can draft for row b (`Drafter.backlog`; None: nothing); allowance: catch-up tokens this
        step may still feed (the step's token budget less what prefill took; None: unbounded);
        fast[b]: row b's catch-up runs on the drafter's prompt path (the same call)."""

    def settle(self, plan: RoundPlan, draft: Draft) -> Draft:
        """The drafts to verify, out of what the drafter proposed."""
        return draft

    def observe(self, seqs: list[Sequence], plan: RoundPlan, draft: Draft, count: torch.Tensor,
                times: RoundTimes) -> None:
        """The round's outcome: `count` [b] tokens emitted per row (accepted drafts + 1) and its
        seconds by phase."""

    def forget(self, seqs: list[Sequence]) -> None:
        """These sequences left the engine."""


class FixedSpeculation(Speculation):
    """K drafts every round for every row (fewer only where the drafter proposes fewer, or no row
    can emit more)."""

    def __init__(self, k: int) -> None:
        self.k = k

    def plan(self, seqs: list[Sequence], backlog: list[int] | None = None, allowance: int | None = None,
             fast: list[bool] | None = None) -> RoundPlan:
        return RoundPlan(max(0, min(self.k, max(s.remaining for s in seqs) - 1)))
