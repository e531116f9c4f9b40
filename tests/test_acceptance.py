"""The acceptance rules as pure tensor functions: what each row keeps and what it emits."""

from __future__ import annotations

import torch

from batchspec import acceptance


def test_accepted_prefix_counts_the_leading_run_only():
    matches = torch.tensor([[True, True, False, True], [False, True, True, True], [True] * 4])
    assert acceptance.accepted_prefix(matches).tolist() == [2, 0, 4]
    assert acceptance.accepted_prefix(torch.zeros((2, 0), dtype=torch.bool)).tolist() == [0, 0]


def test_greedy_keeps_drafts_while_they_are_the_argmax_then_emits_the_targets_token():
    # target argmax per slot: row 0 -> [3, 1, 4, 2]; row 1 -> [0, 0, 0, 0]
    logits = torch.full((2, 4, 5), -1.0)
    for slot, token in enumerate([3, 1, 4, 2]):
        logits[0, slot, token] = 1.0
    logits[1, :, 0] = 1.0
    drafts = torch.tensor([[3, 1, 0], [1, 0, 0]])
    tokens, count = acceptance.greedy(drafts, logits)
    assert count.tolist() == [3, 1]  # row 0: 2 drafts + correction; row 1: correction only
    assert tokens[0, :3].tolist() == [3, 1, 4] and tokens[1, :1].tolist() == [0]
    all_right = torch.tensor([[3, 1, 4]])
    tokens, count = acceptance.greedy(all_right, logits[:1])
    assert count.tolist() == [4] and tokens[0].tolist() == [3, 1, 4, 2]  # every draft + the bonus


def test_acceptance_probability_is_min_one_p_over_q():
    p = torch.tensor([[[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]]])
    q = torch.tensor([[[0.25, 0.75, 0.0]]])
    assert acceptance.acceptance_probability(torch.tensor([[0]]), p, q).tolist() == [[1.0]]
    assert torch.allclose(acceptance.acceptance_probability(torch.tensor([[1]]), p, q), torch.tensor([[2 / 3]]))
    # a draft outside the drafter's own support: accepted iff the target can emit it
    assert acceptance.acceptance_probability(torch.tensor([[2]]), p, q).tolist() == [[0.0]]


def test_residual_is_the_normalised_excess_of_p_over_q_and_p_for_the_bonus():
    p = torch.tensor([[[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]]])
    q = torch.tensor([[[0.2, 0.6, 0.2]]])
    assert torch.allclose(acceptance.residual(p, q, torch.tensor([0])), torch.tensor([[1.0, 0.0, 0.0]]))
    assert torch.allclose(acceptance.residual(p, q, torch.tensor([1])), p[:, 1])
    same = acceptance.residual(p[:, :1].expand(1, 2, 3), p[:, :1], torch.tensor([0]))
    assert torch.allclose(same, p[:, 0])  # q == p: no excess mass, p keeps it a distribution


def test_rejection_with_q_equal_p_accepts_everything_and_samples_the_bonus_from_p():
    p = torch.softmax(torch.randn(3, 4, 6, generator=torch.Generator().manual_seed(0)), dim=-1)
    drafts = torch.tensor([[1, 2, 3], [0, 0, 0], [5, 4, 3]])
    q = p[:, :3]
    noise = torch.zeros(3, 6)
    noise[:, 4] = 100.0  # Gumbel noise that makes token 4 the sample wherever it has mass
    tokens, count = acceptance.rejection(drafts, p, q, torch.full((3, 3), 0.999), noise)
    assert count.tolist() == [4, 4, 4]
    assert tokens[:, :3].tolist() == drafts.tolist() and tokens[:, 3].tolist() == [4, 4, 4]


def test_rejection_stops_at_the_first_rejected_draft_and_emits_from_the_residual():
    p = torch.tensor([[[0.1, 0.9], [0.5, 0.5], [0.5, 0.5]]])
    q = torch.tensor([[[0.9, 0.1], [0.5, 0.5]]])  # draft 0 (token 0) has p/q = 1/9
    tokens, count = acceptance.rejection(torch.tensor([[0, 1]]), p, q, torch.tensor([[0.5, 0.0]]), torch.zeros(1, 2))
    assert count.tolist() == [1]
    assert tokens[0, 0].item() == 1  # residual max(0, p - q) is all on token 1
