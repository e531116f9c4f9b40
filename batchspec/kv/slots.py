"""`SlotStore`: a preallocated KV buffer for every layer of one model, stacked into one tensor of
shape [layers, 2 (k/v), rows, kv_heads, capacity, head_dim]. A forward writes each row's new K/V at
a per-row start slot and attends over slots [kv_start, kv_len) under an explicit 4D mask, so a layout
decides positions, masks and write slots, and moving or dropping data is one tensor op over all
layers at once (no Python loop over layers or rows).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..errors import BatchspecError


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

    def _allocate(self, heads: int, dim: int, like: torch.Tensor) -> None:
        """The buffer for `heads` K/V heads of `dim`, in `like`'s dtype and device."""
        need = self.num_layers * 2 * self.max_rows * heads * self.capacity * dim * like.element_size()
        try:
            # zeros, not empty: masked slots are multiplied by 0 in attention and must never hold NaN.
            self.data = torch.zeros(
                (self.num_layers, 2, self.max_rows, heads, self.capacity, dim),
                dtype=like.dtype,
                device=like.device,
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
            self._allocate(keys.shape[1], keys.shape[3], keys)
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

    @torch.inference_mode()
    def write_slots(self, row: int, start: int, kv: torch.Tensor) -> None:
        """Slots [start, start + n) of row `row` <- kv [layers, 2, heads, n, dim] (K/V kept elsewhere,
        e.g. a prefix cache's), allocating the buffer if no forward has yet."""
        if self.data is None:
            self._allocate(kv.shape[2], kv.shape[4], kv)
        assert self.data is not None
        self.data[:, :, row, :, start : start + kv.shape[3]] = kv

    def row_kv(self, row: int, start: int, length: int) -> torch.Tensor:
        """K/V of one row's slots [start, start+length): [layers, 2, heads, length, dim]."""
        assert self.data is not None
        return self.data[:, :, row, :, start : start + length]

