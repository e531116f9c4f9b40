"""Which transformers architectures with recurrent state continue their state exactly on CPU.

    PYTHONPATH=. python scripts/stateful_probe.py [model_type ...]

For a tiny random config of each candidate, compares the logits of one full forward over 23 tokens
with (a) a prefill of 7 tokens, then multi-token and single-token forwards on the model's own cache
(DynamicCache(config), what its `generate` uses), and (b) the prefill then single-token steps only,
each once with explicit position ids and once without (as a caller relying on the model's defaults).
Errors are max |logit difference| relative to the largest logit; ~1e-5 is float32 noise. The last
column says whether batchspec accepts the model (`batchspec.kv.check_supported`). Rerun it after a
transformers upgrade: docs/stateful.md records the findings on transformers 5.24 / torch 2.13 CPU.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
import transformers as tf
from transformers import AutoModelForCausalLM, DynamicCache

from batchspec.config import BatchspecError
from batchspec.kv import check_supported

V = 64
SMALL = dict(vocab_size=V, initializer_range=0.5, pad_token_id=None, tie_word_embeddings=False)
ATTN = dict(intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)

CANDIDATES: dict[str, Callable[[], tf.PreTrainedConfig]] = {
    "mamba2": lambda: tf.Mamba2Config(hidden_size=64, num_heads=8, head_dim=16, state_size=16, n_groups=2,
                                      num_hidden_layers=2, chunk_size=8, **SMALL),
    "mamba": lambda: tf.MambaConfig(hidden_size=64, state_size=8, num_hidden_layers=2, **SMALL),
    "falcon_mamba": lambda: tf.FalconMambaConfig(hidden_size=64, state_size=8, num_hidden_layers=2, **SMALL),
    "qwen3_next": lambda: tf.Qwen3NextConfig(hidden_size=64, num_hidden_layers=4, head_dim=16, linear_key_head_dim=16,
                                             linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                                             num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                             shared_expert_intermediate_size=32, **ATTN, **SMALL),
    "qwen3_5_text": lambda: tf.Qwen3_5TextConfig(hidden_size=64, num_hidden_layers=4, head_dim=16,
                                                 linear_key_head_dim=16, linear_value_head_dim=16,
                                                 linear_num_key_heads=2, linear_num_value_heads=4, **ATTN, **SMALL),
    "olmo_hybrid": lambda: tf.OlmoHybridConfig(hidden_size=64, num_hidden_layers=4, linear_num_key_heads=2,
                                               linear_num_value_heads=4, linear_key_head_dim=16,
                                               linear_value_head_dim=16, eos_token_id=1, **ATTN, **SMALL),
    "falcon_h1": lambda: tf.FalconH1Config(hidden_size=64, num_hidden_layers=2, mamba_d_ssm=64, mamba_n_heads=8,
                                           mamba_d_head=8, mamba_d_state=16, mamba_chunk_size=8, **ATTN, **SMALL),
    "bamba": lambda: tf.BambaConfig(hidden_size=64, num_hidden_layers=4, attn_layer_indices=[1], mamba_n_heads=8,
                                    mamba_d_head=16, mamba_d_state=16, mamba_chunk_size=8, **ATTN, **SMALL),
    "granitemoehybrid": lambda: tf.GraniteMoeHybridConfig(
        hidden_size=64, num_hidden_layers=4, layer_types=["mamba", "attention", "mamba", "attention"], mamba_n_heads=8,
        mamba_d_head=16, mamba_d_state=16, mamba_chunk_size=8, num_local_experts=4, num_experts_per_tok=2,
        shared_intermediate_size=64, **ATTN, **SMALL),
    "zamba2": lambda: tf.Zamba2Config(hidden_size=64, num_hidden_layers=4, layers_block_type=["mamba", "hybrid"] * 2,
                                      mamba_d_state=16, n_mamba_heads=4, num_attention_heads=4, chunk_size=8,
                                      max_position_embeddings=512, **SMALL),
    "nemotron_h": lambda: tf.NemotronHConfig(hidden_size=64, num_hidden_layers=4,
                                             layers_block_type=["mamba", "attention", "mamba", "mlp"], head_dim=16,
                                             ssm_state_size=16, mamba_num_heads=8, mamba_head_dim=16, n_groups=2,
                                             chunk_size=8, **ATTN, **SMALL),
    "lfm2": lambda: tf.Lfm2Config(hidden_size=64, num_hidden_layers=4, full_attn_idxs=[1, 3], **ATTN, **SMALL),
    "minimax": lambda: tf.MiniMaxConfig(hidden_size=64, num_hidden_layers=2, head_dim=16, num_local_experts=2,
                                        num_experts_per_tok=1, **ATTN, **SMALL),
    "jamba": lambda: tf.JambaConfig(hidden_size=64, num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1,
                                    expert_layer_period=2, num_experts=2, mamba_d_state=8, **ATTN, **SMALL),
}


@torch.inference_mode()
def cached_error(model: torch.nn.Module, ids: torch.Tensor, chunks: list[int], positions: bool) -> float:
    """Relative max logit error of cached forwards of `chunks` tokens each against one full forward."""
    full = model(input_ids=ids).logits
    cache, pos, parts = DynamicCache(config=model.config), 0, []
    for n in chunks:
        extra = {"position_ids": torch.arange(pos, pos + n)[None]} if positions else {}
        parts.append(model(input_ids=ids[:, pos : pos + n], cache=cache, use_cache=True, **extra).logits)
        pos += n
    return float((torch.cat(parts, dim=1) - full).abs().max() / full.abs().max())


def main() -> None:
    torch.set_num_threads(1)
    wanted = sys.argv[1:] or list(CANDIDATES)
    ids = torch.randint(3, V, (1, 23), generator=torch.Generator().manual_seed(1))
    multi, single = [7, 3, 1, 4, 2, 1, 1, 3, 1], [7] + [1] * 16
    print(f"{'model_type':18s} {'multi+pos':>10s} {'single+pos':>10s} {'multi':>10s} {'single':>10s}  batchspec")
    for name in wanted:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(CANDIDATES[name](), dtype=torch.float32).eval()
        try:
            errors = " ".join(f"{cached_error(model, ids, chunks, positions):10.1e}"
                              for positions in (True, False) for chunks in (multi, single))
        except ValueError as err:  # e.g. a model with a cache class of its own
            errors = f"{'cannot run on DynamicCache: ' + str(err)[:60]:43s}"
        try:
            check_supported(model)
            verdict = "supported"
        except BatchspecError as err:
            verdict = f"refused: {err}"
        print(f"{name:18s} {errors}  {verdict}")


if __name__ == "__main__":
    main()
