"""The adapter's own pieces: SlotStore's bulk K/V moves on their edge cases, and the attention
path that reads grouped K/V heads in place.

A drafter keeps all but the last two tokens of each row, so a group made only of rows with a
1-token prompt and their first generated token keeps zero slots: realigning or copying such rows
must be an empty operation, not a crash (issue 8).
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from batchspec.kv import GQA_SDPA, SlotStore, use_gqa_attention
from batchspec.layouts.ragged import RaggedLayout
from tinyworld import tiny_model

LAYERS, ROWS, HEADS, CAPACITY, DIM = 2, 3, 2, 8, 4


def filled_store(seed: int) -> SlotStore:
    store = SlotStore(LAYERS, ROWS, CAPACITY)
    gen = torch.Generator().manual_seed(seed)
    store.data = torch.randn((LAYERS, 2, ROWS, HEADS, CAPACITY, DIM), generator=gen)
    return store


def test_gather_slots_that_keep_nothing_change_nothing():
    store = filled_store(0)
    before = store.data.clone()
    store.gather_slots(2, torch.zeros((2, 0), dtype=torch.long))
    store.gather_slots(0, torch.zeros((0, 3), dtype=torch.long))
    assert torch.equal(store.data, before)


def test_copy_rows_of_zero_width_change_nothing():
    src, dst = filled_store(0), filled_store(1)
    before = dst.data.clone()
    rows = torch.tensor([0, 2])
    dst.copy_rows(src, rows, torch.tensor([1, 0]), torch.zeros((2, 0), dtype=torch.long))
    empty = torch.zeros(0, dtype=torch.long)
    dst.copy_rows(src, empty, empty, torch.zeros((0, 4), dtype=torch.long))
    assert torch.equal(dst.data, before)


def test_copy_rows_still_moves_what_it_is_asked_to():
    """The empty case did not cost the general one: slot j of dst row b <- slot map[b, j] of src row."""
    src, dst = filled_store(0), filled_store(1)
    slot_map = torch.tensor([[0, 0, 1], [2, 3, 4]])
    dst.copy_rows(src, torch.tensor([2, 0]), torch.tensor([0, 1]), slot_map)
    for dst_row, src_row in ((0, 2), (1, 0)):
        want = src.data[:, :, src_row].index_select(3, slot_map[dst_row])
        assert torch.equal(dst.data[:, :, dst_row, :, :3], want)


def _verify_logits(model: torch.nn.Module, implementation: str, calls: list[bool]) -> torch.Tensor:
    """Prefill three rows of different lengths, then one 4-token forward (a verify) under the
    layout's explicit mask, all on `implementation`; `calls` gets each SDPA call's enable_gqa."""
    layout = RaggedLayout(model, 3, 40)
    model.set_attn_implementation(implementation)
    layout.prefill([[(5 * i + r) % 90 + 3 for i in range(9 + 4 * r)] for r in range(3)])
    calls.clear()
    return layout.forward(torch.tensor([[7, 11, 13, 17], [19, 23, 29, 31], [37, 41, 43, 47]]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_grouped_heads_read_in_place_give_transformers_bits(arch, dtype, monkeypatch):
    """The in-place path runs for a masked multi-token forward and gives exactly the logits of
    transformers' own SDPA path (which copies each K/V head per query head), so switching a model to
    it can change no token of any engine or of the oracle."""
    calls: list[bool] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append(bool(kwargs.get("enable_gqa", False)))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    model = tiny_model(arch, seed=2).to(dtype)
    in_place = _verify_logits(model, GQA_SDPA, calls)
    assert calls and all(calls)
    stock = _verify_logits(model, "sdpa", calls)
    assert calls and not any(calls)
    assert torch.equal(in_place, stock)


def test_layouts_switch_only_models_with_grouped_heads():
    grouped, plain = tiny_model("qwen2"), tiny_model("gpt2")
    RaggedLayout(grouped, 1, 8)
    RaggedLayout(plain, 1, 8)
    assert grouped.config._attn_implementation == GQA_SDPA
    assert plain.config._attn_implementation == "sdpa"  # one K/V head per query head: nothing to gain


class _NamesItsKernel(LlamaForCausalLM):
    """Stands for a model whose own code branches on `_attn_implementation == "sdpa"` (this file
    spells it, as Falcon's or Gemma 4's modeling code does): renaming its kernel would change it."""


def test_models_whose_code_tests_for_sdpa_keep_it():
    model = _NamesItsKernel(tiny_model("llama").config)
    use_gqa_attention(model)
    assert model.config._attn_implementation == "sdpa"
