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
from transformers import AutoModelForCausalLM, FalconH1Config, Mamba2Config, PreTrainedConfig, PreTrainedModel, Qwen3NextConfig

from .config import BatchspecError
from .drafters import ModelDrafter
from .engine import Engine
from .kv import is_stateful
from .layouts import Layout
from .layouts.stateful import StatefulLayout
from .sequence import Sequence

LayoutFactory = Callable[[torch.nn.Module, int, int], Layout]

TINY_STATEFUL_ARCHS = ("mamba2", "qwen3_next", "falcon_h1")


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


def _tiny_stateful_config(arch: str, vocab_size: int, init_std: float) -> PreTrainedConfig:
    common: dict[str, Any] = {
        "vocab_size": vocab_size,
        "initializer_range": init_std,
        "tie_word_embeddings": False,
        "pad_token_id": None,
        "bos_token_id": 0,
        "eos_token_id": 1,
    }
    if arch == "mamba2":
        return Mamba2Config(hidden_size=64, num_heads=8, head_dim=16, state_size=16, n_groups=2, expand=2,
                            num_hidden_layers=2, chunk_size=8, **common)
    if arch == "qwen3_next":  # three Gated DeltaNet layers, then one attention layer
        return Qwen3NextConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16,
                               linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2,
                               moe_intermediate_size=32, shared_expert_intermediate_size=32,
                               max_position_embeddings=512, **common)
    if arch == "falcon_h1":  # every layer runs attention and a Mamba2 mixer side by side
        return FalconH1Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, mamba_d_ssm=64, mamba_n_heads=8, mamba_d_head=8, mamba_d_state=16,
                              mamba_chunk_size=8, max_position_embeddings=512, **common)
    raise BatchspecError(f"unknown tiny stateful architecture {arch!r}; choose one of {', '.join(TINY_STATEFUL_ARCHS)}")


def tiny_stateful_model(arch: str, vocab_size: int = 96, seed: int = 0, init_std: float = 0.5) -> PreTrainedModel:
    """A small random fp32 model with recurrent state: the same `seed` gives the same weights. The
    large `init_std` spreads the logits so that greedy choices have no near-ties (as `tiny_model`).
    Attention is transformers' default (sdpa where the model has attention layers; Mamba2 has none)."""
    config = _tiny_stateful_config(arch, vocab_size, init_std)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
