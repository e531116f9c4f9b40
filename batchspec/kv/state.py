"""Recurrent and convolution state of stateful targets (SSM and linear-attention layers).

transformers 5.24 keeps a linear-attention / SSM layer's memory in `LinearAttentionCacheLayerMixin`
objects: per layer and state index, a convolution window (`conv_states`: the last `kernel` inputs
of the layer's short causal convolution) and a recurrent state (`recurrent_states`: the SSM or
delta-rule matrix). Mixers read them with `Cache.get_conv_state` / `get_recurrent_state` (None
means "no previous state": the prefill path), write them with `update_conv_state` /
`update_recurrent_state`, and some single-token paths (Mamba2's) update the very tensors they were
handed, in place. Every token fed overwrites that memory, rejected drafts included, and the
library's `crop` cannot undo it: it rolls back the conv window but not the recurrent state
(transformers issue #49036), which is why transformers refuses assisted generation for them.

Here the model never touches a committed state: `StateStore` keeps, per row, the committed state
apart from the working state the model reads and writes during a forward, plus optional per-token
snapshots of the working state, so a layout can keep the state after exactly j accepted tokens.
`StatefulSlotStore` puts a SlotStore (per-row K/V cursors) for the attention layers of hybrid models
and a StateStore for their recurrent layers behind one Cache, so layouts address both alike.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DummyLayer, LinearAttentionCacheLayerMixin

from ..errors import BatchspecError
from ..roles import prompt_pass
from .forward import forward_plain, new_dynamic_cache
from .slots import SlotStore, _SlotLayer
from .support import _layer_types


StateKey = tuple[int, str, int]  # (model layer, "conv" | "recurrent", state index)


class _StateBuffer:
    """One state tensor of one layer for every row: the committed state, the working state the model
    reads and writes, and `steps[t]`, the working state after the t-th token fed since the last commit."""

    def __init__(self, first: torch.Tensor, max_rows: int) -> None:
        shape = (max_rows, *first.shape[1:])
        self.working = first.new_zeros(shape)
        self.committed = first.new_zeros(shape)
        self.steps = first.new_zeros((0, *shape))


class StateStore:
    """Per-row recurrent and convolution states of every stateful layer of one model.

    Buffers are allocated on the model's first write (their shapes and dtypes are the model's own).
    A forward is addressed with `begin(rows, fresh)`: `rows` is a slice (the model reads and writes
    views of the working state in place) or a LongTensor of row indices (the rows are gathered first
    and scattered back by `end`); `fresh` means the rows have no previous state (prefill).
    """

    def __init__(self, max_rows: int) -> None:
        self.max_rows = max_rows
        self.buffers: dict[StateKey, _StateBuffer] = {}
        self._rows: slice | torch.Tensor = slice(0, 0)
        self._fresh = True
        self._views: dict[StateKey, torch.Tensor] = {}

    @property
    def allocated(self) -> bool:
        return bool(self.buffers)

    def begin(self, rows: slice | torch.Tensor, fresh: bool) -> None:
        self._rows, self._fresh, self._views = rows, fresh, {}

    @torch.inference_mode()
    def end(self) -> None:
        """Write gathered rows back (index addressing only; slice views were updated in place)."""
        if not isinstance(self._rows, slice):
            for key, view in self._views.items():
                self.buffers[key].working.index_copy_(0, self._rows, view)
        self._views = {}

    def read(self, key: StateKey) -> torch.Tensor | None:
        """The working state of the addressed rows, or None when they start fresh."""
        if self._fresh or key not in self.buffers:
            return None
        return self._view(key)

    def write(self, key: StateKey, value: torch.Tensor) -> torch.Tensor:
        if key not in self.buffers:
            self.buffers[key] = _StateBuffer(value, self.max_rows)
        view = self._view(key)
        view.copy_(value)
        return view

    def _view(self, key: StateKey) -> torch.Tensor:
        """The same tensor for the whole forward (a mixer may update what it read in place): a view of
        the working state for a slice of rows, a gathered copy (written back by `end`) for indices."""
        if key not in self._views:
            working, rows = self.buffers[key].working, self._rows
            self._views[key] = working[rows] if isinstance(rows, slice) else working.index_select(0, rows)
        return self._views[key]

    # ---- per-row bookkeeping (all buffers at once) ----------------------------------------------
    @torch.inference_mode()
    def snapshot(self, rows: slice, step: torch.Tensor) -> None:
        """Keep the working state of `rows` as the state after their step[b]-th tentative token."""
        need = int(step.max()) + 1
        index = torch.arange(rows.start, rows.stop, device=step.device)
        for buf in self.buffers.values():
            if buf.steps.shape[0] < need:
                grown = buf.working.new_zeros((need, *buf.working.shape))
                grown[: buf.steps.shape[0]] = buf.steps
                buf.steps = grown
            buf.steps[step, index] = buf.working[rows]

    @torch.inference_mode()
    def keep_steps(self, keep: torch.Tensor) -> None:
        """Commit, per row, the snapshot after its keep[b]-th tentative token (keep[b] == 0: the
        committed state stays), then restart the working state from the committed one."""
        rows = keep.nonzero().flatten()
        for buf in self.buffers.values():
            if rows.numel():
                buf.committed[rows] = buf.steps[keep[rows] - 1, rows]
            buf.working.copy_(buf.committed)

    @torch.inference_mode()
    def accept_working(self, rows: torch.Tensor) -> None:
        """The working state of `rows` becomes their committed state."""
        for buf in self.buffers.values():
            buf.committed[rows] = buf.working[rows]

    @torch.inference_mode()
    def restore(self, rows: torch.Tensor) -> None:
        """Rows go back to their committed state."""
        for buf in self.buffers.values():
            buf.working[rows] = buf.committed[rows]

    @torch.inference_mode()
    def clear(self, rows: torch.Tensor) -> None:
        """Rows start from the zero state (a new request in a reused row; nothing of the previous occupant stays)."""
        for buf in self.buffers.values():
            buf.working[rows] = 0
            buf.committed[rows] = 0

    @torch.inference_mode()
    def move_rows(self, dst: list[int], src: list[int]) -> None:
        for buf in self.buffers.values():
            buf.working[dst] = buf.working[src]
            buf.committed[dst] = buf.committed[src]
            buf.steps[:, dst] = buf.steps[:, src]

    def committed(self, row: int) -> dict[StateKey, torch.Tensor]:
        """A row's committed states, keyed like `prefix_state`'s."""
        return {key: buf.committed[row] for key, buf in self.buffers.items()}

    def working(self, kind: str) -> dict[StateKey, torch.Tensor]:
        """Copies of every row's working state of one kind ("conv" or "recurrent")."""
        return {key: buf.working.clone() for key, buf in self.buffers.items() if key[1] == kind}

    @torch.inference_mode()
    def overwrite(self, states: dict[StateKey, torch.Tensor]) -> None:
        """Set committed and working states (every row) to `states` (the deliberately wrong methods)."""
        for key, value in states.items():
            self.buffers[key].committed.copy_(value)
            self.buffers[key].working.copy_(value)


class _StateMap(dict):
    """What a mixer finds in `layer.conv_states[i]` / `recurrent_states[i]`: the store's working
    state of the rows this forward addresses (transformers reads these dicts directly)."""

    def __init__(self, store: StateStore, layer: int, kind: str, count: int) -> None:
        super().__init__()
        self._store, self._layer, self._kind, self._count = store, layer, kind, count

    def __getitem__(self, index: int) -> torch.Tensor | None:
        return self._store.read((self._layer, self._kind, index))

    def __len__(self) -> int:
        return self._count


class _PreviousMap(dict):
    """`layer.has_previous_state[i]`: False while the addressed rows start fresh."""

    def __init__(self, store: StateStore, layer: int) -> None:
        super().__init__()
        self._store, self._layer = store, layer

    def __getitem__(self, index: int) -> bool:
        return self._store.read((self._layer, "conv", index)) is not None or self._store.read(
            (self._layer, "recurrent", index)
        ) is not None


class _StateLayer(LinearAttentionCacheLayerMixin):
    """A linear-attention layer's cache as the model sees it, backed by a StateStore.

    `update_conv_state` returns the previous window followed by the new inputs (what the mixer's
    causal convolution needs) and keeps the last `kernel` inputs, left-padded with zeros when fewer
    were ever fed, exactly as transformers' own `LinearAttentionLayer` does.
    """

    is_croppable = False

    def __init__(self, store: StateStore, layer: int, number_of_states: int = 1) -> None:
        super().__init__(number_of_states)
        self._states = store
        self._layer = layer
        self.conv_states = _StateMap(store, layer, "conv", number_of_states)
        self.recurrent_states = _StateMap(store, layer, "recurrent", number_of_states)
        self.has_previous_state = _PreviousMap(store, layer)

    def lazy_initialization(self, *args: Any, **kwargs: Any) -> None:
        """Buffers are allocated by the store on the first write."""

    def update_conv_state(
        self, conv_states: torch.Tensor, state_idx: int = 0, conv_kernel_size: int | None = None, **kwargs: Any
    ) -> torch.Tensor:
        if conv_kernel_size is None:
            raise BatchspecError("a convolution layer did not give its kernel size; this architecture is not supported")
        previous = self._states.read((self._layer, "conv", state_idx))
        full = conv_states if previous is None else torch.cat([previous, conv_states], dim=-1)
        window = full[..., -conv_kernel_size:]
        if window.shape[-1] < conv_kernel_size:
            window = torch.nn.functional.pad(window, (conv_kernel_size - window.shape[-1], 0))
        self._states.write((self._layer, "conv", state_idx), window)
        return full

    def update_recurrent_state(self, recurrent_states: torch.Tensor, state_idx: int = 0, **kwargs: Any) -> torch.Tensor:
        return self._states.write((self._layer, "recurrent", state_idx), recurrent_states)


class _HybridLayer(_StateLayer, _SlotLayer):
    """A layer with both attention K/V (in the SlotStore) and a recurrent state (Falcon-H1's
    parallel attention + Mamba2 layers)."""

    def __init__(
        self, slots: SlotStore, attention_index: int, store: StateStore, layer: int, number_of_states: int
    ) -> None:
        _StateLayer.__init__(self, store, layer, number_of_states)
        self._store = slots
        self._layer_kv = attention_index
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        return self._store.write(self._layer_kv, key_states, value_states)


class StatefulSlotStore(SlotStore):
    """K/V slots for a stateful model's attention layers plus a StateStore for its recurrent layers,
    behind one Cache whose layer i is what decoder layer i needs.

    Rows are addressed as in SlotStore, or by a LongTensor of row indices: then the attention layers
    read the gathered rows' K/V with the new tokens placed at their slots but store nothing (such a
    forward recomputes tokens whose K/V an earlier forward already wrote), and the states of those
    rows are gathered and written back.
    """

    def __init__(self, model: torch.nn.Module, max_rows: int, capacity: int) -> None:
        types, kwargs = _layer_types(model)
        attention = [i for i, t in enumerate(types) if t in ("full_attention", "hybrid")]
        super().__init__(len(attention), max_rows, capacity)
        self.states = StateStore(max_rows)
        layers: list[Any] = []
        for i, (kind, layer_kwargs) in enumerate(zip(types, kwargs)):
            count = int(layer_kwargs.get("number_of_states", 1))
            if kind == "full_attention":
                layers.append(_SlotLayer(self, attention.index(i)))
            elif kind == "hybrid":
                layers.append(_HybridLayer(self, attention.index(i), self.states, i, count))
            elif kind in ("linear_attention", "conv"):
                layers.append(_StateLayer(self.states, i, count))
            else:
                layers.append(DummyLayer())
        self.cache = Cache(layers=layers)

    def attend(  # type: ignore[override]
        self, rows: slice | torch.Tensor, write_start: int | torch.Tensor, kv_len: int, fresh: bool = False
    ) -> None:
        """As SlotStore.attend, plus the state addressing; `fresh` rows have no previous state."""
        super().attend(rows, write_start, kv_len)  # type: ignore[arg-type]
        self.states.begin(rows, fresh)

    def finish(self) -> None:
        """After the forward: gathered rows' states go back to the store."""
        self.states.end()

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(self._rows, slice):
            return super().write(layer, keys, values)
        assert self.data is not None and isinstance(self._write_start, torch.Tensor)
        n = keys.shape[2]
        slots = (self._write_start[:, None] + torch.arange(n, device=keys.device))[:, None, :, None]
        slots = slots.expand(-1, keys.shape[1], -1, keys.shape[3])
        k_rows = self.data[layer, 0, :, :, : self.kv_len].index_select(0, self._rows).scatter_(2, slots, keys)
        v_rows = self.data[layer, 1, :, :, : self.kv_len].index_select(0, self._rows).scatter_(2, slots, values)
        return k_rows, v_rows

    @torch.inference_mode()
    def move_rows(self, dst: list[int], src: list[int]) -> None:
        super().move_rows(dst, src)
        if dst:
            self.states.move_rows(dst, src)


@torch.inference_mode()
def prefix_state(
    model: torch.nn.Module, token_ids: list[int], prompt_length: int = 0
) -> tuple[torch.Tensor | None, dict[StateKey, torch.Tensor]]:
    """What a fresh batch-1 forward over a prefix (its first `prompt_length` tokens its prompt)
    leaves in the model's own DynamicCache: the K/V of its attention layers stacked as [attention
    layers, 2, heads, len, dim] (None without any), and each stateful layer's states keyed like
    `StateStore.committed`."""
    cache = new_dynamic_cache(model)
    with prompt_pass(prompt_length):
        forward_plain(model, torch.tensor([token_ids], device=next(model.parameters()).device), cache)
    kv, states = [], {}
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, CacheLayerMixin) and getattr(layer, "keys", None) is not None:
            kv.append(torch.stack([layer.keys[0], layer.values[0]]))
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            for s in range(layer.number_of_states):
                if layer.is_conv_states_initialized[s]:
                    states[(i, "conv", s)] = layer.conv_states[s][0]
                if layer.is_recurrent_states_initialized[s]:
                    states[(i, "recurrent", s)] = layer.recurrent_states[s][0]
    return (torch.stack(kv) if kv else None), states

