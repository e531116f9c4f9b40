"""The attention every forward runs: batch-invariant, registered with transformers by name."""

from __future__ import annotations

import inspect
import sys
import threading
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask


EXACT_ATTENTION = "batchspec_exact"
# Shapes under which torch's CPU float32 matmul (MKL sgemm) rounds every output element the same way
# whatever else shares the product (measured, and checked on the running CPU by tests/test_kv.py):
# at least 4 rows on the left (1-3 rows take gemv-like kernels that sum in another order; 8 leaves a
# margin), a whole key block or more of columns (a few dozen columns took another kernel), and a
# fixed inner length (its rounding depends on the total inner length, so P @ V runs in fixed blocks
# of keys added in order).
_MIN_QUERY_ROWS = 8
_KEY_BLOCK = 128


def causal_visible(positions: torch.Tensor, kv_len: int) -> torch.Tensor:
    """Query i of row b sees slot j iff j <= positions[b, i]: causal attention over a row's slots
    [0, kv_len) when slot j holds its token j (ragged and stateful rows, plain decoding). The padded
    rectangle passes its queries' slots instead and masks its pads itself."""
    return torch.arange(kv_len, device=positions.device)[None, None, :] <= positions[:, :, None]  # [b, n, kv_len]


class _KeyPlan:
    """What every layer of one forward shares: which slots each row's queries read, compacted (slot
    order[b, j] becomes key j of row b, the row's visible slots first in slot order, so key j is the
    row's j-th token as in plain decoding's cache; None when every row's visible slots already are
    [0, width): ragged rows, plain decoding), the key blocks, and the padded visibility `sees`
    [b, 1, R, L] of the R >= _MIN_QUERY_ROWS query rows (query heads folded onto their K/V head)."""

    def __init__(self, visible: torch.Tensor, groups: int) -> None:
        b, m, slots = visible.shape  # visible [b, m, slots]: query i of row b sees slot j
        seen = visible.any(dim=1)  # [b, slots] slots some query of the row attends to
        count = seen.sum(dim=-1)
        self.width = max(int(count.max()), 1)
        prefix = torch.arange(slots, device=seen.device)[None] < count[:, None]
        self.order = None if bool(torch.equal(seen, prefix)) else torch.argsort(
            (~seen).to(torch.int8), dim=-1, stable=True)[:, : self.width]
        if self.order is None:
            visible = visible[..., : self.width]
        else:
            visible = visible.gather(2, self.order[:, None, :].expand(b, m, self.width))
        self.full, self.tail = divmod(self.width, _KEY_BLOCK)
        self.blocks = self.full + (self.tail > 0)
        self.padded = self.blocks * _KEY_BLOCK
        self.rows = max(groups * m, _MIN_QUERY_ROWS)
        sees = visible[:, None, None].expand(b, 1, groups, m, self.width).reshape(b, 1, groups * m, self.width)
        sees = torch.nn.functional.pad(sees, (0, self.padded - self.width, 0, self.rows - groups * m), value=False)
        sees[..., 0] |= ~sees.any(dim=-1)  # a query that sees nothing (padding) reads key 0, not NaN
        self.hidden = ~sees  # [b, 1, R, L] the scores to mask


_memo = threading.local()  # per thread (a server's engine loop and a test's oracle may run at once)


def _key_plan(attention_mask: torch.Tensor | None, b: int, m: int, slots: int, groups: int,
              device: torch.device) -> _KeyPlan:
    """Plan once per forward, not per layer: every layer of a forward gets the same mask object (the
    memo holds it, so no later mask can be the same object), or none (causal: the shape says it all)."""
    if attention_mask is None:  # plain decoding's cache: every row's keys are its tokens, from slot 0
        key: object = (b, m, slots, groups, device)
        cached, plan = getattr(_memo, "causal", (None, None))
        if cached != key:
            queries = torch.arange(slots - m, slots, device=device)[None]  # [1, m] the last m tokens
            plan = _KeyPlan(causal_visible(queries, slots).expand(b, m, slots), groups)
            _memo.causal = (key, plan)
        return plan
    cached, cached_groups, plan = getattr(_memo, "masked", (None, None, None))
    if cached is not attention_mask or cached_groups != groups:
        plan = _KeyPlan(attention_mask[:, 0].expand(b, m, slots), groups)
        _memo.masked = (attention_mask, groups, plan)
    return plan


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
    in _KEY_BLOCK-key blocks (the last one zero-padded) added in key order. Grouped K/V heads are read
    in place (query heads folded onto their K/V head).

    query [b, hq, m, d]; key, value [b, hkv, l, d]; attention_mask [b, 1, m, l] bool (True: attend)
    or None (causal: query i sees keys [0, l - m + i]). Returns [b, m, hq, d] as transformers wants."""
    b, hq, m, d = query.shape
    hkv = key.shape[1]
    g = hq // hkv
    plan = _key_plan(attention_mask, b, m, key.shape[2], g, query.device)
    width, rows, full, tail = plan.width, plan.rows, plan.full, plan.tail
    if plan.order is not None:
        index = plan.order[:, None, :, None].expand(b, hkv, width, d)
        key, value = key.gather(2, index), value.gather(2, index)
    q = torch.nn.functional.pad(query.reshape(b, hkv, g * m, d), (0, 0, 0, rows - g * m))  # [b, hkv, R, d]
    scale = scaling if scaling is not None else d ** -0.5
    # [b, hkv, L, d], whole blocks of columns (MKL rounds a few dozen columns differently)
    key = torch.nn.functional.pad(key[:, :, :width], (0, 0, 0, plan.padded - width))
    scores = (q @ key.transpose(-1, -2)) * scale  # [b, hkv, R, L]
    probs = torch.softmax(scores.masked_fill_(plan.hidden, float("-inf")), dim=-1)
    probs = probs.view(b, hkv, rows, plan.blocks, _KEY_BLOCK).transpose(2, 3).contiguous()  # [b, hkv, blocks, R, B]
    parts = []  # [b, hkv, *, R, d]: full blocks straight from the K/V buffer, the last one zero-padded
    if full:
        parts.append(probs[:, :, :full] @ value[:, :, : full * _KEY_BLOCK].reshape(b, hkv, full, _KEY_BLOCK, d))
    if tail:
        last = torch.nn.functional.pad(value[:, :, full * _KEY_BLOCK : width], (0, 0, 0, _KEY_BLOCK - tail))
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
    own, not batch-invariant (`_keeps_own_attention`; remembered, reading its source is slow)."""
    if getattr(model.config, "_attn_implementation", None) == EXACT_ATTENTION:
        return True
    if model.__dict__.get("_batchspec_keeps_attention") or _keeps_own_attention(model):
        model.__dict__["_batchspec_keeps_attention"] = True
        return False
    model.set_attn_implementation(EXACT_ATTENTION)
    return True


def _keeps_own_attention(model: torch.nn.Module) -> bool:
    """Attention the exact path cannot stand in for: code that branches on the name of its attention
    (Falcon's hand-written SDPA call, GPT-2's upcast eager attention), logit soft-capping and
    attention sinks (which the exact path does not compute), or code without a source to check."""
    impl = getattr(model.config, "_attn_implementation", None)
    if impl not in ("sdpa", "eager") or getattr(model.config.get_text_config(), "attn_logit_softcapping", None):
        return True
    if any(isinstance(getattr(m, "sinks", None), torch.Tensor) for m in model.modules()):
        return True
    try:
        source = inspect.getsource(sys.modules[type(model).__module__])
    except (KeyError, OSError, TypeError):
        return True
    return f'_attn_implementation == "{impl}"' in source


def attention_path(model: torch.nn.Module) -> str:
    """What the summary reports: "exact" (batch-invariant, `_exact_attention`) or the model's own."""
    impl = getattr(model.config, "_attn_implementation", None) or "none"
    return "exact" if impl == EXACT_ATTENTION else f"{impl} (not batch-invariant)"

