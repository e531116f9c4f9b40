"""A small language model as drafter, with its own KV cache kept in the same layout as the target's.

Never re-prefills: each round it first rolls its cache back to all but the last two tokens of each
sequence, then feeds those two. That one uniform step absorbs both cases left by the previous round
(the bonus token alone is new, or the last accepted draft it never fed plus the bonus) without any
per-row branching; recomputing one token's K/V costs next to nothing.
"""

from __future__ import annotations

import torch

from ..layouts import Layout
from ..sequence import Sequence
from .base import Draft, Drafter, Picker, pick_argmax


class ModelDrafter(Drafter):
    def __init__(self, layout: Layout) -> None:
        self.layout = layout

    def add(self, seqs: list[Sequence]) -> None:
        self.layout.prefill([s.prompt_ids for s in seqs])

    def propose(self, seqs: list[Sequence], k: int, pick: Picker = pick_argmax) -> Draft:
        device = self.layout.device
        lengths = torch.tensor([s.length for s in seqs], dtype=torch.long, device=device)
        self.layout.commit(lengths - 2)
        feed = torch.tensor([s.tail(2) for s in seqs], dtype=torch.long, device=device)
        tokens, logits = [], []
        for step in range(k):
            step_logits = self.layout.forward(feed, last_only=True)[:, -1]
            token = pick(step_logits, step)
            tokens.append(token)
            logits.append(step_logits)
            feed = token[:, None]
        return Draft(torch.stack(tokens, dim=1), torch.stack(logits, dim=1))

    def drop(self, keep: list[bool]) -> list[int]:
        return self.layout.drop(keep)
