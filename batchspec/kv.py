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

import inspect
import sys
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.cache_utils import (
    Cache,
    CacheLayerMixin,
    DummyLayer,
    DynamicCache,
    LinearAttentionCacheLayerMixin,
    get_layer_types_and_kwargs,
)
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .errors import BatchspecError


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
    """Refuse models whose attention our explicit masks would get wrong (and, for models with
    recurrent state, what `check_stateful` refuses)."""
    if is_stateful(model):
        check_stateful(model)
        return
    config = model.config.get_text_config()
    layer_types = getattr(config, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types) or getattr(config, "use_sliding_window", False):
        raise BatchspecError(
            f"{config.model_type}: sliding-window or non-standard attention layers are not supported yet"
        )


# ---- attention -------------------------------------------------------------------------------------
EXACT_ATTENTION = "batchspec_exact"
# Shapes under which torch's CPU float32 matmul (MKL sgemm) rounds every output element the same way
# whatever else shares the product (measured, and checked on the running CPU by tests/test_kv.py):
# at least 4 rows on the left (1-3 rows take gemv-like kernels that sum in another order), any number
# of columns, and a fixed inner length (its rounding depends on the total inner length, so P @ V runs
# in fixed blocks of keys summed in order).
_MIN_QUERY_ROWS = 8
_KEY_BLOCK = 128


class _KeyPlan:
    """Which slots each row's queries read, compacted: slot order[b, j] becomes key j of row b, the
    row's visible slots first in slot order, so key j is the row's j-th token as in plain decoding's
    cache. None when every row's visible slots already are [0, count) (ragged rows, plain decoding)."""

    def __init__(self, visible: torch.Tensor) -> None:
        seen = visible.any(dim=1)  # [b, l] slots some query of the row attends to
        count = seen.sum(dim=-1)
        self.width = max(int(count.max()), 1)
        prefix = torch.arange(seen.shape[-1], device=seen.device)[None] < count[:, None]
        self.order = None if bool(torch.equal(seen, prefix)) else torch.argsort(
            (~seen).to(torch.int8), dim=-1, stable=True)[:, : self.width]


_plan_memo: dict[str, Any] = {"mask": None, "plan": None}


def _key_plan(attention_mask: torch.Tensor, visible: torch.Tensor) -> _KeyPlan:
    """Every layer of a forward gets the same mask object: plan once per forward, not per layer."""
    if _plan_memo["mask"] is not attention_mask:
        _plan_memo.update(mask=attention_mask, plan=_KeyPlan(visible))
    return _plan_memo["plan"]


def _exact_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Softmax attention whose result for a query depends only on that query and the keys it sees,
    not on which rows, queries or masked slots share the forward: a one-token step, a K+1-token
    verify, a catch-up, a chunked or padded prefill and plain decoding's own forwards give a row the
    same bits (torch's fused SDPA kernel blocks queries and keys by the shapes it is given, so they
    round differently). Every row's visible keys are compacted to the front (`_KeyPlan`), key j
    being the row's j-th token wherever its slot was; scores come from one matmul with at least
    _MIN_QUERY_ROWS rows, the softmax runs along rows padded with -inf to whole blocks and aligned at
    key 0 (its vector sums add the padding's zeros lane by lane, which changes nothing), and P @ V runs
    in _KEY_BLOCK-key blocks (the last one zero-padded) added in key order. Grouped K/V heads are read in place (query heads folded onto their K/V head).

    query [b, hq, m, d]; key, value [b, hkv, l, d]; attention_mask [b, 1, m, l] bool (True: attend)
    or None (causal: query i sees keys [0, l - m + i]). Returns [b, m, hq, d] as transformers wants."""
    b, hq, m, d = query.shape
    hkv, l = key.shape[1], key.shape[2]
    g = hq // hkv
    if attention_mask is None:  # plain decoding's cache: every row's keys are its tokens, from slot 0
        width, order = l, None
        positions = torch.arange(l, device=query.device)
        visible = (positions[None] <= positions[l - m :, None])[None].expand(b, m, l)
    else:
        visible = attention_mask[:, 0].expand(b, m, l)
        plan = _key_plan(attention_mask, visible)
        width, order = plan.width, plan.order
    if order is not None:
        index = order[:, None, :, None].expand(b, hkv, width, d)
        key, value = key.gather(2, index), value.gather(2, index)
        visible = visible.gather(2, order[:, None, :].expand(b, m, width))
    else:
        key, value, visible = key[:, :, :width], value[:, :, :width], visible[..., :width]
    full, tail = divmod(width, _KEY_BLOCK)
    blocks = full + (tail > 0)
    padded = blocks * _KEY_BLOCK
    rows = max(g * m, _MIN_QUERY_ROWS)
    q = torch.nn.functional.pad(query.reshape(b, hkv, g * m, d), (0, 0, 0, rows - g * m))  # [b, hkv, R, d]
    sees = visible[:, None, None].expand(b, 1, g, m, width).reshape(b, 1, g * m, width)
    sees = torch.nn.functional.pad(sees, (0, padded - width, 0, rows - g * m), value=False)
    sees[..., 0] |= ~sees.any(dim=-1)  # a query that sees nothing (padding) reads key 0, not NaN
    scale = scaling if scaling is not None else d ** -0.5
    key = torch.nn.functional.pad(key, (0, 0, 0, padded - width))  # [b, hkv, L, d]: MKL rounds few columns otherwise
    scores = (q @ key.transpose(-1, -2)) * scale  # [b, hkv, R, L]
    probs = torch.softmax(scores.masked_fill_(~sees, float("-inf")), dim=-1)
    probs = probs.view(b, hkv, rows, blocks, _KEY_BLOCK).transpose(2, 3).contiguous()  # [b, hkv, blocks, R, B]
    parts = []  # [b, hkv, *, R, d]: full blocks straight from the K/V buffer, the last one zero-padded
    if full:
        parts.append(probs[:, :, :full] @ value[:, :, : full * _KEY_BLOCK].reshape(b, hkv, full, _KEY_BLOCK, d))
    if tail:
        last = torch.nn.functional.pad(value[:, :, full * _KEY_BLOCK :], (0, 0, 0, _KEY_BLOCK - tail))
        parts.append(probs[:, :, full:] @ last[:, :, None])
    blocks_out = [part[:, :, i] for part in parts for i in range(part.shape[2])]  # in key order
    out = blocks_out[0]
    for block in blocks_out[1:]:
        out = out + block
    out = out[:, :, : g * m].reshape(b, hkv, g, m, d).reshape(b, hq, m, d)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(EXACT_ATTENTION, _exact_attention)
AttentionMaskInterface.register(EXACT_ATTENTION, sdpa_mask)  # boolean masks, as "sdpa" builds them


def use_exact_attention(model: torch.nn.Module) -> bool:
    """Run `model`'s attention through `_exact_attention` (idempotent); False when the model keeps its
    own, not batch-invariant: code that branches on the name of its attention (Falcon's hand-written
    SDPA call, GPT-2's upcast eager attention), or logit soft-capping and attention sinks, which the exact path does not compute."""
    impl = getattr(model.config, "_attn_implementation", None)
    if impl == EXACT_ATTENTION:
        return True
    if model.__dict__.get("_batchspec_keeps_attention"):  # checked before (reading its source is slow)
        return False
    model.__dict__["_batchspec_keeps_attention"] = True
    config = model.config.get_text_config()
    if impl not in ("sdpa", "eager") or getattr(config, "attn_logit_softcapping", None):
        return False
    if any(isinstance(getattr(m, "sinks", None), torch.Tensor) for m in model.modules()):
        return False
    try:
        source = inspect.getsource(sys.modules[type(model).__module__])
    except (KeyError, OSError, TypeError):  # code without a source file to read: keep what it has
        return False
    if f'_attn_implementation == "{impl}"' in source:  # its code does something of its own under that name
        return False
    model.set_attn_implementation(EXACT_ATTENTION)
    del model.__dict__["_batchspec_keeps_attention"]
    return True


def attention_path(model: torch.nn.Module) -> str:
    """What the summary reports: "exact" (batch-invariant, `_exact_attention`) or the model's own."""
    impl = getattr(model.config, "_attn_implementation", None) or "none"
    return "exact" if impl == EXACT_ATTENTION else f"{impl} (not batch-invariant)"


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
    use_exact_attention(model)
    extra: dict[str, torch.Tensor] = {}
    if any(isinstance(layer, CacheLayerMixin) for layer in cache.layers):
        start = cache.get_seq_length()
        extra["position_ids"] = torch.arange(start, start + input_ids.shape[1], device=input_ids.device)[None]
    out = model(input_ids=input_ids, cache=cache, use_cache=True, logits_to_keep=1, **extra)
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


# =================================================================================================
# Recurrent and convolution state (stateful targets: SSM and linear-attention layers)
# =================================================================================================
#
# transformers 5.24 keeps a linear-attention / SSM layer's memory in `LinearAttentionCacheLayerMixin`
# objects: per layer and state index, a convolution window (`conv_states`: the last `kernel` inputs
# of the layer's short causal convolution) and a recurrent state (`recurrent_states`: the SSM or
# delta-rule matrix). Mixers read them with `Cache.get_conv_state` / `get_recurrent_state` (None
# means "no previous state": the prefill path), write them with `update_conv_state` /
# `update_recurrent_state`, and some single-token paths (Mamba2's) update the very tensors they were
# handed, in place. Every token fed overwrites that memory, rejected drafts included, and the
# library's `crop` cannot undo it: it rolls back the conv window but not the recurrent state
# (transformers issue #49036), which is why transformers refuses assisted generation for them.
#
# Here the model never touches a committed state: `StateStore` keeps, per row, the committed state
# apart from the working state the model reads and writes during a forward, plus optional per-token
# snapshots of the working state, so a layout can keep the state after exactly j accepted tokens.
# `StatefulSlotStore` puts a SlotStore (per-row K/V cursors) for the attention layers of hybrid models
# and a StateStore for their recurrent layers behind one Cache, so layouts address both alike.

# Architectures whose recurrent layers were checked on transformers 5.24 / torch 2.13 CPU
# (docs/stateful.md): a prefill plus multi-token and single-token cached forwards on the model's own
# cache reproduce one full forward, and the layer types below are all they contain.
STATEFUL_ARCHITECTURES = (
    "mamba2",  # pure state space (Mamba2 mixers)
    "qwen3_next",  # Gated DeltaNet + attention (the SpecLA family)
    "qwen3_5_text",  # Gated DeltaNet + attention
    "olmo_hybrid",  # Gated DeltaNet + attention
    "falcon_h1",  # attention and a Mamba2 mixer side by side in every layer
    "granitemoehybrid",  # Mamba2 + attention (Granite 4)
    "bamba",  # Mamba2 + attention
    "lfm2",  # short convolutions (a conv state, no recurrent state) + attention
)

# Checked and found wrong on transformers 5.24 CPU: refused with the reason, never decoded.
_STATEFUL_REFUSED = {
    "mamba": "multi-token cached forwards restart the SSM scan instead of continuing the cached state "
             "(transformers 5.24), so a verification forward cannot be exact",
    "falcon_mamba": "multi-token cached forwards restart the SSM scan instead of continuing the cached state "
                    "(transformers 5.24), so a verification forward cannot be exact",
    "jamba": "its Mamba layers' multi-token cached forwards restart the SSM scan instead of continuing the "
             "cached state (transformers 5.24), so a verification forward cannot be exact",
    "nemotron_h": "its Mamba2 layers clamp dt at time_step_min in multi-token forwards but not in single-token "
                  "steps (transformers 5.24), so verification and plain decoding disagree",
    "zamba2": "its single-token steps disagree with its multi-token forwards (dt clamped at time_step_min in one "
              "path only, and more; transformers 5.24), so verification and plain decoding disagree",
}

# Cache layer types (transformers' names) that keep state instead of, or besides, K/V; and those a
# stateful model may consist of here (a sliding-window hybrid would need a sliding K/V window).
_STATE_LAYER_TYPES = ("linear_attention", "conv", "hybrid", "hybrid_sliding")
_STATEFUL_LAYER_TYPES = ("full_attention", "dummy", "linear_attention", "conv", "hybrid")


def _layer_types(model: torch.nn.Module) -> tuple[list[str], list[dict[str, Any]]]:
    """Cache layer type of each decoder layer, exactly as the model's own DynamicCache chooses them."""
    return get_layer_types_and_kwargs(model.config.get_text_config(decoder=True))


def is_stateful(model: torch.nn.Module) -> bool:
    """Whether some layer keeps a recurrent or convolution state instead of (or besides) K/V."""
    return any(t in _STATE_LAYER_TYPES for t in _layer_types(model)[0])


def check_stateful(model: torch.nn.Module) -> None:
    """Refuse, with one line, a stateful model whose state this library cannot keep exactly."""
    kind = model.config.get_text_config().model_type
    if kind in _STATEFUL_REFUSED:
        raise BatchspecError(f"{kind}: {_STATEFUL_REFUSED[kind]}")
    if kind not in STATEFUL_ARCHITECTURES:
        raise BatchspecError(
            f"{kind}: models with recurrent state are supported for {', '.join(STATEFUL_ARCHITECTURES)} only "
            f"(the architectures checked on transformers 5.24, docs/stateful.md)"
        )
    odd = sorted(set(_layer_types(model)[0]) - set(_STATEFUL_LAYER_TYPES))
    if odd:
        raise BatchspecError(f"{kind}: layer types {', '.join(odd)} are not supported with recurrent state")
    for module in model.modules():
        limit = getattr(module, "time_step_limit", None)
        if limit is not None and tuple(float(x) for x in limit) != (0.0, float("inf")):
            raise BatchspecError(
                f"{kind}: time_step_limit {tuple(limit)} is applied by multi-token forwards but not by single-token "
                "steps in transformers 5.24, so verification and plain decoding disagree"
            )


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
    model: torch.nn.Module, token_ids: list[int]
) -> tuple[torch.Tensor | None, dict[StateKey, torch.Tensor]]:
    """What a fresh batch-1 forward over a prefix leaves in the model's own DynamicCache: the K/V of
    its attention layers stacked as [attention layers, 2, heads, len, dim] (None without any), and
    each stateful layer's states keyed like `StateStore.committed`."""
    cache = new_dynamic_cache(model)
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
