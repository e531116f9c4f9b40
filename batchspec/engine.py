"""The engine: requests in, rounds of schedule -> draft -> verify -> accept -> commit, sequences out.

A step API in the shape of vLLM's engine (`add_request`, `step`, `abort`, `has_unfinished`) that the
offline `generate`/`stream`, the Python API, the CLI and the server all run on. It builds nothing and
knows nothing model-specific: `batchspec.build` makes its parts, the rows (`batchspec.rows`) own both
models' positions/masks/KV, drafters own proposals, acceptance rules (`batchspec.sampling`) own the
math, the speculation policy decides how many drafts a round verifies, and a scheduling policy
(`batchspec.scheduler`) decides which requests get rows and which rows run.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

import torch

from . import sampling
from .admission import check_slots, token_ids, validate_prompt
from .config import BatchspecError, SamplingParams, SpecConfig
from .draft import Draft, empty_draft
from .layouts import LayoutView
from .logprobs import logprobs_of
from .prefill import Prefill
from .rows import Rows
from .scheduler import make_scheduler
from .sequence import Sequence
from .speculation import RoundPlan, RoundTimes, Speculation
from .stats import EngineStats
from .trace import NO_TRACE, NullTrace

if TYPE_CHECKING:
    from .build import Parts

# Called after every round with what to verify and the round's number; raises on a broken invariant.
# Injected (batchspec.build.build_engine), so the engine never depends on the forensics package.
RoundChecker = Callable[[list[LayoutView], int], None]


class Engine:
    """Decodes token-id requests in rounds over rows that `parts` builds when memory is reserved
    (`reserve`, or on first use): the target's and the drafter's rows together (`Rows`), and the
    speculation policy that plans each round. Made by `batchspec.build.build_engine`."""

    def __init__(self, spec: SpecConfig, parts: Parts, stop_ids: Iterable[int] = (),
                 checker: RoundChecker | None = None) -> None:
        self.spec = spec
        self.parts = parts
        self.checker = checker
        self.scheduler = make_scheduler(spec)
        self.stop_ids = frozenset(stop_ids)
        self.stats = EngineStats()
        self.k = spec.max_drafts
        self.limit, self.vocab = parts.limit, parts.vocab
        # Unseeded sampled rows draw from this generator (`generator_seed` makes runs repeatable);
        # seeded rows use noise keyed by (request seed, position), cached for about two rounds of every row.
        self.randomness = sampling.Randomness(spec.generator_seed, parts.device,
                                              cache_entries=2 * spec.batch_size * (self.k + 1))
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in the home layout's row order
        self.prefill = Prefill(self.scheduler, parts.prefill_budget)
        self.capacity: int | None = None  # K/V slots per row, once reserved
        self.rows: Rows  # once reserved
        self.speculation: Speculation
        self.trace: NullTrace = NO_TRACE  # records what each step ran (`batchspec.trace`; build_engine sets it)
        self.steps = 0
        self._next_id = 0

    # ---- requests -----------------------------------------------------------------------------
    def validate(self, prompt: object, params: SamplingParams) -> list[int]:
        """The prompt as token ids, or BatchspecError (one clear line) when this engine cannot serve it:
        not a list of ids, an id outside the vocabulary, too long for the context or the K/V budget."""
        ids = token_ids(prompt, self.vocab)
        validate_prompt(ids, params, self.limit)
        check_slots(len(ids), params, self.slots_for(len(ids), params), self.k + 1, self.spec.max_kv_slots, self.capacity)
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
        staging = self.prefill.staging
        return [*self.waiting, *self.running, *([staging] if staging is not None else [])]

    def abort(self, request_id: int) -> Sequence | None:
        """Stop a request wherever it is (queued, being prefilled, decoding); its row is freed at once,
        in the target and the drafter. Returns it (finish_reason "abort"), or None if not in flight."""
        for seq in self.waiting:
            if seq.index == request_id:
                self.waiting.remove(seq)
                seq.abort()
                return seq
        seq = self.prefill.abort(request_id, self.rows) if self.capacity is not None else None
        if seq is not None:
            seq.abort()
            return seq
        for seq in self.running:
            if seq.index == request_id and not seq.finished:
                seq.abort()
                self._retire()
                return seq
        return None

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.prefill.staging)

    def reserve(self, rows: int | None, capacity: int) -> int:
        """Allocate every layout once, `capacity` K/V slots per row, for `rows` sequences in flight
        (None: as many as the policy uses), fewer if `max_kv_slots` cannot hold them. Returns the rows
        granted. Requests that need more are refused by `validate`."""
        self.rows, self.speculation = self.parts.reserve(rows, capacity, self.scheduler)
        self.stats.calibration_s += self.parts.calibration_s
        self.capacity = capacity
        return self.rows.max_rows

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
        """Admit and prefill what the policy allows, then one round over the rows it selects; the
        step's token budget bounds what prefill and the drafter's catch-ups feed together.
        Returns the sequences that finished during this step."""
        if not self.has_unfinished():
            return []
        if self.capacity is None:
            self.reserve(len(self.waiting), max(self.slots_for(len(s.prompt_ids), s.params) for s in self.waiting))
        self.trace.begin(self.steps)
        self.steps += 1
        fed = self._admit()
        finished = self._retire()
        if self.running:
            # Prompt and drafter catch-up tokens share one budget a step, besides the round itself.
            allowance = None if self.prefill.budget is None else self.prefill.budget - fed
            self._round(self.scheduler.select(self.running, self.stats.rounds), allowance)
            finished += self._retire()
        self.stats.extra.update({**self.scheduler.counters(), **self.rows.counters()})
        return finished

    def _admit(self) -> int:
        """Prefill what the policy admits (`batchspec.prefill`) and start the prompts now complete;
        returns the prompt tokens fed."""
        started, fed = self.prefill.run(self.waiting, len(self.running), self.rows, self.trace, self.stats)
        for seqs, logits in started:
            self._start(seqs, logits)
        return fed

    def _start(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        """Rows whose prompt is in: the target's last prompt logits [b, vocab] give the first token."""
        first = sampling.choose_tokens(logits, seqs, 0, self.randomness).tolist()
        for b, (s, token) in enumerate(zip(seqs, first)):
            s.extend([token])
            if s.logprobs is not None:  # only rows that asked pay for them
                s.logprobs += logprobs_of(logits[b, None], s.params, [token], s.params.logprobs)
            self.stats.prefill_tokens += len(s.prompt_ids)
        self.running.extend(seqs)

    def _round(self, group: list[int], allowance: int | None) -> None:
        """Draft, verify, accept and commit for rows `group` (indices into `running`).

        The speculation policy plans the round (how many drafter steps at most, 0 for a plain decoding
        step that leaves the drafter out; catch-ups within `allowance` tokens) and settles how many of
        the proposed drafts each row verifies. The target is fed the longest row's drafts; acceptance
        caps every row at its own."""
        seqs = [self.running[i] for i in group]
        t0 = self.rows.clock()
        self.rows.load(group, seqs)
        plan = self._plan(seqs, allowance)
        proposal, draft = self._draft(seqs, plan)
        t1 = self.rows.clock()
        pending = torch.tensor([s.tail(1) for s in seqs], dtype=torch.long, device=self.rows.device)
        logits = self.rows.forward(torch.cat([pending, draft.tokens], dim=1))  # [b, 1 + drafts, vocab]
        t2 = self.rows.clock()
        tokens, count = self._accept(draft, logits, seqs)
        self._commit(group, seqs, tokens, count, proposal, draft, logits)
        t3 = self.rows.clock()
        catch_ups = self.rows.drafter.catch_ups()  # deferred prefills, not drafting
        catch_up = sum(c.seconds for c in catch_ups)
        self.speculation.observe(seqs, plan, draft, count, RoundTimes(t1 - t0 - catch_up, t2 - t1, t3 - t2, catch_up))
        self.stats.draft_time += t1 - t0
        self.stats.verify_time += t2 - t1
        self.stats.other_time += self.rows.clock() - t2
        if self.trace.enabled:
            self.trace.record_round([s.index for s in seqs], catch_ups, self.rows.clock() - t0 - catch_up,
                                    drafter_steps=proposal.width, verify_width=draft.width,
                                    verified=draft.row_lengths().tolist(), emitted=count.tolist(),
                                    probe=plan.steer is not None and plan.steer.probe)

    def _plan(self, seqs: list[Sequence], allowance: int | None) -> RoundPlan:
        if not self.speculation.weighs_backlog:
            return self.speculation.plan(seqs, None, allowance)
        lags, fast = self.rows.drafter.backlog(seqs)
        return self.speculation.plan(seqs, lags, allowance, fast)

    def _draft(self, seqs: list[Sequence], plan: RoundPlan) -> tuple[Draft, Draft]:
        """What the drafter proposed and what the policy chose to verify of it."""
        drafter = self.rows.drafter
        if plan.steps == 0:
            drafter.skip(seqs)
            nothing = empty_draft(len(seqs), self.rows.device)
            return nothing, nothing
        pick = sampling.draft_picker(seqs, self.randomness)
        if plan.steer is not None:
            proposal = drafter.propose_steered(seqs, plan.steps, pick, plan.steer)
        else:
            proposal = drafter.propose(seqs, plan.steps, pick)
        return proposal, self.speculation.settle(plan, proposal)

    def _accept(self, draft: Draft, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens [b, k+1] and counts [b]: row b emits tokens[b, :count[b]], each row by its own rule
        (the audit's deliberately wrong `naive-bonus` engine overrides this)."""
        return sampling.accept_round(draft, logits, seqs, self.randomness)

    def _commit(self, group: list[int], seqs: list[Sequence], tokens: torch.Tensor, count: torch.Tensor,
                proposal: Draft, draft: Draft, logits: torch.Tensor) -> None:
        """Each row takes its accepted tokens; both models keep the K/V of what was accepted. A row that
        asked for logprobs gets those of the tokens it took (fewer than emitted where a stop token or
        its budget ends it), slot j's logits [b, j] being the ones that chose its j-th token."""
        rounds = zip(seqs, tokens.tolist(), count.tolist(), proposal.row_lengths().tolist(), draft.row_lengths().tolist())
        for b, (s, toks, n, offered, chosen) in enumerate(rounds):
            taken, accepted = s.record_round(toks[:n], offered, chosen)
            if s.logprobs is not None:
                s.logprobs += logprobs_of(logits[b, :taken], s.params, toks[:taken], s.params.logprobs)
            self.stats.drafted += chosen
            self.stats.accepted += accepted
            self.stats.generated += taken
        self.rows.commit(group, seqs)
        self.stats.rounds += 1
        if self.checker is not None:
            sample = sorted({group[self.stats.rounds % len(group)], group[-1]})
            self.checker(self.rows.views(self.running, sample), self.stats.rounds)

    def _retire(self) -> list[Sequence]:
        """Drop finished rows everywhere (they stop costing compute) and return them."""
        keep = [not s.finished for s in self.running]
        if all(keep):
            return []
        finished = [s for s in self.running if s.finished]
        self.rows.remember([i for i, s in enumerate(self.running) if s.finished], finished)
        self.speculation.forget(finished)
        order = self.rows.drop(keep)
        self.running = [self.running[i] for i in order]
        return finished
