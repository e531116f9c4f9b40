"""Layouts on their own: prefill at each prompt's own length (no padding computed), the padded
rectangle's placement, chunked prefill through the staging row, and row bookkeeping."""

from __future__ import annotations

import functools

import pytest
import torch
from tinyworld import VOCAB_SIZE, random_prompts, tiny_model

from batchspec.kv import forward_all_positions, prefix_kv
from batchspec.layouts import PaddedLayout, RaggedLayout
from batchspec.layouts.base import equal_runs, swap_remove_order

TOL = 1e-4


@functools.cache
def model(arch: str) -> torch.nn.Module:
    return tiny_model(arch, vocab_size=VOCAB_SIZE, seed=0)


def alone(arch: str, prompt: list[int]) -> torch.Tensor:
    """Last-position logits of the prompt alone, batch 1, on transformers' own cache."""
    return forward_all_positions(model(arch), prompt, keep=1)[0]


def assert_row_holds(layout, row: int, prompt: list[int]) -> None:
    start, count = layout.row_slots(row)
    assert count == len(prompt)
    cached = layout.store.row_kv(row, start, count)
    torch.testing.assert_close(cached, prefix_kv(layout.model, prompt), atol=TOL, rtol=TOL)


def test_equal_runs_and_swap_remove_order():
    assert equal_runs([1, 1, 2, 1, 1]) == [(0, 2), (2, 1), (3, 2)]
    assert equal_runs([(3, 0), (3, 1)]) == [(0, 1), (1, 1)] and equal_runs([]) == []
    assert swap_remove_order([True, False, True, True, False, True]) == [0, 5, 2, 3]
    assert swap_remove_order([False, False]) == []


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("layout_class", [RaggedLayout, PaddedLayout])
def test_prefill_computes_each_prompt_at_its_own_length(arch, layout_class):
    """Mixed lengths (runs of equal ones batched): logits and cached K/V equal each prompt alone,
    and the forwards computed exactly the prompt tokens, not one pad."""
    prompts = random_prompts(5, [9, 3, 3, 14, 1], seed=1)
    layout = layout_class(model(arch), 5, 32)
    logits = layout.prefill(prompts)
    assert layout.prefill_fed == sum(map(len, prompts))
    for row, prompt in enumerate(prompts):
        torch.testing.assert_close(logits[row], alone(arch, prompt), atol=TOL, rtol=TOL)
        assert_row_holds(layout, row, prompt)
    if layout_class is PaddedLayout:  # the rectangle: each row right-aligned to the longest
        assert layout.width == 14 and layout.pads.tolist() == [5, 11, 11, 0, 13]
        assert layout.violations() == []


@pytest.mark.parametrize("chunks", [[1] * 7, [3, 4], [7]])
def test_staged_prompt_in_chunks_equals_a_whole_prefill(chunks):
    prompt = random_prompts(1, [7], seed=3)[0]
    others = random_prompts(2, [4, 6], seed=4)
    layout = RaggedLayout(model("llama"), 3, 16)
    layout.prefill(others)
    start = 0
    for size in chunks:
        logits = layout.stage(prompt[start : start + size])
        start += size
    assert layout.num_rows == 2 and layout.staged == 7  # not a row of any round until complete
    layout.unstage()
    torch.testing.assert_close(logits, alone("llama", prompt), atol=TOL, rtol=TOL)
    assert layout.lengths.tolist() == [4, 6, 7]
    for row, p in enumerate(others + [prompt]):
        assert_row_holds(layout, row, p)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_empty_rows_fed_one_at_a_time_hold_what_a_prefill_holds(arch):
    """A lazy drafter's rows: appended empty, then each fed its prompt in pieces (a deferred prefill,
    later catch-ups) by a forward of that row alone; the other rows are untouched."""
    prompts = random_prompts(3, [9, 4, 6], seed=8)
    layout = RaggedLayout(model(arch), 4, 16)
    layout.prefill(prompts[:1])
    layout.add_empty(2)
    assert layout.lengths.tolist() == [9, 0, 0]
    layout.feed_row(2, prompts[2][:5])
    layout.feed_row(1, prompts[1])
    layout.feed_row(2, prompts[2][5:])
    assert layout.lengths.tolist() == [9, 4, 6]
    for row, p in enumerate(prompts):
        assert_row_holds(layout, row, p)
    logits = layout.forward(torch.tensor([[p[-1]] for p in prompts]), last_only=True)[:, -1]
    for row, p in enumerate(prompts):
        torch.testing.assert_close(logits[row], alone(arch, p + [p[-1]]), atol=TOL, rtol=TOL)


def test_a_staged_prompt_follows_the_rows_down_when_rows_are_dropped():
    prompt = random_prompts(1, [5], seed=5)[0]
    others = random_prompts(3, [4, 6, 2], seed=6)
    layout = RaggedLayout(model("gpt2"), 4, 16)
    layout.prefill(others)
    layout.stage(prompt[:3])
    assert layout.drop([True, False, True]) == [0, 2]
    layout.stage(prompt[3:])
    layout.unstage()
    assert layout.lengths.tolist() == [4, 2, 5]
    for row, p in enumerate([others[0], others[2], prompt]):
        assert_row_holds(layout, row, p)


def test_padded_layout_cannot_stage():
    with pytest.raises(NotImplementedError, match="prefills whole prompts only"):
        PaddedLayout(model("llama"), 2, 8).stage([5, 6])
