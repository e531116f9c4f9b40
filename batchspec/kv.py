"""The one module that touches transformers' cache API and forward-call conventions.

Pinned to transformers 5.24: its cache API changes between minor versions (`cache=` replaced
`past_key_values=` in 5.24, `cache_position` went away in 5.4, `crop` semantics changed in 5.15).
Everything version-sensitive lives here so that an upgrade is a one-file change.

`SlotStore` is a preallocated KV buffer for every layer of one model, stacked into one tensor of
shape [layers, 2 (k/v), rows, kv_heads, capacity, head_dim]. A forward writes each row's new K/V
at a per-row start slot and attends over slots [0, kv_len) under an explicit 4D mask, so a layout
decides positions, masks and write slots, and moving or dropping data is one tensor op over all
layers at once (no Python loop over layers or rows).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache

from .config import BatchspecError


class _SlotLayer(CacheLayerMixin):
    """Per-layer view onto a SlotStore: transformers calls `update` once per layer per forward."""

    is_croppable = False

    def __init__(self, store: SlotStore, layer: int) -> None:
        super().__init__()
        self._store = store
        self._layer = layer
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Storage is allocated by the store on the first write; nothing to do per layer."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        return self._store.write(self._layer, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._store.kv_len - self._store.kv_start, 0

    def get_seq_length(self) -> int:
        return self._store.kv_len - self._store.kv_start

    def get_max_length(self) -> int:
        return self._store.capacity


class SlotStore:
    """Preallocated K/V for `max_rows` rows of up to `capacity` tokens, all layers stacked."""

    def __init__(self, num_layers: int, max_rows: int, capacity: int) -> None:
        self.num_layers = num_layers
        self.max_rows = max_rows
        self.capacity = capacity
        self.data: torch.Tensor | None = None
        self.cache = Cache(layers=[_SlotLayer(self, i) for i in range(num_layers)])
        # Per-forward addressing, set by `attend` before each model call.
        self.kv_start = 0
        self.kv_len = 0
        self._rows = slice(0, 0)
        self._write_start: int | torch.Tensor = 0

    def _allocate(self, key_states: torch.Tensor) -> None:
        _, heads, _, dim = key_states.shape
        need = self.num_layers * 2 * self.max_rows * heads * self.capacity * dim * key_states.element_size()
        try:
            # zeros, not empty: masked slots are multiplied by 0 in attention and must never hold NaN.
            self.data = torch.zeros(
                (self.num_layers, 2, self.max_rows, heads, self.capacity, dim),
                dtype=key_states.dtype,
                device=key_states.device,
            )
        except (RuntimeError, MemoryError) as err:
            raise BatchspecError(
                f"cannot allocate the KV buffer ({need / 2**30:.1f} GiB for {self.max_rows} rows x "
                f"{self.capacity} tokens): lower --batch-size or --max-new-tokens"
            ) from err

    def attend(self, rows: slice, write_start: int | torch.Tensor, kv_len: int, kv_start: int = 0) -> None:
        """Address the next forward: rows `rows`, new tokens written from `write_start` (one int for
        all rows, or one start per row), attention over slots [kv_start, kv_len) (a left-padded row
        prefilled alone starts after its padding, so no compute is spent on pad slots)."""
        if kv_len > self.capacity:
            raise BatchspecError(f"KV capacity exceeded ({kv_len} > {self.capacity} slots)")
        self._rows = rows
        self._write_start = write_start
        self.kv_start = kv_start
        self.kv_len = kv_len

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.data is None:
            self._allocate(keys)
        assert self.data is not None
        if keys.shape[1] != self.data.shape[3] or keys.shape[3] != self.data.shape[5]:
            raise BatchspecError("models whose layers have different KV head shapes are not supported")
        k_rows = self.data[layer, 0, self._rows]
        v_rows = self.data[layer, 1, self._rows]
        n = keys.shape[2]
        start = self._write_start
        if isinstance(start, int):
            k_rows[:, :, start : start + n] = keys
            v_rows[:, :, start : start + n] = values
        else:
            slots = (start[:, None] + torch.arange(n, device=start.device))[:, None, :, None]
            slots = slots.expand(-1, keys.shape[1], -1, keys.shape[3])
            k_rows.scatter_(2, slots, keys)
            v_rows.scatter_(2, slots, values)
        return k_rows[:, :, self.kv_start : self.kv_len], v_rows[:, :, self.kv_start : self.kv_len]

    @torch.inference_mode()
    def move_rows(self, dst: list[int], src: list[int]) -> None:
        """Copy whole rows (all layers, K and V) from `src` to `dst` indices."""
        if self.data is not None and dst:
            self.data[:, :, dst] = self.data[:, :, src]

    @torch.inference_mode()
    def gather_slots(self, rows: int, index: torch.Tensor) -> None:
        """Rewrite slots [0, L') of rows [0, rows) as slot `index[b, j]` of the same row: the
        realignment of a left-padded layout, one gather over every layer at once. An empty index
        (no rows, or rows that keep no tokens) rewrites nothing."""
        if self.data is None or index.numel() == 0:
            return
        new_len = index.shape[1]
        src_len = int(index.max()) + 1
        src = self.data[:, :, :rows, :, :src_len]
        idx = index.to(src.device)[None, None, :, None, :, None].expand(
            src.shape[0], src.shape[1], rows, src.shape[3], new_len, src.shape[5]
        )
        self.data[:, :, :rows, :, :new_len] = torch.gather(src, 4, idx)

    @torch.inference_mode()
    def copy_rows(self, src: SlotStore, src_rows: torch.Tensor, dst_rows: torch.Tensor, slot_map: torch.Tensor) -> None:
        """Slot j of row dst_rows[b] <- slot slot_map[b, j] of row src_rows[b] in `src`, for j in
        [0, slot_map.shape[1]): moves rows between two stores (of the same model) in one gather.
        An empty slot map (no rows, or rows that keep no tokens, e.g. a drafter's 2-token rows)
        copies nothing."""
        if src.data is None or slot_map.numel() == 0:
            return
        if self.data is None:
            self.data = torch.zeros_like(src.data[:, :, :1]).expand(
                -1, -1, self.max_rows, -1, self.capacity, -1
            ).contiguous()
        width = slot_map.shape[1]
        span = int(slot_map.max()) + 1
        picked = src.data[:, :, :, :, :span].index_select(2, src_rows)
        idx = slot_map[None, None, :, None, :, None].expand(
            picked.shape[0], picked.shape[1], -1, picked.shape[3], -1, picked.shape[5]
        )
        self.data[:, :, dst_rows, :, :width] = torch.gather(picked, 4, idx)

    def row_kv(self, row: int, start: int, length: int) -> torch.Tensor:
        """K/V of one row's slots [start, start+length): [layers, 2, heads, length, dim]."""
        assert self.data is not None
        return self.data[:, :, row, :, start : start + length]


def num_layers(model: torch.nn.Module) -> int:
    return int(model.config.get_text_config().num_hidden_layers)


def embedding_rows(model: torch.nn.Module) -> int:
    """How many token ids the model can take as input (its embedding table's rows)."""
    return int(model.get_input_embeddings().num_embeddings)


def context_limit(model: torch.nn.Module) -> int | None:
    limit = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    return int(limit) if limit else None


def check_supported(model: torch.nn.Module) -> None:
    """Refuse models whose attention our explicit masks would get wrong."""
    config = model.config.get_text_config()
    layer_types = getattr(config, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types) or getattr(config, "use_sliding_window", False):
        raise BatchspecError(
            f"{config.model_type}: sliding-window or non-standard attention layers are not supported yet"
        )


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
    Returns the last position's logits [1, vocab] in float32."""
    out = model(input_ids=input_ids, cache=cache, use_cache=True, logits_to_keep=1)
    return out.logits[:, -1].float()


@torch.inference_mode()
def prefix_kv(model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    """K/V of a prefix computed from scratch, batch 1, on transformers' own DynamicCache, stacked as
    [layers, 2, heads, len, dim] to compare with a SlotStore row."""
    cache = new_dynamic_cache(model)
    forward_plain(model, torch.tensor([token_ids], device=next(model.parameters()).device), cache)
    return torch.stack([torch.stack([layer.keys[0], layer.values[0]]) for layer in cache.layers])


@torch.inference_mode()
def forward_all_positions(model: torch.nn.Module, token_ids: list[int], keep: int) -> torch.Tensor:
    """Logits [keep, vocab] (float32) of the last `keep` positions of one batch-1 forward over
    `token_ids`, on transformers' own DynamicCache and default causal mask.

    Teacher forcing: row i predicts token_ids[len - keep + i + 1] from everything before it, so
    checking a whole continuation costs one forward instead of one decoding step per token.
    """
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
    positions = (attention_mask.cumsum(dim=-1) - 1).clamp(min=0)
    out = model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=False, logits_to_keep=1
    )
    return out.logits[:, -1].float()
