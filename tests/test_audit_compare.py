"""`batchspec.forensics.compare`: lining outputs up with the oracle and classifying divergences,
on hand-made logits (fast, no model), plus the scores the continuation check reads on a tiny model."""

from __future__ import annotations

import pytest
import torch
from tinyworld import VOCAB_SIZE

from batchspec.config import BatchspecError, SamplingParams
from batchspec.forensics.calibration import calibration_prefixes
from batchspec.forensics.compare import (
    EXACT,
    FP_TIE,
    LENGTH,
    SYNC_ERROR,
    TOKEN,
    check_continuation,
    classify_gap,
    compare_ids,
    compare_visible,
    first_difference,
    plain_scores,
)
from batchspec.kv import forward_all_positions
from tinyworld import tiny_model
from batchspec.reference import greedy_decode, sample_decode

STOP = frozenset({1})


def test_first_difference() -> None:
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2
    assert first_difference([], [4]) == 0
    assert first_difference([7, 8], [7, 8]) == 2


def test_classify_gap_tie_is_fp_tie_and_far_token_is_sync_error() -> None:
    logits = torch.linspace(-5, 5, 50)
    logits[7] = logits[9] = 8.0  # an exact tie at the top
    assert classify_gap(logits, 7, 9, margin=1e-4) == (FP_TIE, 0.0, 0)
    logits[9] = 8.0 - 5e-5  # within the margin
    assert classify_gap(logits, 7, 9, margin=1e-4)[0] == FP_TIE
    kind, gap, rank = classify_gap(logits, 7, 0, margin=1e-4)  # the target's least likely token
    assert kind == SYNC_ERROR and gap == pytest.approx(13.0) and rank == 49
    assert classify_gap(logits, 7, 500, margin=1e-4)[0] == SYNC_ERROR  # not even in the vocabulary


def test_compare_ids_cases() -> None:
    oracle = [5, 6, 7, 1]  # ends with the stop token
    assert compare_ids(oracle, [5, 6, 7, 1], STOP).kind == EXACT
    assert compare_ids(oracle, [5, 6, 7], STOP).kind == EXACT  # stop token stripped by the writer
    c = compare_ids(oracle, [5, 9, 7, 1], STOP)
    assert (c.kind, c.position, c.oracle_token, c.audited_token, c.matched, c.audited_index) == (TOKEN, 1, 6, 9, 1, 1)
    c = compare_ids(oracle, [5, 6, 7, 1, 8, 8], STOP)  # kept going after the stop token
    assert (c.kind, c.position, c.audited_token) == (SYNC_ERROR, 4, 8)
    assert compare_ids([5, 6, 7], [5, 6], STOP).kind == LENGTH  # shorter budget, nothing differs
    assert compare_ids([5, 6, 7], [5, 6, 7, 8], STOP).kind == LENGTH  # oracle hit its budget


def test_compare_visible_maps_positions_past_hidden_tokens() -> None:
    hidden = {0, 1, 2}
    oracle = [5, 2, 6, 7, 1]  # an <unk> at 1 and a stop at 4 never show in text
    assert compare_visible(oracle, [5, 6, 7], hidden).kind == EXACT
    c = compare_visible(oracle, [5, 6, 9], hidden)
    assert (c.kind, c.position, c.oracle_token, c.audited_token, c.audited_index) == (TOKEN, 3, 7, 9, 2)
    c = compare_visible(oracle, [5, 6, 7, 8], hidden)  # the oracle stopped, the text goes on
    assert (c.kind, c.position, c.oracle_token, c.audited_token, c.audited_index) == (TOKEN, 4, 1, 8, 3)
    assert compare_visible(oracle, [5, 6], hidden).kind == LENGTH


def _scores(argmax: list[int], seconds: dict[int, tuple[int, float]] | None = None, vocab: int = 20) -> torch.Tensor:
    """Scores [n, vocab]: row i peaks (10.0) at argmax[i]; seconds[i] = (token, gap) puts a runner-up
    `gap` below the peak; everything else sits at 0."""
    scores = torch.zeros(len(argmax), vocab)
    for i, token in enumerate(argmax):
        scores[i, token] = 10.0
    for i, (token, gap) in (seconds or {}).items():
        scores[i, token] = 10.0 - gap
    return scores


def test_continuation_that_keeps_agreeing_is_a_tie() -> None:
    tokens = [9, 4, 5, 6]  # tokens[0] is the divergent token; row 0 is not looked at
    result = check_continuation(_scores([3, 4, 5, 6]), tokens, start=7, margin=0.1, stop_ids=STOP)
    assert (result.checked, result.ties, result.diverged_at) == (3, 0, None)


def test_later_differences_within_the_margin_are_followed_from_the_audited_token() -> None:
    scores = _scores([3, 4, 8, 6], {2: (5, 0.05)})  # position 2 prefers 8, but 5 is within 0.05
    result = check_continuation(scores, [9, 4, 5, 6], start=7, margin=0.1, stop_ids=STOP)
    assert (result.checked, result.ties, result.diverged_at) == (3, 1, None)


def test_a_later_difference_beyond_the_margin_is_where_it_diverged() -> None:
    scores = _scores([3, 4, 8, 6], {2: (5, 3.0)})
    result = check_continuation(scores, [9, 4, 5, 6], start=7, margin=0.1, stop_ids=STOP)
    assert (result.diverged_at, result.expected_token, result.diverged_token) == (9, 8, 5)
    assert result.logit_gap == pytest.approx(3.0) and result.checked == 2


def test_tokens_after_a_stop_token_leave_plain_decoding() -> None:
    result = check_continuation(_scores([3, 1, 5]), [9, 1, 5], start=0, margin=0.1, stop_ids=STOP)
    assert (result.diverged_at, result.expected_token, result.diverged_token) == (2, None, 5)
    result = check_continuation(_scores([1, 5]), [1, 5], start=4, margin=0.1, stop_ids=STOP)  # tie on the stop
    assert result.diverged_at == 5


def test_text_outputs_excuse_only_a_different_token_boundary() -> None:
    scores = _scores([3, 4, 8, 6], {2: (5, 3.0)})
    prefix_of = {(8, 5)}  # token 8 spells a prefix of token 5's text, say " hel" and " hello"
    result = check_continuation(scores, [9, 4, 5, 6], 0, 0.1, STOP, same_text=lambda a, b: (a, b) in prefix_of)
    assert (result.retokenized, result.diverged_at) == (1, None)
    result = check_continuation(scores, [9, 4, 5, 6], 0, 0.1, STOP, same_text=lambda a, b: False)
    assert result.diverged_at == 2


@pytest.mark.parametrize("params", [SamplingParams(max_new_tokens=12), SamplingParams(12, 0.8, 0.9, 20, seed=3)])
def test_teacher_forced_scores_reproduce_plain_decoding(params: SamplingParams) -> None:
    """One forward over prompt + output gives, at every position, plain decoding's choice: greedy, and
    seeded sampling through the same keyed noise (so sampled bench runs are audited right too)."""
    model = tiny_model("llama", vocab_size=VOCAB_SIZE, seed=0)
    prompt = [5, 9, 14, 20, 33]
    if params.greedy:
        tokens = greedy_decode(model, prompt, params.max_new_tokens)
    else:
        tokens = sample_decode(model, prompt, params)
    logits = forward_all_positions(model, prompt + tokens[:-1], keep=len(tokens))
    scores = plain_scores(logits, params, range(len(tokens)))
    assert scores.argmax(dim=-1).tolist() == tokens
    if params.greedy:
        assert scores is logits
    with pytest.raises(BatchspecError):
        plain_scores(logits, SamplingParams(temperature=0.7), range(len(tokens)))


def test_calibration_prefixes_take_half_of_each_output_or_one_common_length():
    """Each prompt with the first half of its output; `common` (a model with a prompt path, whose
    layouts feed every row's continuation as generated tokens in one forward): the shortest half that
    is not empty for every prompt, leaving out the prompts whose half is shorter."""
    prompts, outputs = [[5], [6, 7], [8]], [[1, 2, 3, 4, 5, 6], [9], [3, 4, 5, 6]]
    assert calibration_prefixes(prompts, outputs) == [([5], [1, 2, 3]), ([6, 7], []), ([8], [3, 4])]
    assert calibration_prefixes(prompts, outputs, common=True) == [([5], [1, 2]), ([8], [3, 4])]
    assert calibration_prefixes([[5]], [[9]], common=True) == [([5], [])]  # nothing generated to feed
