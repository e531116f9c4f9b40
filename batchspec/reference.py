"""The oracle: plain autoregressive decoding of one prompt alone (batch 1, no speculation).

Deliberately independent of the engine: it uses transformers' own DynamicCache, default positions
and default causal masks, so a bug in our layouts cannot hide by being repeated here.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .config import SamplingParams
from .kv import forward_plain, new_dynamic_cache


@torch.inference_mode()
def greedy_decode(
    model: torch.nn.Module, prompt_ids: list[int], max_new_tokens: int, stop_ids: Iterable[int] = ()
) -> list[int]:
    """Greedy continuation of `prompt_ids`, up to and including the first stop token."""
    stop = set(stop_ids)
    device = next(model.parameters()).device
    cache = new_dynamic_cache(model)
    logits = forward_plain(model, torch.tensor([prompt_ids], device=device), cache)
    generated: list[int] = []
    while True:
        token = int(logits.argmax(dim=-1))
        generated.append(token)
        if token in stop or len(generated) >= max_new_tokens:
            return generated
        logits = forward_plain(model, torch.tensor([[token]], device=device), cache)


def reference_decode(
    model: torch.nn.Module, prompt_ids: list[int], params: SamplingParams, stop_ids: Iterable[int] = ()
) -> list[int]:
    """What plain decoding of this prompt alone produces under `params` (the oracle for any run)."""
    stop = set(stop_ids) | set(params.stop_token_ids)
    if params.greedy:
        return greedy_decode(model, prompt_ids, params.max_new_tokens, stop)
    raise NotImplementedError("seeded sampling oracle")
