"""The one factory: a SpecConfig and models in, an engine out.

`build_engine` checks what can never be exact or decoded (half-precision targets, methods that cannot
carry a model's recurrent state), picks each model's layout (`methods.layout_for`) and injects the
per-round invariant checker when asked for. `Parts` builds what the engine's rows are made of (the
layouts, the drafter, the cost model and the speculation policy) once the engine reserves memory,
when row counts and K/V capacity are known. Kept apart from the method table (`methods.py`), which
configuration checks read without importing any of what an engine is made of."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import torch

from .config import SpecConfig, half_precision_refusal
from .costs import Costs, measured_costs
from .drafters import Drafter, HybridDrafter, ModelDrafter, NgramDrafter, NgramLookup, NoDrafter
from .engine import Engine
from .errors import BatchspecError
from .kv import PrefixCache, check_supported, context_limit, embedding_rows, is_stateful
from .layouts import Layout, RaggedLayout
from .methods import METHODS, layout_for
from .rows import PooledRows, Rows
from .scheduler import Scheduler
from .speculation import Speculation, make_speculation
from .trace import NullTrace

# (model, rows, K/V slots per row) -> that model's layout
LayoutFactory = Callable[[torch.nn.Module, int, int], Layout]


def build_engine(
    target: torch.nn.Module,
    spec: SpecConfig,
    stop_ids: Iterable[int] = (),
    draft_model: torch.nn.Module | None = None,
    drafter: Drafter | None = None,
    costs: Costs | None = None,
    layout: LayoutFactory | None = None,
    trace: NullTrace | None = None,
) -> Engine:
    """The engine for `spec.method`. `drafter`: one to use instead of the one `spec.drafter` names;
    `costs`: the cost model adaptive speculation decides on (None: measured when first needed);
    `layout`: a layout factory replacing the method's (tests and scripts that compare layouts);
    `trace`: where to record every step's pieces of work (`batchspec.trace`)."""
    dtype = next(target.parameters()).dtype
    if dtype in (torch.bfloat16, torch.float16):
        raise half_precision_refusal(str(dtype).removeprefix("torch."))
    method = METHODS[spec.method]
    models = [m for m in (target, draft_model) if m is not None]
    if method.needs_state and not is_stateful(target):
        raise BatchspecError(
            f"method {method.name} breaks recurrent state on purpose: it needs a target with recurrent state"
        )
    for model in models:
        layout_for(model, spec.method)  # refuses a method that cannot carry this model's state, now
    stateful = [m for m in models if is_stateful(m)]
    if stateful and spec.max_prefill_tokens:
        kind = stateful[0].config.get_text_config().model_type
        raise BatchspecError(f"chunked prefill (max_prefill_tokens) is not supported for {kind} (recurrent state) yet")
    # The default budget applies where chunked prefill is supported; recurrent-state models prefill whole.
    budget = None if stateful else spec.prefill_budget
    cache_bytes = spec.prefix_cache_bytes(is_stateful(target))
    checker = None
    if spec.check_invariants:
        from .forensics.invariants import check_views

        checker = check_views
    if layout is None:
        def layout(model: torch.nn.Module, rows: int, capacity: int) -> Layout:
            return layout_for(model, spec.method)(model, rows, capacity)

    parts = Parts(target, spec, layout, draft_model=draft_model, drafter=drafter, costs=costs, prefill_budget=budget,
                  prefix_cache=PrefixCache(cache_bytes) if cache_bytes else None)
    engine = method.engine_class()(spec, parts, stop_ids, checker=checker)
    if trace is not None:
        engine.trace = trace
    return engine


class Parts:
    """What an engine's rows are made of. Checked at once (models supported, a draft model where the
    drafter needs one, K within the context); built by `reserve`, when sizes are known."""

    def __init__(
        self,
        target: torch.nn.Module,
        spec: SpecConfig,
        layout: LayoutFactory,
        draft_model: torch.nn.Module | None = None,
        drafter: Drafter | None = None,
        costs: Costs | None = None,
        prefill_budget: int | None = None,
        prefix_cache: PrefixCache | None = None,
    ) -> None:
        check_supported(target)
        uses_model = spec.speculative and drafter is None and spec.drafter != "ngram"
        if uses_model and draft_model is None:
            raise BatchspecError(f"method {spec.method!r} with the {spec.drafter} drafter needs a draft model")
        if uses_model:
            check_supported(draft_model)
        self.target = target
        self.spec = spec
        self.layout = layout
        self.draft_model = draft_model if uses_model else None
        self.custom_drafter = drafter if spec.speculative else None
        self.costs = costs
        self.calibration_s = 0.0  # seconds the last `reserve` spent measuring costs
        # Tokens a step may feed besides its round (prompt chunks, drafter catch-ups); None: unbounded.
        self.prefill_budget = prefill_budget
        # K/V of earlier prompts, shared by the target's rows and the drafter's (each its own space)
        self.prefix_cache = prefix_cache
        models = [m for m in (target, self.draft_model) if m is not None]
        self.device = next(target.parameters()).device
        self.limit = min((x for x in map(context_limit, models) if x is not None), default=None)
        self.vocab = min(embedding_rows(m) for m in models)
        k = spec.max_drafts
        if self.limit is not None and k + 2 > self.limit:
            # a round feeds K + 1 tokens after at least one of the prompt (cost calibration too)
            raise BatchspecError(f"num_draft_tokens {k} cannot fit the model's context of {self.limit} tokens: a "
                                 f"round verifies K + 1 tokens after the prompt (K at most {self.limit - 2})")

    def reserve(self, rows: int | None, capacity: int, scheduler: Scheduler) -> tuple[Rows, Speculation]:
        """Every layout allocated once, `capacity` K/V slots per row, for `rows` sequences in flight
        (None: as many as the policy uses: batch size, or EXSPEC's window), fewer if `max_kv_slots`
        cannot hold them; and the speculation policy, on costs measured now if it needs them (the
        seconds that took in `calibration_s`)."""
        spec, budget = self.spec, self.spec.max_kv_slots
        most = scheduler.window_size if scheduler.pooled else spec.batch_size
        rows = most if rows is None else rows
        if budget is not None:
            rows = min(rows, budget // capacity)
        if rows < 1:
            raise BatchspecError(f"max_kv_slots {budget} cannot hold one row of {capacity} slots")
        rows = min(rows, most)
        group = min(spec.batch_size, rows)  # rows one round runs
        drafter = self._drafter(rows, group, capacity, scheduler.pooled)
        if scheduler.pooled:
            kept: Rows = PooledRows(RaggedLayout(self.target, rows, capacity),
                                    self.layout(self.target, group, capacity), drafter)
        else:
            kept = Rows(self.layout(self.target, rows, capacity), drafter)
        if self.prefix_cache is not None:
            if not isinstance(kept.home, RaggedLayout):
                raise BatchspecError(f"the prefix cache needs per-row cursors; the target's rows are in "
                                     f"{type(kept.home).__name__}")
            kept.home.use_prefix_cache(self.prefix_cache, "target")
        adaptive = spec.speculative and spec.speculation == "adaptive"
        self.calibration_s = 0.0
        if adaptive and self.costs is None:
            start = time.perf_counter()
            self.costs = measured_costs(self.target, self.draft_model, group, spec.max_drafts)
            self.calibration_s = time.perf_counter() - start
        kind = spec.speculation if spec.speculative else "fixed"
        return kept, make_speculation(kind, spec.max_drafts, self.costs, self.prefill_budget, drafter.asks_first)

    def _drafter(self, rows: int, group: int, capacity: int, pooled: bool) -> Drafter:
        """The drafter `spec.drafter` names (or the one given), its rows laid out like the target's."""
        spec = self.spec
        if not spec.speculative:
            return NoDrafter()
        if self.custom_drafter is not None:
            return self.custom_drafter
        if spec.drafter == "ngram":
            return NgramDrafter(spec.ngram_min, spec.ngram_max, self.device)
        assert self.draft_model is not None  # checked in __init__
        if pooled:
            model_drafter = ModelDrafter(self.layout(self.draft_model, group, capacity),
                                         pool=RaggedLayout(self.draft_model, rows, capacity))
        else:
            # Adaptive speculation may never draft for a row: its prompt is prefilled when it first pays.
            layout = self.layout(self.draft_model, rows, capacity)
            lazy = spec.speculation == "adaptive" and isinstance(layout, RaggedLayout)
            model_drafter = ModelDrafter(layout, lazy=lazy)
        home = model_drafter.pool if model_drafter.pool is not None else model_drafter.layout
        if self.prefix_cache is not None and isinstance(home, RaggedLayout):
            home.use_prefix_cache(self.prefix_cache, "drafter")
        if spec.drafter == "hybrid":
            return HybridDrafter(NgramLookup(spec.ngram_min, spec.ngram_max), model_drafter)
        return model_drafter
