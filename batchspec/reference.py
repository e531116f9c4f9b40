"""The oracle: plain autoregressive decoding of one prompt alone (batch 1, no speculation).

Deliberately independent of the engine: it uses transformers' own DynamicCache, default positions
and default causal masks, so a bug in our layouts cannot hide by being repeated here.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .config import BatchspecError, SamplingParams
from .kv import forward_plain, new_dynamic_cache
from .sampling import filter_logits, gumbel_argmax, keyed_gumbel


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


@torch.inference_mode()
def sample_decode(
    model: torch.nn.Module, prompt_ids: list[int], params: SamplingParams, stop_ids: Iterable[int] = ()
) -> list[int]:
    """Plain seeded sampling: the token at generated position t is the Gumbel-max sample of the
    filtered logits with noise keyed by (params.seed, t), exactly as the engine's coupled rule defines
    it. The sampling math is shared with the engine on purpose (it is the definition of the output);
    what stays independent is everything that produces the logits."""
    if params.seed is None:
        raise BatchspecError(
            "sampling without a seed has no single reference output: give the request a seed to compare "
            "token by token, or compare distributions with `batchspec verify-distribution`"
        )
    stop = set(stop_ids)
    device = next(model.parameters()).device
    cache = new_dynamic_cache(model)
    logits = forward_plain(model, torch.tensor([prompt_ids], device=device), cache)
    generated: list[int] = []
    while True:
        scores = filter_logits(logits, [params])
        noise = keyed_gumbel([(params.seed, len(generated))], scores.shape[-1]).to(device)
        token = int(gumbel_argmax(scores, noise))
        generated.append(token)
        if token in stop or len(generated) >= params.max_new_tokens:
            return generated
        logits = forward_plain(model, torch.tensor([[token]], device=device), cache)


def reference_decode(
    model: torch.nn.Module, prompt_ids: list[int], params: SamplingParams, stop_ids: Iterable[int] = ()
) -> list[int]:
    """What plain decoding of this prompt alone produces under `params` (the oracle for any run).
    Unseeded sampling has no single answer and raises BatchspecError."""
    stop = set(stop_ids) | set(params.stop_token_ids)
    if params.greedy:
        return greedy_decode(model, prompt_ids, params.max_new_tokens, stop)
    return sample_decode(model, prompt_ids, params, stop)
