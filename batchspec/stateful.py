"""Models with recurrent state (SSM / linear-attention layers) in the usual engine.

The round loop is the engine's, unchanged; what differs is where each model's rows live. The method
registry (`batchspec.methods.build_engine`) asks `layouts_per_model` for a layout factory that puts a
stateful model (target or drafter) on its method's stateful layout and any other model on the
method's usual one, and runs the rounds with `StatefulEngine`, which also reports the time spent
keeping states. `tiny_stateful_model` builds the small random models the tests and scripts use.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    BambaConfig,
    FalconH1Config,
    GraniteMoeHybridConfig,
    Lfm2Config,
    Mamba2Config,
    OlmoHybridConfig,
    PreTrainedConfig,
    PreTrainedModel,
    Qwen3_5TextConfig,
    Qwen3NextConfig,
)

from .config import BatchspecError
from .drafters import ModelDrafter
from .engine import Engine
from .kv import is_stateful
from .layouts import Layout
from .layouts.stateful import StatefulLayout
from .sequence import Sequence

LayoutFactory = Callable[[torch.nn.Module, int, int], Layout]


def layouts_per_model(plain: type[Layout], stateful: type[Layout]) -> LayoutFactory:
    """A layout factory (called like a Layout class) choosing by model: `stateful` for a model with
    recurrent state, `plain` otherwise (an attention drafter of a stateful target keeps its cursors)."""

    def make(model: torch.nn.Module, max_rows: int, capacity: int) -> Layout:
        return (stateful if is_stateful(model) else plain)(model, max_rows, capacity)

    return make


class StatefulEngine(Engine):
    """The usual engine, reporting in `stats.extra["state_time"]` the seconds its stateful layouts
    (target's and drafter's) spent keeping states: a share of prefill, draft, verify and other time."""

    def _setup(self, requests: int, capacity: int) -> None:
        super()._setup(requests, capacity)
        self._state_time_before = self.stats.extra.get("state_time", 0.0)
        self._replays_before = self.stats.extra.get("state_replay_forwards", 0)

    def _admit(self, seqs: list[Sequence], layout: Layout, drafter: Any) -> None:
        super()._admit(seqs, layout, drafter)
        self._record()

    def _round(self, active: list[Sequence]) -> None:
        super()._round(active)
        self._record()

    def _record(self) -> None:
        layouts = [self.target_layout]
        if isinstance(self.drafter, ModelDrafter):
            layouts.append(self.drafter.layout)
        stateful = [layout for layout in layouts if isinstance(layout, StatefulLayout)]
        self.stats.extra["state_time"] = self._state_time_before + sum(s.state_time for s in stateful)
        self.stats.extra["state_replay_forwards"] = self._replays_before + sum(s.replay_forwards for s in stateful)


_ATTENTION = dict(intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
_GATED_DELTANET = dict(head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                       linear_num_value_heads=4, **_ATTENTION)
_MAMBA2_HYBRID = dict(mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_chunk_size=8, **_ATTENTION)

# Per architecture: its config class and the sizes of a tiny instance (hidden size 64).
_TINY: dict[str, tuple[type[PreTrainedConfig], dict[str, Any]]] = {
    "mamba2": (Mamba2Config, dict(num_hidden_layers=2, num_heads=8, head_dim=16, state_size=16, n_groups=2,
                                  chunk_size=8)),
    # three Gated DeltaNet layers, then one attention layer (as in the real models)
    "qwen3_next": (Qwen3NextConfig, dict(num_hidden_layers=4, num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=32, shared_expert_intermediate_size=32,
                                         **_GATED_DELTANET)),
    "qwen3_5_text": (Qwen3_5TextConfig, dict(num_hidden_layers=4, **_GATED_DELTANET)),
    "olmo_hybrid": (OlmoHybridConfig, dict(num_hidden_layers=4, linear_num_key_heads=2, linear_num_value_heads=4,
                                           linear_key_head_dim=16, linear_value_head_dim=16, **_ATTENTION)),
    # every layer runs attention and a Mamba2 mixer side by side
    "falcon_h1": (FalconH1Config, dict(num_hidden_layers=2, mamba_d_ssm=64, mamba_n_heads=8, mamba_d_head=8,
                                       mamba_d_state=16, mamba_chunk_size=8, **_ATTENTION)),
    "granitemoehybrid": (GraniteMoeHybridConfig, dict(num_hidden_layers=4, layer_types=["mamba", "attention"] * 2,
                                                      num_local_experts=4, num_experts_per_tok=2,
                                                      shared_intermediate_size=64, **_MAMBA2_HYBRID)),
    "bamba": (BambaConfig, dict(num_hidden_layers=4, attn_layer_indices=[1], **_MAMBA2_HYBRID)),
    "lfm2": (Lfm2Config, dict(num_hidden_layers=4, full_attn_idxs=[1, 3], **_ATTENTION)),
}
TINY_STATEFUL_ARCHS = tuple(_TINY)


def tiny_stateful_model(arch: str, vocab_size: int = 96, seed: int = 0, init_std: float = 0.5) -> PreTrainedModel:
    """A small random fp32 model with recurrent state: the same `seed` gives the same weights. The
    large `init_std` spreads the logits so that greedy choices have no near-ties (as `tiny_model`).
    Attention is transformers' default (sdpa where the model has attention layers; Mamba2 has none)."""
    if arch not in _TINY:
        raise BatchspecError(f"unknown tiny stateful architecture {arch!r}; choose one of {', '.join(_TINY)}")
    config_class, sizes = _TINY[arch]
    config = config_class(vocab_size=vocab_size, hidden_size=64, initializer_range=init_std, tie_word_embeddings=False,
                          pad_token_id=None, bos_token_id=0, eos_token_id=1, **sizes)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
