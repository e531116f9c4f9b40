"""Every decoding method in one table.

Configuration checks (`config.py`), the CLI's choices and help, the bench's method specs and
`build.build_engine` all read this table, so a method is added (or its default scheduler changed) in
one place. Classes are named as "module:Class" and imported only when an engine is built: the table
stays importable from `config.py` without torch, and the deliberately wrong methods' code
(`batchspec.forensics.broken`) is loaded only when one of them is asked for.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .errors import BatchspecError

if TYPE_CHECKING:
    import torch

    from .engine import Engine
    from .layouts import Layout

SCHEDULERS = ("static", "continuous", "pool")

_RAGGED = "batchspec.layouts.ragged:RaggedLayout"
_PADDED = "batchspec.layouts.padded:PaddedLayout"
_ENGINE = "batchspec.engine:Engine"
_BROKEN = "batchspec.forensics.broken"
# Models with recurrent state (SSM / linear-attention layers) keep their rows in this layout.
_STATEFUL = "batchspec.layouts.stateful:StatefulLayout"


def resolve(path: str) -> Any:
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
    # Rows live (between rounds) in per-row cursors from slot 0, where a prefix cache's K/V can be
    # placed (`batchspec.kv.prefix`): the ragged layout, or EXSPEC's ragged pool.
    prefix_cache: bool = False

    @property
    def default_scheduler(self) -> str:
        return self.schedulers[0]

    def layout_class(self) -> type[Layout]:
        return resolve(self.layout)

    def engine_class(self) -> type[Engine]:
        return resolve(self.engine)


METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method("ar", "plain decoding, one token per row per forward (the baseline)", _RAGGED,
               speculative=False, schedulers=("static", "continuous"), stateful_layout=_STATEFUL, prefix_cache=True),
        Method("eqspec", "left-padded rectangle realigned after every round (the paper's EQSPEC)", _PADDED),
        Method("ragged", "per-row KV cursors: commit moves a cursor, nothing is ever realigned", _RAGGED,
               schedulers=("continuous", "static"), stateful_layout=_STATEFUL, default_speculation="adaptive",
               prefix_cache=True),
        Method("exspec", "sequence pool; each round runs a same-length group when one exists (the paper's EXSPEC)",
               _PADDED, schedulers=("pool",), prefix_cache=True),
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


def layout_for(model: torch.nn.Module, method: str = "ragged") -> type[Layout]:
    """The layout class `method` keeps `model`'s rows in: its stateful layout for a model with
    recurrent state, else its usual one. The engine, the cost model and the audit's calibration all
    ask here, so a model is timed and checked on the layout it decodes on. A method without a
    stateful layout is refused for such a model with one line."""
    from .kv import is_stateful  # imports transformers: only once a model exists

    m = METHODS[method]
    if not is_stateful(model):
        return m.layout_class()
    if m.stateful_layout is None:
        kind = model.config.get_text_config().model_type
        able = ", ".join(name for name, x in METHODS.items() if x.stateful_layout and not x.deliberately_wrong)
        raise BatchspecError(
            f"method {method} cannot decode {kind} (recurrent state: pad tokens and realignment would enter it); "
            f"use {able}"
        )
    return resolve(m.stateful_layout)


def correct_methods() -> list[str]:
    return [name for name, m in METHODS.items() if not m.deliberately_wrong]


def wrong_methods() -> list[str]:
    return [name for name, m in METHODS.items() if m.deliberately_wrong]


def method_help() -> str:
    """One line per method, for the CLI."""
    return "; ".join(f"{name}: {m.summary}" for name, m in METHODS.items())
