"""The one package that touches transformers' cache API, attention registry and forward-call
conventions.

Pinned to transformers 5.24: its cache API changes between minor versions (`cache=` replaced
`past_key_values=` in 5.24, `cache_position` went away in 5.4, `crop` semantics changed in 5.15).
Everything version-sensitive lives here so that an upgrade is a change to this package only:
`slots` (the preallocated K/V buffers layouts address), `prefix` (K/V
of prompts prefilled before, reused by new rows), `attention` (the batch-invariant attention
every forward runs), `forward` (how the engine and plain decoding call a model), `state` (recurrent
state of stateful targets) and `support` (what a model is and whether it is supported).
"""

from .attention import EXACT_ATTENTION, attention_path, causal_visible, use_exact_attention
from .forward import (
    forward_all_positions,
    forward_left_padded,
    forward_plain,
    forward_plain_positions,
    forward_slots,
    new_dynamic_cache,
    prefix_kv,
    prompt_first_forwards,
)
from .prefix import PrefixCache
from .slots import SlotStore
from .state import StatefulSlotStore, StateKey, StateStore, prefix_state
from .support import (
    STATEFUL_ARCHITECTURES,
    as_linear,
    check_stateful,
    check_supported,
    context_limit,
    embedding_rows,
    is_linear,
    is_stateful,
    keeps_float32_modules,
    num_layers,
)

__all__ = [
    "EXACT_ATTENTION", "PrefixCache", "STATEFUL_ARCHITECTURES", "SlotStore", "StateKey", "StateStore", "StatefulSlotStore",
    "as_linear", "attention_path", "causal_visible", "check_stateful", "check_supported", "context_limit", "embedding_rows", "forward_all_positions",
    "forward_left_padded", "forward_plain", "forward_plain_positions", "forward_slots", "prompt_first_forwards", "is_linear", "is_stateful", "keeps_float32_modules",
    "new_dynamic_cache", "num_layers",
    "prefix_kv", "prefix_state", "use_exact_attention",
]
