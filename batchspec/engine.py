"""The round loop: schedule -> draft -> verify -> accept -> commit, and where the time went.

Nothing model-specific lives here: layouts own positions/masks/KV, drafters own proposals,
acceptance rules own the math.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

from . import sampling
from .config import BatchspecError, SamplingParams, SpecConfig
from .drafters import Draft, Drafter, ModelDrafter, Picker
from .forensics.invariants import check_layout
from .kv import check_supported, context_limit
from .layouts import METHOD_LAYOUT, Layout, make_layout
from .sequence import Sequence


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
    """Decodes batches of token-id prompts with one target and (optionally) one drafter."""

    def __init__(
        self,
        target: torch.nn.Module,
        spec: SpecConfig,
        stop_ids: Iterable[int] = (),
        draft_model: torch.nn.Module | None = None,
        drafter: Drafter | None = None,
        seed: int | None = None,
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
        self.stop_ids = frozenset(stop_ids)
        self.layout_kind = METHOD_LAYOUT[spec.method]
        self.stats = EngineStats()
        # Unseeded sampled rows draw from this generator (`seed` makes runs repeatable); seeded rows
        # use noise keyed by (request seed, position), cached here for about two rounds of every row.
        self.randomness = sampling.Randomness(
            seed, next(target.parameters()).device, cache_entries=2 * spec.batch_size * (spec.num_draft_tokens + 1)
        )
        limits = [context_limit(m) for m in (target, self.draft_model) if m is not None]
        self.limit = min((x for x in limits if x is not None), default=None)

    # ---- public -------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[Sequence]:
        """Decode every prompt; results in input order."""
        done = {s.index: s for s in self.stream(prompts, params)}
        return [done[i] for i in range(len(prompts))]

    def stream(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> Iterator[Sequence]:
        """Yield each sequence as soon as it finishes."""
        per_request = params if isinstance(params, list) else [params] * len(prompts)
        for p, sp in zip(prompts, per_request):
            validate_prompt(p, sp, self.limit)
        seqs = [
            Sequence(i, list(p), sp, self.stop_ids | frozenset(sp.stop_token_ids))
            for i, (p, sp) in enumerate(zip(prompts, per_request))
        ]
        if not seqs:
            return
        k = self.spec.num_draft_tokens if self.spec.speculative else 0
        self._setup(max(len(p) for p in prompts) + max(sp.max_new_tokens for sp in per_request) + k + 1)
        yield from self._loop(seqs)

    def _setup(self, capacity: int) -> None:
        """Allocate the layouts for this run: `capacity` slots per row covers the longest prompt,
        max_new_tokens and one round of drafts in flight."""
        rows = self._rows_within_budget(self.spec.batch_size, capacity)
        self.target_layout = make_layout(self.layout_kind, self.target, rows, capacity)
        self.drafter = self.custom_drafter
        if self.draft_model is not None:
            self.drafter = ModelDrafter(make_layout(self.layout_kind, self.draft_model, rows, capacity))

    def _rows_within_budget(self, wanted: int, capacity: int) -> int:
        """Rows to allocate: `wanted`, fewer if `max_kv_slots` (rows x slots per row, per model)
        cannot hold them, so admission never outgrows the memory the user granted."""
        budget = self.spec.max_kv_slots
        if budget is None:
            return wanted
        if budget < capacity:
            raise BatchspecError(
                f"max_kv_slots {budget} cannot hold one row of {capacity} slots (longest prompt + "
                f"max_new_tokens + drafts in flight)"
            )
        return min(wanted, budget // capacity)

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
            k = min(self.spec.num_draft_tokens, max(s.remaining for s in active) - 1)
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
        if self.spec.check_invariants:
            self._check(active)
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

    def _check(self, active: list[Sequence]) -> None:
        """Invariants after a round, for the target and (if it is a model) the drafter."""
        sample = sorted({self.stats.rounds % len(active), len(active) - 1})
        check_layout(
            self.target_layout, "target", self.stats.rounds,
            [s.length - 1 for s in active], [s.tokens[:-1] for s in active], sample,
        )
        if isinstance(self.drafter, ModelDrafter):
            layout: Layout = self.drafter.layout
            valid = [min(int(n), s.length - 2) for n, s in zip(layout.lengths.tolist(), active)]
            check_layout(layout, "drafter", self.stats.rounds, None,
                         [s.tokens[:v] for s, v in zip(active, valid)], sample)


def _clock(model: torch.nn.Module) -> float:
    """Wall clock that waits for queued GPU work, so phase timings are honest on CUDA too."""
    if next(model.parameters()).is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter()
