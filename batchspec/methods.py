"""Every decoding method in one table, and the one factory that turns a SpecConfig into an engine.

Configuration checks (`config.py`), the CLI's choices and help, the bench's method specs and
`build_engine` all read this table, so a method is added (or its default scheduler changed) in
one place. Classes are named as "module:Class" and imported only when an engine is built: the table
stays importable from `config.py` without torch, and the deliberately wrong methods' code
(`batchspec.forensics.broken`) is loaded only when one of them is asked for.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from .config import SpecConfig
    from .costs import Costs
    from .drafters import Drafter
    from .engine import Engine
    from .layouts import Layout

SCHEDULERS = ("static", "continuous", "pool")

_RAGGED = "batchspec.layouts.ragged:RaggedLayout"
_PADDED = "batchspec.layouts.padded:PaddedLayout"
_ENGINE = "batchspec.engine:Engine"
_BROKEN = "batchspec.forensics.broken"
# Models with recurrent state (SSM / linear-attention layers) keep their rows in this layout.
_STATEFUL = "batchspec.layouts.stateful:StatefulLayout"


def _resolve(path: str) -> Any:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class Method:
    """One decoding method: the layout its rows live in, the engine that runs its rounds, the
    schedulers it supports (the first is its default, everywhere) and its default speculation policy
    (`batchspec.speculation`: the paper's methods verify a fixed K, as the paper does)."""

    name: str
    summary: str
    layout: str  # "module:Class" of the Layout holding each model's rows
    engine: str = _ENGINE  # "module:Class" of the Engine running the rounds
    speculative: bool = True
    schedulers: tuple[str, ...] = ("static",)
    deliberately_wrong: bool = False
    # Layout ("module:Class") for models with recurrent state; None: the method cannot run them.
    stateful_layout: str | None = None
    needs_state: bool = False  # only meaningful on a target with recurrent state
    default_speculation: str = "fixed"

    @property
    def default_scheduler(self) -> str:
        return self.schedulers[0]

    def layout_class(self) -> type:
        return _resolve(self.layout)

    def engine_class(self) -> type:
        return _resolve(self.engine)


METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method("ar", "plain decoding, one token per row per forward (the baseline)", _RAGGED,
               speculative=False, schedulers=("static", "continuous"), stateful_layout=_STATEFUL),
        Method("eqspec", "left-padded rectangle realigned after every round (the paper's EQSPEC)", _PADDED),
        Method("ragged", "per-row KV cursors: commit moves a cursor, nothing is ever realigned", _RAGGED,
               schedulers=("continuous", "static"), stateful_layout=_STATEFUL, default_speculation="adaptive"),
        Method("exspec", "sequence pool; each round runs a same-length group when one exists (the paper's EXSPEC)",
               _PADDED, schedulers=("pool",)),
        Method("naive-kv", "DELIBERATELY WRONG: rejected drafts' K/V stay in the cache",
               f"{_BROKEN}:KeptRejectedKVLayout", deliberately_wrong=True),
        Method("naive-positions", "DELIBERATELY WRONG: one position counter shared by the whole batch",
               f"{_BROKEN}:SharedPositionLayout", deliberately_wrong=True),
        Method("naive-bonus", "DELIBERATELY WRONG: the token after a rejection is the drafter's",
               _RAGGED, engine=f"{_BROKEN}:DrafterBonusEngine", deliberately_wrong=True),
        Method("naive-state", "DELIBERATELY WRONG: rollback as transformers' crop does it, recurrent state kept",
               _RAGGED, schedulers=("continuous", "static"),
               deliberately_wrong=True, stateful_layout=f"{_BROKEN}:NaiveStateLayout", needs_state=True),
    )
}


def correct_methods() -> list[str]:
    return [name for name, m in METHODS.items() if not m.deliberately_wrong]


def wrong_methods() -> list[str]:
    return [name for name, m in METHODS.items() if m.deliberately_wrong]


def method_help() -> str:
    """One line per method, for the CLI."""
    return "; ".join(f"{name}: {m.summary}" for name, m in METHODS.items())


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
    import torch

    from .config import half_precision_refusal

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
    from .config import BatchspecError
    from .kv import is_stateful

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
    plain, with_state = method.layout_class(), _resolve(method.stateful_layout)

    def make(model: torch.nn.Module, max_rows: int, capacity: int) -> Layout:
        return (with_state if is_stateful(model) else plain)(model, max_rows, capacity)

    return make
