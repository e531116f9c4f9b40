"""Packed oneDNN linears (`batchspec.kernels`): same products as nn.Linear, exact decoding on top."""

from __future__ import annotations

import copy

import pytest
import torch
from tinyworld import VOCAB_SIZE, perturbed_copy, random_prompts, save_pair, tiny_model

from batchspec.config import BatchspecError, ModelConfig, SamplingParams, SpecConfig
from batchspec.costs import fingerprint
from batchspec.kernels import (
    FEW_ROWS,
    PackedLinear,
    apply_linear_kernel,
    linear_kernel,
    pack_linears,
    unpack_linears,
    unsupported_reason,
)
from batchspec.build import build_engine
from batchspec.kv import is_linear
from batchspec.models import load_model, load_pair, output_vocab_size
from batchspec.reference import greedy_decode

pytestmark = pytest.mark.skipif(unsupported_reason(torch.nn.Linear(2, 2)) is not None,
                                reason="torch build without oneDNN")


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 48), (5, 48), (2, 3, 48), (3, 7, 48)])
def test_packed_linear_computes_what_nn_linear_does(bias, shape):
    torch.manual_seed(0)
    linear = torch.nn.Linear(48, 80, bias=bias)
    x = torch.randn(shape)
    packed = PackedLinear(linear)
    with torch.no_grad():
        torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-5)
    assert (packed.in_features, packed.out_features) == (48, 80)


def test_a_float32_product_of_few_rows_is_each_rows_product_in_a_larger_one():
    """One or two rows are padded to PADDED_ROWS (oneDNN's faster path): each row's output must be
    bit for bit what it is in any larger product, whatever the other rows hold. (At this size oneDNN's
    one-row path rounds differently; smaller layers compute alike either way.)"""
    torch.manual_seed(0)
    packed = PackedLinear(torch.nn.Linear(1536, 1536))
    x = torch.randn(6, 1536)
    with torch.no_grad():
        together = packed(x)
        for rows in range(1, FEW_ROWS):
            assert torch.equal(packed(x[:rows]), together[:rows])
            assert torch.equal(packed(x[None, :rows]), together[None, :rows])  # [batch, tokens, features]
        assert torch.equal(packed(torch.cat([x[:1], -x[1:]]))[:1], together[:1])


def test_packed_linear_in_bfloat16():
    if unsupported_reason(torch.nn.Linear(2, 2).to(torch.bfloat16)) is not None:
        pytest.skip("no bfloat16 oneDNN on this CPU")
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 32).to(torch.bfloat16)
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        out = PackedLinear(linear)(x)
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), linear(x).float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_packing_replaces_every_linear_and_keeps_the_logits(arch):
    model = tiny_model(arch, vocab_size=VOCAB_SIZE)
    reference = copy.deepcopy(model)
    linears = sum(is_linear(m) for m in model.modules())  # GPT-2's blocks are Conv1D, packed as linears
    assert pack_linears(model) == linears > 1
    assert not any(is_linear(m) for m in model.modules())
    assert linear_kernel(model) == "packed" and linear_kernel(reference) == "torch"
    assert output_vocab_size(model) == output_vocab_size(reference)
    ids = torch.tensor([random_prompts(1, [9], seed=2)[0]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("method", ["ragged", "eqspec", "exspec"])
def test_speculation_on_packed_models_equals_plain_decoding_on_them(arch, method):
    """Verify forwards of K + 1 tokens run the packed kernel at another width than plain decoding's
    one token; outputs must still be plain decoding's, token for token."""
    target = tiny_model(arch, vocab_size=VOCAB_SIZE)
    draft = perturbed_copy(target, noise=0.02, seed=1)
    pack_linears(target)
    pack_linears(draft)
    prompts = random_prompts(5, [1, 4, 9, 13, 20], seed=3)
    engine = build_engine(target, SpecConfig(speculation="fixed", method=method, num_draft_tokens=4, batch_size=3), (), draft_model=draft)
    outputs = engine.generate(prompts, SamplingParams(max_new_tokens=14))
    for prompt, seq in zip(prompts, outputs):
        assert seq.generated == greedy_decode(target, prompt, 14)


def test_linear_kernel_choice_when_loading(tmp_path):
    target_dir, draft_dir = save_pair(tmp_path)
    pair = load_pair(ModelConfig(str(target_dir), str(draft_dir)))
    assert linear_kernel(pair.target) == linear_kernel(pair.draft) == "packed"  # auto on CPU
    plain, _ = load_model(str(target_dir), linear_kernel="torch")
    assert linear_kernel(plain) == "torch"
    assert fingerprint(plain) != fingerprint(pair.target)  # cost timings are cached per kernel
    half, _ = load_model(str(target_dir), dtype="float16")  # auto falls back where packing cannot run
    assert linear_kernel(half) == "torch"
    with pytest.raises(BatchspecError, match="packed linears support float32 and bfloat16"):
        load_model(str(target_dir), dtype="float16", linear_kernel="packed")
    with pytest.raises(BatchspecError, match="unknown linear kernel"):
        apply_linear_kernel(plain, "fast")


def test_packed_models_refuse_a_cast_instead_of_computing_garbage():
    model = tiny_model("llama", vocab_size=VOCAB_SIZE)
    pack_linears(model)
    with pytest.raises(BatchspecError, match="cannot change dtype or device"):
        model.to(torch.bfloat16)
    model.to(torch.float32)  # no change: allowed
    model.eval()


def test_unpacking_restores_the_exact_weights():
    model = tiny_model("qwen2", vocab_size=VOCAB_SIZE)
    reference = copy.deepcopy(model)
    pack_linears(model)
    unpack_linears(model)
    assert linear_kernel(model) == "torch"
    for (name, a), (_, b) in zip(model.state_dict().items(), reference.state_dict().items()):
        assert torch.equal(a, b), name


class WeightReadingModel(torch.nn.Module):
    """Modeling code that computes with a linear's weight directly (F.linear on `.weight`)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 8)
        self.head = torch.nn.Linear(8, 10)

    def forward(self, input_ids: torch.Tensor, use_cache: bool = False) -> torch.Tensor:
        return torch.nn.functional.linear(self.embed(input_ids), self.head.weight, self.head.bias)


def test_models_that_compute_with_linear_weights_fall_back_or_are_refused():
    model = WeightReadingModel()
    expected = model(torch.tensor([[1, 2]])).detach()
    assert apply_linear_kernel(model, "auto") == "torch"  # the load-time probe failed; packing undone
    assert linear_kernel(model) == "torch"
    torch.testing.assert_close(model(torch.tensor([[1, 2]])), expected, rtol=0, atol=0)
    with pytest.raises(BatchspecError, match="WeightReadingModel does not run with packed linears"):
        apply_linear_kernel(model, "packed")
    assert linear_kernel(model) == "torch"
