"""The oracle: plain autoregressive decoding of one prompt alone (batch 1, no speculation).

Deliberately independent of the engine's bookkeeping: it uses transformers' own DynamicCache,
default positions and default causal masks, so a bug in our layouts cannot hide by being repeated
here. What it shares is the arithmetic: the same weights and the same batch-invariant attention
(`kv.use_exact_attention`), so a row's logits in any engine equal these bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from .config import BatchspecError, SamplingParams
from .kv import forward_plain, new_dynamic_cache
from .sampling import filter_logits, gumbel_argmax, keyed_gumbel


@torch.inference_mode()
def _decode(
    model: torch.nn.Module,
    prompt_ids: list[int],
    max_new_tokens: int,
    stop_ids: Iterable[int],
    choose: Callable[[torch.Tensor, int], int],
) -> list[int]:
    """The plain loop: prefill, then one token at a time; `choose(logits [1, vocab], t)` picks the
    token at generated position t. Stops after the first stop token or max_new_tokens."""
    stop = set(stop_ids)
    device = next(model.parameters()).device
    cache = new_dynamic_cache(model)
    logits = forward_plain(model, torch.tensor([prompt_ids], device=device), cache)
    generated: list[int] = []
    while True:
        token = choose(logits, len(generated))
        generated.append(token)
        if token in stop or len(generated) >= max_new_tokens:
            return generated
        logits = forward_plain(model, torch.tensor([[token]], device=device), cache)


def greedy_decode(
    model: torch.nn.Module, prompt_ids: list[int], max_new_tokens: int, stop_ids: Iterable[int] = ()
) -> list[int]:
    """Greedy continuation of `prompt_ids`, up to and including the first stop token."""
    return _decode(model, prompt_ids, max_new_tokens, stop_ids, lambda logits, t: int(logits.argmax(dim=-1)))


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

    def choose(logits: torch.Tensor, t: int) -> int:
        scores = filter_logits(logits, [params])
        return int(gumbel_argmax(scores, keyed_gumbel([(params.seed, t)], scores.shape[-1]).to(logits.device)))

    return _decode(model, prompt_ids, params.max_new_tokens, stop_ids, choose)


def reference_decode(
    model: torch.nn.Module, prompt_ids: list[int], params: SamplingParams, stop_ids: Iterable[int] = ()
) -> list[int]:
    """What plain decoding of this prompt alone produces under `params` (the oracle for any run).
    Unseeded sampling has no single answer and raises BatchspecError."""
    stop = set(stop_ids) | set(params.stop_token_ids)
    if params.greedy:
        return greedy_decode(model, prompt_ids, params.max_new_tokens, stop)
    return sample_decode(model, prompt_ids, params, stop)
