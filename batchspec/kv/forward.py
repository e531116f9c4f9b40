"""How the engine (over a SlotStore) and plain decoding (over transformers' own cache) call a model."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from transformers.cache_utils import CacheLayerMixin, DynamicCache

from ..roles import prompt_pass
from .attention import use_exact_attention
from .slots import SlotStore


def _mask_for(model: torch.nn.Module, visible: torch.Tensor) -> torch.Tensor:
    """sdpa takes a boolean mask (True = attend); eager attention adds the mask to the scores."""
    impl = getattr(model.config, "_attn_implementation", "sdpa")
    if impl == "eager":
        dtype = next(model.parameters()).dtype
        return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill(
            ~visible, torch.finfo(dtype).min
        )
    return visible


@torch.inference_mode()
def forward_slots(
    model: torch.nn.Module,
    store: SlotStore,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    visible: torch.Tensor,
    logits_to_keep: int | torch.Tensor = 0,
) -> torch.Tensor:
    """One forward over a SlotStore already addressed with `store.attend`.

    visible: [b, n, kv_len] boolean, True where query i of row b may attend to slot j.
    Returns logits [b, kept, vocab] in float32.
    """
    out = model(
        input_ids=input_ids,
        position_ids=position_ids,
        attention_mask=_mask_for(model, visible[:, None]),
        cache=store.cache,
        use_cache=True,
        logits_to_keep=logits_to_keep,
    )
    return out.logits.float()


def new_dynamic_cache(model: torch.nn.Module) -> DynamicCache:
    return DynamicCache(config=model.config)


@torch.inference_mode()
def forward_plain(model: torch.nn.Module, input_ids: torch.Tensor, cache: DynamicCache) -> torch.Tensor:
    """Plain batch-1 forward on the library's own cache and masks (the oracle's path).
    Returns the last position's logits [1, vocab] in float32.

    Position ids run on from the cache's length, as `generate` passes them: without them some models
    (Bamba) restart positions at 0 in every cached forward. Caches without attention layers have no
    length (nor any use for positions)."""
    return _forward_cached(model, input_ids, cache, keep=1)[:, -1]


@torch.inference_mode()
def forward_plain_positions(model: torch.nn.Module, input_ids: torch.Tensor, cache: DynamicCache) -> torch.Tensor:
    """`forward_plain`, returning every fed position's logits [n, vocab] (float32) of a batch-1 forward:
    row i predicts the token after input_ids[0, i] (prompt logprobs)."""
    return _forward_cached(model, input_ids, cache, keep=0)[0]


def _forward_cached(model: torch.nn.Module, input_ids: torch.Tensor, cache: DynamicCache, keep: int) -> torch.Tensor:
    """Logits [1, kept, vocab] in float32 of the last `keep` positions (0: all) fed on `cache`."""
    use_exact_attention(model)
    extra: dict[str, torch.Tensor] = {}
    if any(isinstance(layer, CacheLayerMixin) for layer in cache.layers):
        start = cache.get_seq_length()
        extra["position_ids"] = torch.arange(start, start + input_ids.shape[1], device=input_ids.device)[None]
    out = model(input_ids=input_ids, cache=cache, use_cache=True, logits_to_keep=keep, **extra)
    return out.logits.float()


@torch.inference_mode()
def prefix_kv(model: torch.nn.Module, token_ids: list[int], prompt_length: int = 0) -> torch.Tensor:
    """K/V of a prefix computed from scratch, batch 1, on transformers' own DynamicCache, stacked as
    [layers, 2, heads, len, dim] to compare with a SlotStore row; its first `prompt_length` tokens
    are its prompt (`roles.prompt_pass`)."""
    cache = new_dynamic_cache(model)
    with prompt_pass(prompt_length):
        forward_plain(model, torch.tensor([token_ids], device=next(model.parameters()).device), cache)
    return torch.stack([torch.stack([layer.keys[0], layer.values[0]]) for layer in cache.layers])


@torch.inference_mode()
def forward_all_positions(model: torch.nn.Module, token_ids: list[int], keep: int) -> torch.Tensor:
    """Logits [keep, vocab] (float32) of the last `keep` positions of one batch-1 forward over
    `token_ids`, on transformers' own DynamicCache and default causal mask.

    Teacher forcing: row i predicts token_ids[len - keep + i + 1] from everything before it, so
    checking a whole continuation costs one forward instead of one decoding step per token.
    """
    use_exact_attention(model)
    if not 1 <= keep <= len(token_ids):
        raise ValueError(f"keep must be in [1, {len(token_ids)}], got {keep}")
    device = next(model.parameters()).device
    ids = torch.tensor([token_ids], dtype=torch.long, device=device)
    out = model(input_ids=ids, cache=new_dynamic_cache(model), use_cache=True, logits_to_keep=keep)
    return out.logits[0].float()


@torch.inference_mode()
def forward_left_padded(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Last-position logits [b, vocab] (float32) of one left-padded batch, without a cache, the way
    transformers' `generate` batches: positions count real tokens only, pads are masked out."""
    use_exact_attention(model)
    positions = (attention_mask.cumsum(dim=-1) - 1).clamp(min=0)
    out = model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=False, logits_to_keep=1
    )
    return out.logits[:, -1].float()


@contextmanager
def prompt_first_forwards(model: torch.nn.Module) -> Iterator[None]:
    """Within: a forward of `model` on an empty cache (the prompt of transformers' `generate`) is a
    prompt pass (`roles.prompt_pass`) and every later one is not, so transformers' generate
    computes prompt tokens as the engines and plain decoding do."""
    passes = ExitStack()  # the prompt pass of the forward running now, if it is one

    def before(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if cache is None or cache.get_seq_length() == 0:
            passes.enter_context(prompt_pass())

    def after(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        passes.close()

    handles = [model.register_forward_pre_hook(before, with_kwargs=True),
               model.register_forward_hook(after, with_kwargs=True, always_call=True)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
