"""The adapter's own pieces: SlotStore's bulk K/V moves on their edge cases, and the exact attention
path: every forward a row can take gives it plain decoding's logits bit for bit.

A drafter keeps all but the last two tokens of each row, so a group made only of rows with a
1-token prompt and their first generated token keeps zero slots: realigning or copying such rows
must be an empty operation, not a crash (issue 8).
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from batchspec.kernels import apply_linear_kernel
from batchspec.kv import (
    EXACT_ATTENTION,
    SlotStore,
    attention_path,
    forward_plain,
    new_dynamic_cache,
    use_exact_attention,
)
from batchspec.layouts.padded import PaddedLayout
from batchspec.layouts.ragged import RaggedLayout
from tinyworld import tiny_model, torch_threads

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


# ---- exact attention ------------------------------------------------------------------------------
@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    """The engine runs on every core; the tiny-model tests on one (conftest): check both."""
    with torch_threads(request.param):
        yield request.param


def test_the_matmul_shapes_exact_attention_uses_round_alike_on_this_cpu(threads):
    """What `kv._exact_attention` rests on, checked on the CPU the tests run on: a product's output
    element does not depend on how many rows (>= 8) or columns share it, nor on the column it sits in,
    and a fixed-length inner product does not depend on the rows either."""
    gen = torch.Generator().manual_seed(0)
    for dim in (16, 64, 128):
        q, k = torch.randn(4096, dim, generator=gen), torch.randn(1100, dim, generator=gen)
        want = (q[:8] @ k[:40].T)[0]
        for rows in (8, 9, 36, 300, 4096):
            for keys in (40, 41, 128, 1100):
                assert torch.equal((q[:rows] @ k[:keys].T)[0, :40], want), (dim, rows, keys)
        shifted = torch.cat([torch.randn(17, dim, generator=gen), k[:40]])
        assert torch.equal((q[:8] @ shifted.T)[0, 17:], want)
        p, v = torch.rand(4096, 128, generator=gen), torch.randn(128, dim, generator=gen)
        block = (p[:8] @ v)[0]
        for rows in (9, 36, 300, 4096):
            assert torch.equal((p[:rows] @ v)[0], block), (dim, rows)


def plain_logits(model: torch.nn.Module, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    """Plain decoding's logits [1 + len(continuation), vocab]: after the prompt (one prefill
    forward), then after each continuation token (one-token steps), on transformers' own cache."""
    cache = new_dynamic_cache(model)
    out = [forward_plain(model, torch.tensor([prompt]), cache)[0]]
    out += [forward_plain(model, torch.tensor([[t]]), cache)[0] for t in continuation]
    return torch.stack(out)


PROMPTS = [[(5 * i + r) % 90 + 3 for i in range(9 + 4 * r)] for r in range(3)]
FOLLOW = [[(7 * i + 11 * r) % 90 + 3 for i in range(12)] for r in range(3)]


def _exact_model(arch: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    model = tiny_model(arch, seed=2).to(dtype)
    apply_linear_kernel(model, "auto")  # row-invariant linears (batchspec.kernels)
    return model


@pytest.mark.parametrize("layout_class", [RaggedLayout, PaddedLayout])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_every_forward_of_a_row_gives_plain_decodings_logits_bit_for_bit(arch, layout_class, threads):
    """A batched prefill of three lengths, a 4-token verify, a commit keeping 1, 3 and 4 of them
    (rows of different lengths: the padded layout realigns, the ragged one does not), a one-token
    step and a 3-token verify: every logit of every row equals plain decoding's, where the prompt
    is prefilled alone and every later token is a one-token step."""
    model = _exact_model(arch)
    plain = [plain_logits(model, p, f) for p, f in zip(PROMPTS, FOLLOW)]
    layout = layout_class(model, 3, 64)
    assert attention_path(model) == "exact"
    first = layout.prefill(PROMPTS)
    for r in range(3):
        assert torch.equal(first[r], plain[r][0])
    fed = [0, 0, 0]

    def feed(n: int) -> None:
        logits = layout.forward(torch.tensor([f[fed[r] : fed[r] + n] for r, f in enumerate(FOLLOW)]))
        for r in range(3):
            assert torch.equal(logits[r], plain[r][fed[r] + 1 : fed[r] + 1 + n]), (r, fed[r], n)
            fed[r] += n

    feed(4)
    keep = [1, 3, 4]
    layout.commit(torch.tensor([len(p) + k for p, k in zip(PROMPTS, keep)]))
    fed[:] = keep
    feed(1)
    feed(3)


def test_catch_ups_and_chunked_prefill_give_plain_decodings_logits(threads):
    """A row caught up in one forward of its own (`feed_row`, the drafter's long catch-up) and a
    prompt prefilled in chunks into the staging row, then verified beside the others."""
    model = _exact_model("qwen2")
    plain = [plain_logits(model, p, f) for p, f in zip(PROMPTS, FOLLOW)]
    layout = RaggedLayout(model, 3, 64)
    layout.prefill([PROMPTS[0][:3], PROMPTS[1]])
    layout.feed_row(0, PROMPTS[0][3:])
    for chunk in (PROMPTS[2][:5], PROMPTS[2][5:11], PROMPTS[2][11:]):
        last = layout.stage(chunk)
    assert torch.equal(last, plain[2][0])
    layout.unstage()
    logits = layout.forward(torch.tensor([f[:5] for f in FOLLOW]))
    for r in range(3):
        assert torch.equal(logits[r], plain[r][1:6])


def test_transformers_sdpa_would_not_give_plain_decodings_bits():
    """The control: the same verify on transformers' own SDPA path rounds differently, so the tests
    above can tell the paths apart."""
    model = _exact_model("qwen2")
    model.set_attn_implementation("sdpa")
    plain = plain_logits(model, PROMPTS[2], FOLLOW[2])
    layout = RaggedLayout(model, 3, 64)
    model.set_attn_implementation("sdpa")  # the layout installed the exact path: take it back out
    layout.prefill(PROMPTS)
    logits = layout.forward(torch.tensor([f[:4] for f in FOLLOW]))
    assert not torch.equal(logits[2], plain[1:5])
    torch.testing.assert_close(logits[2], plain[1:5])  # ... by rounding only


def test_models_switch_to_the_exact_path_once():
    model = tiny_model("qwen2")
    assert use_exact_attention(model) and use_exact_attention(model)
    assert model.config._attn_implementation == EXACT_ATTENTION


class _NamesItsKernel(LlamaForCausalLM):
    """Stands for a model whose own code branches on `_attn_implementation == "sdpa"` (this file
    spells it, as Falcon's or Gemma 4's modeling code does): renaming its kernel would change it."""


def test_models_whose_code_tests_for_sdpa_keep_it_and_say_so():
    model = _NamesItsKernel(tiny_model("llama").config)
    assert not use_exact_attention(model)
    assert model.config._attn_implementation == "sdpa"
    assert attention_path(model) == "sdpa (not batch-invariant)"


def test_rows_shorter_and_longer_than_a_key_block_give_plain_decodings_logits(threads):
    """P @ V runs in fixed key blocks: a 100-token row computed beside a 300-token one (its keys then
    span whole blocks read in place) equals the same row alone (one zero-padded block)."""
    model = _exact_model("qwen2")
    prompts = [[(3 * i + r) % 90 + 3 for i in range(n)] for r, n in enumerate((100, 300, 129))]
    plain = [plain_logits(model, p, f[:4]) for p, f in zip(prompts, FOLLOW)]
    layout = RaggedLayout(model, 3, 320)
    first = layout.prefill(prompts)
    logits = layout.forward(torch.tensor([f[:3] for f in FOLLOW]))
    for r in range(3):
        assert torch.equal(first[r], plain[r][0]) and torch.equal(logits[r], plain[r][1:4]), r
