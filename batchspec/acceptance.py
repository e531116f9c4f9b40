"""Acceptance rules: pure tensor functions of draft tokens and target logits, vectorized over rows.

They never see caches or layouts. Each returns (tokens [b, k+1], count [b]): row b emits
tokens[b, :count[b]], i.e. its accepted drafts followed by one target token (the correction at the
first rejection, or the bonus after k acceptances).
"""

from __future__ import annotations

import torch


def accepted_prefix(matches: torch.Tensor) -> torch.Tensor:
    """Length of the leading run of True in each row of `matches` [b, k]."""
    return matches.long().cumprod(dim=1).sum(dim=1)


def greedy(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep drafts while they equal the target's argmax; then emit the target's own token.

    Since accepted drafts equal the target argmax at their positions, the emitted tokens are simply
    the target's argmax at positions 0..a.
    """
    target_tokens = target_logits.argmax(dim=-1)
    k = draft_tokens.shape[1]
    count = accepted_prefix(draft_tokens == target_tokens[:, :k]) + 1
    return target_tokens, count
