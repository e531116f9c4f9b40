"""The round loop: schedule -> draft -> verify -> accept -> commit, and where the time went.

Nothing model-specific lives here: layouts own positions/masks/KV, drafters own proposals,
acceptance rules own the math.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from numbers import Integral

import torch

from . import sampling
from .config import BatchspecError, SamplingParams, SpecConfig
from .drafters import Draft, Drafter, ModelDrafter, Picker
from .kv import check_supported, context_limit, embedding_rows
from .layouts import Layout, LayoutView
from .sequence import Sequence

# Called after every round with what to verify and the round's number; raises on a broken invariant.
# Injected (batchspec.methods.build_engine), so the engine never depends on the forensics package.
RoundChecker = Callable[[list[LayoutView], int], None]


@dataclass
class EngineStats:
    """Wall time by phase (seconds) and counters, summed over a run."""

    prefill_time: float = 0.0
    draft_time: float = 0.0
    verify_time: float = 0.0
    other_time: float = 0.0  # acceptance, commits/realignment, masks, bookkeeping
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    generated: int = 0
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def decode_time(self) -> float:
        return self.draft_time + self.verify_time + self.other_time

    @property
    def total_time(self) -> float:
        return self.prefill_time + self.decode_time


def validate_prompt(prompt_ids: list[int], params: SamplingParams, limit: int | None) -> None:
    """Reject what plain decoding could not serve either, with one clear line."""
    if not prompt_ids:
        raise BatchspecError("empty prompt")
    if limit is not None and len(prompt_ids) + params.max_new_tokens > limit:
        raise BatchspecError(
            f"prompt of {len(prompt_ids)} tokens + max_new_tokens {params.max_new_tokens} exceeds the "
            f"model's context of {limit} tokens"
        )


class Engine:
    """Decodes batches of token-id prompts with one target and (optionally) one drafter, the rows of
    each model kept in a `layout` (chosen by the method registry, `batchspec.methods`)."""

    def __init__(
        self,
        target: torch.nn.Module,
        spec: SpecConfig,
        layout: type[Layout],
        stop_ids: Iterable[int] = (),
        draft_model: torch.nn.Module | None = None,
        drafter: Drafter | None = None,
        checker: RoundChecker | None = None,
    ) -> None:
        check_supported(target)
        if spec.speculative and draft_model is None and drafter is None:
            raise BatchspecError(f"method {spec.method!r} needs a drafter")
        if draft_model is not None:
            check_supported(draft_model)
        self.target = target
        self.draft_model = draft_model if spec.speculative else None
        self.custom_drafter = drafter if spec.speculative else None
        self.spec = spec
        self.layout_class = layout
        self.checker = checker
        self.stop_ids = frozenset(stop_ids)
        self.stats = EngineStats()
        self.k = spec.num_draft_tokens if spec.speculative else 0
        # Unseeded sampled rows draw from this generator (`generator_seed` makes runs repeatable);
        # seeded rows use noise keyed by (request seed, position), cached for about two rounds of every row.
        self.randomness = sampling.Randomness(
            spec.generator_seed, next(target.parameters()).device, cache_entries=2 * spec.batch_size * (self.k + 1)
        )
        models = [m for m in (target, self.draft_model) if m is not None]
        self.limit = min((x for x in map(context_limit, models) if x is not None), default=None)
        self.vocab = min(embedding_rows(m) for m in models)

    # ---- public -------------------------------------------------------------------------------
    def validate(self, prompt: object, params: SamplingParams) -> list[int]:
        """The prompt as token ids, or BatchspecError (one clear line) when this engine cannot serve it:
        not a list of ids, an id outside the vocabulary, too long for the context or the K/V budget."""
        if isinstance(prompt, (str, bytes)) or not hasattr(prompt, "__iter__"):
            raise BatchspecError(f"a prompt must be a list of token ids here, got {type(prompt).__name__}")
        ids = list(prompt)  # type: ignore[call-overload]
        bad = next((t for t in ids if not isinstance(t, Integral) or isinstance(t, bool) or not 0 <= t < self.vocab), None)
        if bad is not None:
            raise BatchspecError(f"token id {bad!r} is not in the model's vocabulary (ids 0..{self.vocab - 1})")
        ids = [int(t) for t in ids]
        validate_prompt(ids, params, self.limit)
        budget, need = self.spec.max_kv_slots, self._slots_for(len(ids), params)
        if budget is not None and need > budget:
            raise BatchspecError(
                f"prompt of {len(ids)} tokens + max_new_tokens {params.max_new_tokens} + {self.k + 1} slots for a "
                f"round in flight needs {need} K/V slots, more than max_kv_slots {budget}"
            )
        return ids

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[Sequence]:
        """Decode every prompt; results in input order."""
        done = {s.index: s for s in self.stream(prompts, params)}
        return [done[i] for i in range(len(prompts))]

    def stream(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> Iterator[Sequence]:
        """Yield each sequence as soon as it finishes. Raises BatchspecError if any prompt cannot be
        served (`LLM` validates first and turns those into per-request errors instead)."""
        per_request = params if isinstance(params, list) else [params] * len(prompts)
        seqs = [
            Sequence(i, self.validate(p, sp), sp, self.stop_ids | frozenset(sp.stop_token_ids))
            for i, (p, sp) in enumerate(zip(prompts, per_request))
        ]
        if not seqs:
            return
        self._setup(len(seqs), max(self._slots_for(len(s.prompt_ids), s.params) for s in seqs))
        yield from self._loop(seqs)

    def _slots_for(self, prompt_len: int, params: SamplingParams) -> int:
        """K/V slots one row needs: its prompt, max_new_tokens and one round of drafts in flight."""
        return prompt_len + params.max_new_tokens + self.k + 1

    def _setup(self, requests: int, capacity: int) -> None:
        """Allocate the layouts for this run: rows for at most `requests` sequences at once,
        `capacity` slots per row."""
        rows = self._rows_within_budget(min(self.spec.batch_size, requests), capacity)
        self.target_layout = self.layout_class(self.target, rows, capacity)
        self.drafter = self.custom_drafter
        if self.draft_model is not None:
            self.drafter = ModelDrafter(self.layout_class(self.draft_model, rows, capacity))

    def _rows_within_budget(self, wanted: int, capacity: int) -> int:
        """Rows to allocate: `wanted`, fewer if `max_kv_slots` (rows x slots per row, per model)
        cannot hold them, so admission never outgrows the memory the user granted. (`validate`
        already refused any prompt that does not fit one row.)"""
        budget = self.spec.max_kv_slots
        return wanted if budget is None else max(1, min(wanted, budget // capacity))

    # ---- the loop -----------------------------------------------------------------------------
    def _loop(self, seqs: list[Sequence]) -> Iterator[Sequence]:
        waiting = deque(seqs)
        active: list[Sequence] = []
        while waiting or active:
            admitted = self._schedule(waiting, active)
            if admitted:
                self._admit(admitted, self.target_layout, self.drafter)
                active.extend(admitted)
            yield from self._retire(active)
            if active:
                self._round(active)
                yield from self._retire(active)

    def _schedule(self, waiting: deque[Sequence], active: list[Sequence]) -> list[Sequence]:
        """static: a new batch once the previous one has fully finished; continuous: refill free
        slots at once."""
        if self.spec.scheduler == "static" and active:
            return []
        free = self.target_layout.store.max_rows - len(active)
        return [waiting.popleft() for _ in range(min(free, len(waiting)))]

    def _admit(self, seqs: list[Sequence], layout: Layout, drafter: Drafter | None) -> None:
        """Prefill new rows (target and drafter); the target's prefill yields each first token."""
        start = _clock(self.target)
        logits = layout.prefill([s.prompt_ids for s in seqs])
        first = self._pick_first(logits, seqs).tolist()
        for s, token in zip(seqs, first):
            s.extend([token])
        if drafter is not None:
            drafter.add(seqs)
        self.stats.prefill_time += _clock(self.target) - start

    def _round(self, active: list[Sequence]) -> None:
        device = self.target_layout.device
        t0 = _clock(self.target)
        k = 0
        if self.drafter is not None:
            k = min(self.k, max(s.remaining for s in active) - 1)
        pending = torch.tensor([s.tail(1) for s in active], dtype=torch.long, device=device)
        draft = Draft(torch.zeros((len(active), 0), dtype=torch.long, device=device), None)
        if k > 0:
            draft = self.drafter.propose(active, k, self._draft_picker(active))
        t1 = _clock(self.target)
        logits = self.target_layout.forward(torch.cat([pending, draft.tokens], dim=1))
        t2 = _clock(self.target)
        tokens, count = self._accept(draft, logits, active)
        tokens_l, count_l = tokens.tolist(), count.tolist()
        for s, toks, n in zip(active, tokens_l, count_l):
            taken = s.extend(toks[:n])
            s.rounds += 1
            s.drafted += k
            s.accepted += min(n - 1, taken)
            self.stats.drafted += k
            self.stats.accepted += min(n - 1, taken)
            self.stats.generated += taken
        self._commit(active)
        self.stats.rounds += 1
        if self.checker is not None:
            self.checker(self._views(active), self.stats.rounds)
        t3 = _clock(self.target)
        self.stats.draft_time += t1 - t0
        self.stats.verify_time += t2 - t1
        self.stats.other_time += t3 - t2

    def _commit(self, active: list[Sequence]) -> None:
        """Keep the target K/V of every token but the last (it is fed first next round)."""
        lengths = [s.length - 1 for s in active]
        self.target_layout.commit(torch.tensor(lengths, dtype=torch.long, device=self.target_layout.device))

    # ---- token choice: the only place that knows about decoding rules ----------------------------
    def _pick_first(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """The first generated token of each new row, from the target's prefill logits [b, vocab]."""
        return sampling.choose_tokens(logits, seqs, 0, self.randomness)

    def _draft_picker(self, seqs: list[Sequence]) -> Picker:
        """How the drafter turns its logits into draft tokens this round."""
        return sampling.draft_picker(seqs, self.randomness)

    def _accept(
        self, draft: Draft, logits: torch.Tensor, seqs: list[Sequence]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens [b, k+1] and counts [b]: row b emits tokens[b, :count[b]]."""
        return sampling.accept_round(draft, logits, seqs, self.randomness)

    def _row_holders(self) -> list[Layout | Drafter]:
        """Everything that keeps state per active row, in the rows' order."""
        return [self.target_layout] + ([self.drafter] if self.drafter is not None else [])

    def _retire(self, active: list[Sequence]) -> list[Sequence]:
        """Drop finished rows everywhere (they stop costing compute) and return them."""
        keep = [not s.finished for s in active]
        if all(keep):
            return []
        finished = [s for s in active if s.finished]
        holders = self._row_holders()
        order = holders[0].drop(keep)
        for holder in holders[1:]:
            holder.drop(keep)
        active[:] = [active[i] for i in order]
        return finished

    def _views(self, active: list[Sequence]) -> list[LayoutView]:
        """What the invariant checker verifies after a round: the target's rows and the drafter's."""
        sample = sorted({self.stats.rounds % len(active), len(active) - 1})
        target = LayoutView("target", self.target_layout, [s.length - 1 for s in active],
                            [s.tokens[:-1] for s in active], sample)
        return [target] + (self.drafter.views(active, sample) if self.drafter is not None else [])


def _clock(model: torch.nn.Module) -> float:
    """Wall clock that waits for queued GPU work, so phase timings are honest on CUDA too."""
    if next(model.parameters()).is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter()
