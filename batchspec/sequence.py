"""One request in flight: its tokens, how it ends, and what it cost."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .config import SamplingParams

if TYPE_CHECKING:
    from .logprobs import TokenLogprob


@dataclass
class Sequence:
    """A prompt being decoded. `generated` never holds tokens past a stop token or max_new_tokens."""

    index: int
    prompt_ids: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]
    generated: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    rounds: int = 0
    drafted: int = 0  # drafts verified, over all rounds
    accepted: int = 0
    # per round: drafts the drafter proposed for this row, drafts verified (the speculation policy's
    # choice: 0 where speculation was turned down), drafts accepted
    proposed_k: list[int] = field(default_factory=list)
    chosen_k: list[int] = field(default_factory=list)
    accepted_k: list[int] = field(default_factory=list)
    arrival_time: float = field(default_factory=time.perf_counter)
    token_times: list[float] = field(default_factory=list)  # when each generated token was emitted
    finish_time: float | None = None
    # one entry per generated token when params.logprobs asks for them (the engine fills it), else None
    logprobs: list[TokenLogprob] | None = None

    def __post_init__(self) -> None:
        if self.logprobs is None and self.params.logprobs is not None:
            self.logprobs = []

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.generated

    def tail(self, n: int) -> list[int]:
        """The last n tokens (prompt included), without copying the whole sequence: the round loop
        needs only these, every round, for every row."""
        if n <= len(self.generated):
            return self.generated[len(self.generated) - n :]
        return self.prompt_ids[len(self.prompt_ids) - (n - len(self.generated)) :] + self.generated

    @property
    def first_token_time(self) -> float | None:
        return self.token_times[0] if self.token_times else None

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.generated)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def remaining(self) -> int:
        return self.params.max_new_tokens - len(self.generated)

    def extend(self, new_tokens: list[int]) -> int:
        """Append tokens up to and including the first stop token, within max_new_tokens.
        Returns how many were appended."""
        taken = 0
        now = time.perf_counter()
        for token in new_tokens:
            if self.finished:
                break
            self.generated.append(token)
            self.token_times.append(now)
            taken += 1
            if token in self.stop_ids:
                self.finish_reason = "stop"
            elif self.remaining <= 0:
                self.finish_reason = "length"
        if self.finished and self.finish_time is None:
            self.finish_time = now
        return taken

    def record_round(self, tokens: list[int], offered: int, chosen: int) -> tuple[int, int]:
        """Append a round's tokens (its accepted drafts, then the target's own token), of `offered`
        drafts proposed and `chosen` verified. Returns (tokens appended, drafts accepted): fewer than
        given where a stop token or max_new_tokens ends the row inside the round."""
        taken = self.extend(tokens)
        accepted = min(len(tokens) - 1, taken)
        self.rounds += 1
        self.drafted += chosen
        self.accepted += accepted
        self.proposed_k.append(offered)
        self.chosen_k.append(chosen)
        self.accepted_k.append(accepted)
        return taken, accepted

    def abort(self) -> None:
        """Finish here, keeping what was generated so far (a client went away, or asked to stop)."""
        if not self.finished:
            self.finish_reason = "abort"
            self.finish_time = time.perf_counter()
