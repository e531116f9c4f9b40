"""The engine: requests in, rounds of schedule -> draft -> verify -> accept -> commit, sequences out.

A step API in the shape of vLLM's engine (`add_request`, `step`, `abort`, `has_unfinished`) that the
offline `generate`/`stream`, the Python API, the CLI and the server all run on. Nothing model-specific
lives here: layouts own positions/masks/KV, drafters own proposals, acceptance rules own the math,
and a scheduling policy (`batchspec.scheduler`) decides which requests get rows and which rows run.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, fields
from numbers import Integral

import torch

from . import sampling
from .config import BatchspecError, SamplingParams, SpecConfig
from .costs import Costs, measured_costs, wall_clock
from .drafters import Draft, Drafter, HybridDrafter, ModelDrafter, NgramDrafter, NgramLookup, NoDrafter, empty_draft
from .kv import check_supported, context_limit, embedding_rows
from .layouts import Layout, LayoutView, PaddedLayout, RaggedLayout
from .scheduler import make_scheduler
from .sequence import Sequence
from .speculation import RoundPlan, Speculation, make_speculation

# Called after every round with what to verify and the round's number; raises on a broken invariant.
# Injected (batchspec.build.build_engine), so the engine never depends on the forensics package.
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
    prefill_tokens: int = 0  # prompt tokens prefilled (target)
    prefill_fed: int = 0  # token positions the target's prefill forwards computed (prompt + padding)
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def decode_time(self) -> float:
        return self.draft_time + self.verify_time + self.other_time

    @property
    def total_time(self) -> float:
        return self.prefill_time + self.decode_time

    def merge(self, other: EngineStats) -> None:
        """Add another run's totals to these (several engines' runs, or Ray workers' reports)."""
        for f in fields(EngineStats):
            if f.name != "extra":
                setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        for name, value in other.extra.items():
            self.extra[name] = self.extra.get(name, 0) + value


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
    """Decodes token-id requests with one target and (optionally) one drafter, the rows of each
    model kept in a `layout` (chosen by the method registry, `batchspec.methods`).

    Rows live in `home` layouts between rounds. Most policies run every row each round, on the home
    layout itself; a pooled policy (EXSPEC) keeps a ragged pool at home and runs each round on a
    group loaded into a `layout` rectangle, then writes the group back.

    The drafter is `drafter` if given, else built from `spec.drafter`: the `draft_model` (model),
    prompt lookup (ngram), or both (hybrid). How many drafts a round verifies is the speculation
    policy's (`batchspec.speculation`); an adaptive one decides on `costs`, measured on first use
    when not given.
    """

    def __init__(
        self,
        target: torch.nn.Module,
        spec: SpecConfig,
        layout: type[Layout],
        stop_ids: Iterable[int] = (),
        draft_model: torch.nn.Module | None = None,
        drafter: Drafter | None = None,
        checker: RoundChecker | None = None,
        costs: Costs | None = None,
    ) -> None:
        check_supported(target)
        uses_model = spec.speculative and drafter is None and spec.drafter != "ngram"
        if uses_model and draft_model is None:
            raise BatchspecError(f"method {spec.method!r} with the {spec.drafter} drafter needs a draft model")
        if uses_model:
            check_supported(draft_model)
        self.target = target
        self.draft_model = draft_model if uses_model else None
        self.custom_drafter = drafter if spec.speculative else None
        self.spec = spec
        self.layout_class = layout
        self.checker = checker
        self.scheduler = make_scheduler(spec)
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
        if self.limit is not None and self.k + 2 > self.limit:
            # a round feeds K + 1 tokens after at least one of the prompt (cost calibration too)
            raise BatchspecError(f"num_draft_tokens {self.k} cannot fit the model's context of {self.limit} tokens: a "
                                 f"round verifies K + 1 tokens after the prompt (K at most {self.limit - 2})")
        self.vocab = min(embedding_rows(m) for m in models)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in the home layout's row order
        self.staging: Sequence | None = None  # a prompt being prefilled in chunks
        self.staged = 0  # how much of it is in
        self.capacity: int | None = None  # K/V slots per row, once reserved
        self.drafter: Drafter = self.custom_drafter if self.custom_drafter is not None else NoDrafter()
        self.costs = costs
        self.speculation: Speculation = make_speculation("fixed", self.k, None)
        self._next_id = 0

    # ---- requests -----------------------------------------------------------------------------
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
        need = self.slots_for(len(ids), params)
        budget = self.spec.max_kv_slots
        if budget is not None and need > budget:
            raise BatchspecError(
                f"prompt of {len(ids)} tokens + max_new_tokens {params.max_new_tokens} + {self.k + 1} slots for a "
                f"round in flight needs {need} K/V slots, more than max_kv_slots {budget}"
            )
        if self.capacity is not None and need > self.capacity:
            raise BatchspecError(
                f"prompt of {len(ids)} tokens + max_new_tokens {params.max_new_tokens} + {self.k + 1} slots for a "
                f"round in flight needs {need} K/V slots per row; this engine reserved {self.capacity}"
            )
        return ids

    def slots_for(self, prompt_len: int, params: SamplingParams) -> int:
        """K/V slots one row needs: its prompt, max_new_tokens and one round of drafts in flight."""
        return prompt_len + params.max_new_tokens + self.k + 1

    def add_request(self, prompt: object, params: SamplingParams, request_id: int | None = None) -> int:
        """Queue a request; returns its id (the next free one unless given; ids of requests in flight
        must be unique). Raises BatchspecError if it can never be served."""
        ids = self.validate(prompt, params)
        if request_id is None:
            request_id = self._next_id
        elif any(s.index == request_id for s in self._in_flight()):
            raise BatchspecError(f"request id {request_id} is already in flight")
        self._next_id = max(self._next_id, request_id + 1)
        self.waiting.append(Sequence(request_id, ids, params, self.stop_ids | frozenset(params.stop_token_ids)))
        return request_id

    def _in_flight(self) -> list[Sequence]:
        return [*self.waiting, *self.running, *([self.staging] if self.staging is not None else [])]

    def abort(self, request_id: int) -> Sequence | None:
        """Stop a request wherever it is (queued, being prefilled, decoding); its row is freed at once,
        in the target and the drafter. Returns it (finish_reason "abort"), or None if not in flight."""
        for seq in self.waiting:
            if seq.index == request_id:
                self.waiting.remove(seq)
                seq.abort()
                return seq
        if self.staging is not None and self.staging.index == request_id:
            seq, self.staging, self.staged = self.staging, None, 0
            self.home.discard_staged()
            self.drafter.discard_staged()
            seq.abort()
            return seq
        for seq in self.running:
            if seq.index == request_id and not seq.finished:
                seq.abort()
                self._retire()
                return seq
        return None

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.staging)

    # ---- memory -------------------------------------------------------------------------------
    def reserve(self, rows: int | None, capacity: int) -> int:
        """Allocate every layout once, `capacity` K/V slots per row, for `rows` sequences in flight
        (None: as many as the policy uses: batch size, or EXSPEC's window), fewer if `max_kv_slots`
        cannot hold them. Returns the rows granted. Requests that need more are refused by `validate`."""
        budget = self.spec.max_kv_slots
        if rows is None:
            rows = self.scheduler.window_size if self.scheduler.pooled else self.spec.batch_size
        if budget is not None:
            rows = min(rows, budget // capacity)
        if rows < 1:
            raise BatchspecError(f"max_kv_slots {budget} cannot hold one row of {capacity} slots")
        self.capacity = capacity
        if self.scheduler.pooled:
            rows = min(rows, self.scheduler.window_size)
            group = min(self.spec.batch_size, rows)
            self.home: Layout = RaggedLayout(self.target, rows, capacity)
            self.layout: Layout = PaddedLayout(self.target, group, capacity)
        else:
            rows = min(rows, self.spec.batch_size)
            self.home = self.layout = self.layout_class(self.target, rows, capacity)
        drafter = self.custom_drafter
        model_drafter = None
        if self.draft_model is not None:
            if self.scheduler.pooled:
                model_drafter = ModelDrafter(PaddedLayout(self.draft_model, group, capacity),
                                             pool=RaggedLayout(self.draft_model, rows, capacity))
            else:
                # Adaptive speculation may never draft for a row: its prompt is prefilled when it first pays.
                layout = self.layout_class(self.draft_model, rows, capacity)
                lazy = self.spec.speculation == "adaptive" and isinstance(layout, RaggedLayout)
                model_drafter = ModelDrafter(layout, lazy=lazy)
        if drafter is None and self.spec.speculative:
            if self.spec.drafter == "ngram":
                drafter = NgramDrafter(self.spec.ngram_min, self.spec.ngram_max, self.layout.device)
            elif self.spec.drafter == "hybrid":
                drafter = HybridDrafter(NgramLookup(self.spec.ngram_min, self.spec.ngram_max), model_drafter)
            else:
                drafter = model_drafter
        self.drafter = drafter if drafter is not None else NoDrafter()
        if self.spec.speculative and self.spec.speculation == "adaptive" and self.costs is None:
            self.costs = measured_costs(self.target, self.draft_model, min(rows, self.spec.batch_size), self.k)
        self.speculation = make_speculation(self.spec.speculation if self.spec.speculative else "fixed", self.k, self.costs)
        return rows

    # ---- offline ------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[Sequence]:
        """Decode every prompt; results in input order."""
        done = {s.index: s for s in self.stream(prompts, params)}
        return [done[i] for i in range(len(prompts))]

    def stream(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> Iterator[Sequence]:
        """Yield each sequence as soon as it finishes; `index` is the prompt's position. Raises
        BatchspecError if any prompt cannot be served (`LLM` validates first and turns those into
        per-request errors instead). Memory is sized for these prompts on first use."""
        per_request = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.validate(p, sp) for p, sp in zip(prompts, per_request)]
        if not ids:
            return
        if self.capacity is None:
            self.reserve(len(ids), max(self.slots_for(len(p), sp) for p, sp in zip(ids, per_request)))
        if self.has_unfinished():
            raise BatchspecError("stream() needs an idle engine (requests are still in flight)")
        for i, (p, sp) in enumerate(zip(ids, per_request)):
            self.add_request(p, sp, request_id=i)
        while self.has_unfinished():
            yield from self.step()

    # ---- one step -----------------------------------------------------------------------------
    def step(self) -> list[Sequence]:
        """Admit and prefill what the policy allows, then one round over the rows it selects.
        Returns the sequences that finished during this step."""
        if not self.has_unfinished():
            return []
        if self.capacity is None:
            self.reserve(len(self.waiting), max(self.slots_for(len(s.prompt_ids), s.params) for s in self.waiting))
        self._prefill()
        finished = self._retire()
        if self.running:
            group = self.scheduler.select(self.running, self.stats.rounds)
            self._round(group)
            finished += self._retire()
        self._count()
        return finished

    def _count(self) -> None:
        """Policy and layout running totals into stats.extra (EXSPEC grouping, time spent keeping
        recurrent states, ...): the target's and the drafter's added up."""
        totals = dict(self.scheduler.counters())
        for counters in (self.home.counters(), self.drafter.counters()):
            for name, value in counters.items():
                totals[name] = totals.get(name, 0) + value
        self.stats.extra.update(totals)

    def _free_rows(self) -> int:
        return self.home.store.max_rows - len(self.running) - (self.staging is not None)

    def _prefill(self) -> None:
        """Prefill newly admitted requests, each prompt at its own length (target and drafter): whole
        prompts, or with `max_prefill_tokens` at most that many prompt tokens per step, so one long
        prompt never stalls the rows already decoding for long."""
        start = wall_clock(self.target)
        fed_before = self.home.prefill_fed
        if self.spec.max_prefill_tokens is None:
            admitted = self.scheduler.take(self.waiting, len(self.running), self._free_rows())
            if admitted:
                admitted.sort(key=lambda s: len(s.prompt_ids))  # equal lengths adjacent: one forward each
                logits = self.home.prefill([s.prompt_ids for s in admitted])
                self.drafter.add(admitted)
                self._start(admitted, logits)
        else:
            self._prefill_chunks(self.spec.max_prefill_tokens)
        self.stats.prefill_fed += self.home.prefill_fed - fed_before
        self.stats.prefill_time += wall_clock(self.target) - start

    def _prefill_chunks(self, budget: int) -> None:
        while budget > 0:
            if self.staging is None:
                taken = self.scheduler.take(self.waiting, len(self.running), min(1, self._free_rows()))
                if not taken:
                    return
                self.staging, self.staged = taken[0], 0
            seq = self.staging
            chunk = seq.prompt_ids[self.staged : self.staged + budget]
            logits = self.home.stage(chunk)
            self.drafter.stage(chunk)
            self.staged += len(chunk)
            budget -= len(chunk)
            if self.staged == len(seq.prompt_ids):
                self.home.unstage()
                self.drafter.unstage()
                self.staging, self.staged = None, 0
                self._start([seq], logits[None])

    def _start(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        """Rows whose prompt is in: the target's last prompt logits [b, vocab] give the first token."""
        first = sampling.choose_tokens(logits, seqs, 0, self.randomness).tolist()
        for s, token in zip(seqs, first):
            s.extend([token])
            self.stats.prefill_tokens += len(s.prompt_ids)
        self.running.extend(seqs)

    def _round(self, group: list[int]) -> None:
        """Draft, verify, accept and commit for rows `group` (indices into `running`).

        The speculation policy plans the round (how many drafter steps at most, 0 for a plain decoding
        step that leaves the drafter out) and settles how many of the proposed drafts each row
        verifies. The target is fed the longest row's drafts; acceptance caps every row at its own."""
        seqs = [self.running[i] for i in group]
        device = self.layout.device
        t0 = wall_clock(self.target)
        rows = torch.tensor(group, dtype=torch.long, device=device)
        if self.scheduler.pooled:
            lengths = torch.tensor([s.length - 1 for s in seqs], dtype=torch.long, device=device)
            self.layout.load_rows(self.home, rows, lengths)
            self.drafter.load(rows, seqs)
        if self.k == 0:  # plain decoding: nothing to plan
            plan = RoundPlan(0)
        else:
            plan = self.speculation.plan(seqs, self.drafter.backlog(seqs) if self.speculation.weighs_backlog else None)
        pending = torch.tensor([s.tail(1) for s in seqs], dtype=torch.long, device=device)
        proposal = draft = empty_draft(len(seqs), device)
        if plan.steps > 0:
            pick = sampling.draft_picker(seqs, self.randomness)
            if plan.steer is not None:
                proposal = self.drafter.propose_steered(seqs, plan.steps, pick, plan.steer)
            else:
                proposal = self.drafter.propose(seqs, plan.steps, pick)
            draft = self.speculation.settle(plan, proposal)
        else:
            self.drafter.skip(seqs)
        t1 = wall_clock(self.target)
        logits = self.layout.forward(torch.cat([pending, draft.tokens], dim=1))
        t2 = wall_clock(self.target)
        tokens, count = self._accept(draft, logits, seqs)
        rounds = zip(seqs, tokens.tolist(), count.tolist(), proposal.row_lengths().tolist(), draft.row_lengths().tolist())
        for s, toks, n, offered, chosen in rounds:
            taken = s.extend(toks[:n])
            accepted = min(n - 1, taken)
            s.rounds += 1
            s.drafted += chosen
            s.accepted += accepted
            s.proposed_k.append(offered)
            s.chosen_k.append(chosen)
            s.accepted_k.append(accepted)
            self.stats.drafted += chosen
            self.stats.accepted += accepted
            self.stats.generated += taken
        # Keep the target K/V of every token but the last (it is fed first next round).
        lengths = torch.tensor([s.length - 1 for s in seqs], dtype=torch.long, device=device)
        if self.scheduler.pooled:
            self.layout.save_rows(self.home, rows, lengths)
            self.drafter.save(rows, seqs)
        else:
            self.layout.commit(lengths)
        self.stats.rounds += 1
        if self.checker is not None:
            self.checker(self._views(group), self.stats.rounds)
        t3 = wall_clock(self.target)
        catch_up = self.drafter.last_catch_up() if plan.steps > 0 else 0.0  # a deferred prefill, not drafting
        self.speculation.observe(seqs, plan, draft, count, (t1 - t0 - catch_up, t2 - t1, t3 - t2))
        self.stats.draft_time += t1 - t0
        self.stats.verify_time += t2 - t1
        self.stats.other_time += wall_clock(self.target) - t2

    def _accept(self, draft: Draft, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens [b, k+1] and counts [b]: row b emits tokens[b, :count[b]] (each row by its own rule)."""
        return sampling.accept_round(draft, logits, seqs, self.randomness)

    def _retire(self) -> list[Sequence]:
        """Drop finished rows everywhere (they stop costing compute) and return them."""
        keep = [not s.finished for s in self.running]
        if all(keep):
            return []
        finished = [s for s in self.running if s.finished]
        self.speculation.forget(finished)
        order = self.home.drop(keep)
        self.drafter.drop(keep)
        self.running = [self.running[i] for i in order]
        return finished

    def _views(self, group: list[int]) -> list[LayoutView]:
        """What the invariant checker verifies after a round: the target's rows at home (committed
        lengths and, for a sample of the round's rows, cached K/V), the rectangle the round ran on
        when pooled (its structure and positions), and the drafter's."""
        sample = sorted({group[self.stats.rounds % len(group)], group[-1]})
        views = [LayoutView("target", self.home, [s.length - 1 for s in self.running],
                            [s.tokens[:-1] for s in self.running], sample)]
        if self.layout is not self.home:
            views.append(LayoutView("target group", self.layout, None, [], []))
        return views + self.drafter.views(self.running, sample)
