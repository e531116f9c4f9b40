"""Acceptance rules: pure tensor functions of draft tokens and target logits, vectorized over rows.

They never see caches, layouts or sampling params (filtering happens before, in `sampling`), and
randomness comes in as tensors, so every rule is a deterministic function of its inputs. Each
returns (tokens [b, k+1], count [b]): row b emits tokens[b, :count[b]], i.e. its accepted drafts
followed by one target token (the correction at the first rejection, or the bonus after k
acceptances).

`lengths` [b] (None: k for every row) caps row b at its own lengths[b] drafts: the slots after them
are padding (the round's forward is rectangular) and are never accepted, and the target's token at
slot lengths[b] is that row's bonus. Slots are causal, so padding never changes an earlier slot.
"""

from __future__ import annotations

import torch


def accepted_prefix(matches: torch.Tensor) -> torch.Tensor:
    """Length of the leading run of True in each row of `matches` [b, k]."""
    return matches.long().cumprod(dim=1).sum(dim=1)


def proposed(draft_tokens: torch.Tensor, lengths: torch.Tensor | None) -> torch.Tensor:
    """[b, k] True at the slots row b really proposed (its first lengths[b])."""
    b, k = draft_tokens.shape
    if lengths is None:
        return torch.ones((b, k), dtype=torch.bool, device=draft_tokens.device)
    return torch.arange(k, device=draft_tokens.device)[None, :] < lengths.to(draft_tokens.device)[:, None]


def matching(
    draft_tokens: torch.Tensor, target_tokens: torch.Tensor, lengths: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep drafts while they equal the target's own choice; then emit the target's choice.

    target_tokens [b, k+1] are what the target picks at each slot given the drafts before it
    (argmax for greedy, the keyed-noise sample for coupled). Accepted drafts equal those picks, so the
    emitted tokens are simply target_tokens[:, :a+1].
    """
    k = draft_tokens.shape[1]
    matches = (draft_tokens == target_tokens[:, :k]) & proposed(draft_tokens, lengths)
    return target_tokens, accepted_prefix(matches) + 1


def greedy(
    draft_tokens: torch.Tensor, target_logits: torch.Tensor, lengths: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification: the target's choice is its argmax."""
    return matching(draft_tokens, target_logits.argmax(dim=-1), lengths)


def acceptance_probability(draft_tokens: torch.Tensor, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """min(1, p(x)/q(x)) for each draft x [b, k] (Leviathan et al. 2023; Chen et al. 2023).

    p [b, k+1, V] target probabilities at each slot, q [b, k, V] the distributions the drafts were
    drawn from. q(x) = 0 only if a drafter proposes outside its own support; such a draft is then
    accepted iff the target can emit it.
    """
    k = draft_tokens.shape[1]
    index = draft_tokens[..., None]
    p_x = p[:, :k].gather(-1, index).squeeze(-1)
    q_x = q.gather(-1, index).squeeze(-1)
    return torch.where(q_x > 0, (p_x / q_x).clamp(max=1), (p_x > 0).to(p.dtype))


def residual(p: torch.Tensor, q: torch.Tensor, slot: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
    """The distribution [b, V] of the target token emitted when row b's round stops at `slot` [b]:
    normalize(max(0, p - q)) after a rejection at slot < lengths[b] (default k), p itself for the
    bonus at slot lengths[b].

    Computed for the stopping slot only, so a round costs O(b * V) here rather than O(b * k * V).
    """
    k = q.shape[1]
    rows = torch.arange(p.shape[0], device=p.device)
    target = p[rows, slot]
    if k == 0:
        return target
    rejected = slot < (k if lengths is None else lengths.to(slot.device))
    leftover = torch.where(rejected[:, None], (target - q[rows, slot.clamp(max=k - 1)]).clamp(min=0), target)
    mass = leftover.sum(dim=-1, keepdim=True)
    # No leftover mass means q >= p everywhere, i.e. q == p, where a rejection has probability 0; p
    # keeps the row a valid distribution.
    return torch.where(mass > 0, leftover / mass.clamp(min=torch.finfo(p.dtype).tiny), target)


def rejection(
    draft_tokens: torch.Tensor,
    p: torch.Tensor,
    q: torch.Tensor,
    uniform: torch.Tensor,
    noise: torch.Tensor,
    lengths: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative rejection sampling: the emitted tokens follow p exactly, whatever q is, provided
    the drafts were drawn from q (and how many a row drafts depends on nothing but what came before
    each draft: a stopping rule that looked at a draft itself to decide whether to keep it would bias
    the rule).

    draft_tokens [b, k], p [b, k+1, V], q [b, k, V]; randomness comes in as uniform [b, k] in [0, 1)
    and Gumbel noise [b, V]. Draft j is kept iff uniform[b, j] < acceptance_probability (and all
    before it were); the token at the stopping slot is argmax(log residual + noise) (Gumbel-max).
    """
    kept = (uniform < acceptance_probability(draft_tokens, p, q)) & proposed(draft_tokens, lengths)
    accepted = accepted_prefix(kept)
    extra = (torch.log(residual(p, q, accepted, lengths)) + noise).argmax(dim=-1)
    rows = torch.arange(draft_tokens.shape[0], device=draft_tokens.device)
    tokens = torch.cat([draft_tokens, extra[:, None]], dim=1)
    tokens[rows, accepted] = extra
    return tokens, accepted + 1
