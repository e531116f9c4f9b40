"""The one factory that turns a SpecConfig into an engine: the method's layout (its stateful layout
for a model with recurrent state), the refusal of targets that cannot be exact, and the per-round
invariant checker when asked for. Kept apart from the method table (`methods.py`), which
configuration checks read without importing any of what an engine is made of."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from .config import SpecConfig, half_precision_refusal
from .costs import Costs
from .drafters import Drafter
from .engine import Engine
from .errors import BatchspecError
from .kv import is_stateful
from .layouts import Layout
from .methods import METHODS, Method, resolve


def build_engine(
    target: torch.nn.Module,
    spec: SpecConfig,
    stop_ids: Iterable[int] = (),
    draft_model: torch.nn.Module | None = None,
    drafter: Drafter | None = None,
    costs: Costs | None = None,
) -> Engine:
    """The engine for `spec.method`, with the method's layout (its stateful layout for a model with
    recurrent state), and the per-round invariant checker injected when `spec.check_invariants` asks
    for it (the engine itself knows nothing of forensics). `costs`: the cost model adaptive
    speculation decides on (None: measured when first needed)."""
    dtype = next(target.parameters()).dtype
    if dtype in (torch.bfloat16, torch.float16):
        raise half_precision_refusal(str(dtype).removeprefix("torch."))
    method = METHODS[spec.method]
    checker = None
    if spec.check_invariants:
        from .forensics.invariants import check_views

        checker = check_views
    layout = _stateful_layouts(method, spec, target, draft_model) or method.layout_class()
    return method.engine_class()(
        target, spec, layout, stop_ids, draft_model=draft_model, drafter=drafter, checker=checker, costs=costs,
    )


def _stateful_layouts(
    method: Method, spec: SpecConfig, target: torch.nn.Module, draft_model: torch.nn.Module | None
) -> Callable[[torch.nn.Module, int, int], Layout] | None:
    """When the target or the drafter has recurrent state, a layout factory (called like a Layout
    class) that puts each stateful model on the method's stateful layout and any other model on its
    usual one (an attention drafter of a stateful target keeps its cursors); else None. Methods
    without a stateful layout are refused for such models with one line."""
    stateful = [m for m in (target, draft_model) if m is not None and is_stateful(m)]
    if method.needs_state and not is_stateful(target):
        raise BatchspecError(
            f"method {method.name} breaks recurrent state on purpose: it needs a target with recurrent state"
        )
    if not stateful:
        return None
    kind = stateful[0].config.get_text_config().model_type
    if method.stateful_layout is None:
        able = ", ".join(name for name, m in METHODS.items() if m.stateful_layout and not m.deliberately_wrong)
        raise BatchspecError(
            f"method {method.name} cannot decode {kind} (recurrent state: pad tokens and realignment would enter it); "
            f"use {able}"
        )
    if spec.max_prefill_tokens is not None:
        raise BatchspecError(f"chunked prefill (max_prefill_tokens) is not supported for {kind} (recurrent state) yet")
    plain, with_state = method.layout_class(), resolve(method.stateful_layout)

    def make(model: torch.nn.Module, max_rows: int, capacity: int) -> Layout:
        return (with_state if is_stateful(model) else plain)(model, max_rows, capacity)

    return make
