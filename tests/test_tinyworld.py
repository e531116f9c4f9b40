"""The tiny test models themselves: deterministic, varied, and the shapes the suite relies on."""

from __future__ import annotations

import pytest
import torch
from tinyworld import TINY_ARCHS, tiny_model


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_tiny_model_deterministic_and_varied(arch: str) -> None:
    model = tiny_model(arch, seed=1)
    assert model.dtype == torch.float32 and not model.training
    assert model.config._attn_implementation == "sdpa"
    assert model.get_output_embeddings().weight.data_ptr() != model.get_input_embeddings().weight.data_ptr()
    ids = torch.tensor([[0, 11, 42, 7, 90, 3]])
    with torch.no_grad():
        logits = model(ids).logits
        assert logits.shape == (1, 6, 96)
        torch.testing.assert_close(logits, tiny_model(arch, seed=1)(ids).logits, rtol=0, atol=0)
        assert not torch.allclose(logits, tiny_model(arch, seed=2)(ids).logits)
        generated = []
        for _ in range(24):
            token = model(ids).logits[0, -1].argmax().item()
            generated.append(token)
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    assert len(set(generated)) >= 6, generated


def test_tiny_model_gqa_and_bad_arch() -> None:
    assert tiny_model("qwen2").config.num_key_value_heads == 2
    assert tiny_model("llama", layers=1).config.num_hidden_layers == 1
    with pytest.raises(ValueError, match="unknown tiny model architecture"):
        tiny_model("mamba")
