"""How many drafts each row verifies each round: `fixed` (K every round, as the paper does) or
`adaptive` (as many as pay for themselves, on measured costs).

Adaptive speculation maximises the expected committed tokens per second of round time. A round of
`rows` rows verifying w drafts each (after s drafter steps) takes T(w, s) = s drafter steps + one
verify forward of w + 1 tokens per row + the per-round overhead (`batchspec.costs`, measured), and
commits E(w) = rows + sum over rows b and slots j < w of P_b(j), P_b(j) being the probability that
row b's first j + 1 drafts are all accepted. The verify forward is rectangular (padded to the
longest row), so a slot below the round's width costs every row's share whether a row uses it or
not: the decision is the round's width, and every row gets min(width, what it proposed, its own
budget). That is TETRIS's allocation (slots to the rows and positions with the highest cumulative
acceptance under the round's cost) for a cost that depends on the padded shape.

P_b(j) is the product of per-draft acceptance probabilities (LibraSpec). Before drafting they are
predicted from each row's recent acceptance at each position (`AcceptanceModel.expected`); once the
drafter has computed a draft, from its own confidence in it, calibrated online against what the
target really accepted, per draft position and confidence bin, with a per-row correction
(`AcceptanceModel.calibrate`). The width is decided step by step (`RoundSteering`): before each
drafter step, draft on only if some width beyond the drafts in hand promises a better rate than
stopping with the best prefix of them (their drafting time is sunk either way: LibraSpec's marginal
criterion, with a full look-ahead rather than one step); after drafting, verify the best prefix.
Width 0 is a plain decoding step: the drafter does not run at all. When the estimates keep the batch
at width 0, a one-draft probe runs now and then, so that acceptance that recovers (a row starts
copying code, say) is noticed: once the plain steps since the drafter last ran add up to
1 / PROBE_SHARE times what a probe costs beyond a plain step, so probing never costs more than
PROBE_SHARE of plain decoding's time.

The drafter may first have to catch rows up: it has not seen what plain steps committed, nor the
prompts of rows it never drafted for (it prefills lazily, `batchspec.drafters.model`). Catching up
is an investment: paid once, it opens the rounds after it, so it is weighed against what drafting
saves over the tokens the rows have left, not charged to one round. A short lag (a few plain steps)
is caught up in one forward shared by all rows. A long one (a prompt, a long run of plain steps) is
weighed for the batch before the round (`leave_out`): the lagging rows worth catching up are chosen
together, since the verify is padded to every row and one more row drafting can be what makes the
rounds pay for all; a row left out (its cap is 0) decodes plainly. Where speculation gains little
(a large batch on a CPU) no catch-up pays, the drafter never runs, and plain decoding costs what
`ar` does.

Nothing here consumes randomness, and every decision uses past tokens, logits and timings only, so
greedy and seeded (coupled) rows stay token-identical to plain decoding whatever width is chosen.
For rejection-sampled rows, whether draft j is verified must not depend on draft j itself: their
confidence is sum(q^2), known before a draft is drawn, and their width is chosen slot by slot from
what was known before each draw (`blind_width`), so the rule stays distribution-preserving.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from .costs import Costs
from .draft import SHARED_CATCH_UP, Draft
from .sampling import REJECTION, draft_confidence, rule
from .sequence import Sequence

BINS = 10  # confidence bins; one more for drafts without a confidence (n-gram proposals)
NO_CONFIDENCE = BINS
SAMPLED, FORCED = 0, 1  # a draft drawn from the drafter's distribution, or proposed deterministically
# Pseudo-observations behind every prior, so a few outcomes move an estimate but a few rejections do not
# turn a row off. In the replay (`leave_out`), 8 beat 4 at batch 2 (1.23x vs 1.20x plain decoding) and
# tied elsewhere; 2 turned translation off at batch 1 (0.97x vs 1.49x).
PRIOR_WEIGHT = 8.0
ROW_PRIOR = 1.0  # ... behind a row's correction factor (1 when nothing is known): rows differ a lot
POSITION_PRIOR = 0.6  # acceptance expected of a draft before anything is known
LOOKUP_PRIOR = 0.5  # ... of a draft without a confidence
GLOBAL_DECAY = 0.998  # per round: calibration follows drift over a few hundred rounds
ROW_DECAY = 0.9  # per round of the row: its own history over the last ten or so
MAX_ACCEPTANCE = 0.999
# Catch-ups must be expected to save this many times their cost (see `leave_out`). In a replay of 36
# SpecBench prompts (`scripts/spec_replay.py`), 1.5 declined the drafter's prefill of ~1,000-token
# summarization and RAG prompts at batch 1 where it pays (1.13x and 1.00x of plain decoding against
# 1.46x and 1.12x); 1.0 and 1.25 tied at batches 1, 4 and 8, 1.25 was 1% faster at batch 2.
CATCH_UP_PAYBACK = 1.25
PROBE_SHARE = 0.03  # of the time spent in plain steps, at most this goes to probing whether drafting pays again
# A round drafts only if it promises this much more than a plain step: its costs and acceptance are
# estimates (two runs of the same plain steps here took 19.1 and 21.3 s), and drafting for a 1% gain
# loses whenever they err.
OPEN_MARGIN = 0.05


@dataclass
class RoundPlan:
    """What the engine asks the drafter for: up to `steps` drafter steps (0: a plain decoding step),
    steered by `steer` when the policy adapts."""

    steps: int
    steer: RoundSteering | None = None


class Speculation(ABC):
    """A speculation policy: plans a round, trims what the drafter proposed, learns from the outcome."""

    weighs_backlog = False  # whether `plan` reads the drafter's backlog (the engine asks for it only then)

    @abstractmethod
    def plan(self, seqs: list[Sequence], backlog: list[int] | None = None) -> RoundPlan:
        """The round for these rows; backlog[b]: tokens the drafter must be fed (catch up on) before
        it can draft for row b (`Drafter.backlog`; None: nothing)."""

    def settle(self, plan: RoundPlan, draft: Draft) -> Draft:
        """The drafts to verify, out of what the drafter proposed."""
        return draft

    def observe(self, seqs: list[Sequence], plan: RoundPlan, draft: Draft, count: torch.Tensor,
                times: tuple[float, float, float]) -> None:
        """The round's outcome: `count` [b] tokens emitted per row (accepted drafts + 1) and its
        (draft, verify, other) seconds."""

    def forget(self, seqs: list[Sequence]) -> None:
        """These sequences left the engine."""


class FixedSpeculation(Speculation):
    """K drafts every round for every row (fewer only where the drafter proposes fewer, or no row
    can emit more)."""

    def __init__(self, k: int) -> None:
        self.k = k

    def plan(self, seqs: list[Sequence], backlog: list[int] | None = None) -> RoundPlan:
        return RoundPlan(max(0, min(self.k, max(s.remaining for s in seqs) - 1)))


@dataclass
class _RowHistory:
    """One sequence's recent drafts, per position: accepted, verified, and what the calibration
    table expected of them (for the row's correction factor). Decayed per round."""

    hits: torch.Tensor
    trials: torch.Tensor
    expected: torch.Tensor


class AcceptanceModel:
    """Online acceptance estimates: a calibration table (source x position x confidence bin) shared
    by all rows, and each row's own recent acceptance per position."""

    def __init__(self, k_max: int) -> None:
        self.k_max = k_max
        centers = (torch.arange(BINS, dtype=torch.float64) + 0.5) / BINS
        self.prior = torch.cat([centers, torch.tensor([LOOKUP_PRIOR], dtype=torch.float64)]).expand(2, k_max, -1)
        self.cell_hits = torch.zeros(2, k_max, BINS + 1, dtype=torch.float64)
        self.cell_trials = torch.zeros_like(self.cell_hits)
        self.position_hits = torch.zeros(k_max, dtype=torch.float64)
        self.position_trials = torch.zeros_like(self.position_hits)
        self.rows: dict[int, _RowHistory] = {}

    def _history(self, seqs: list[Sequence]) -> list[_RowHistory]:
        out = []
        for s in seqs:
            if s.index not in self.rows:
                zeros = torch.zeros(self.k_max, dtype=torch.float64)
                self.rows[s.index] = _RowHistory(zeros, zeros.clone(), zeros.clone())
            out.append(self.rows[s.index])
        return out

    def _overall(self) -> tuple[torch.Tensor, torch.Tensor]:
        """[k_max] the rate of all rows at each position, and the pseudo-trials behind it. Each
        position's prior is the rate of the position before it (the first's, POSITION_PRIOR): a
        position is judged only in rounds that drafted that far, so with a fixed prior a position
        never drafted stays at the prior, and a prior below what the drafter achieves would never be
        tested (replayed on SpecBench rounds, no row ever verified a 4th or 5th draft, even on
        math prompts accepted ~85% per draft: `docs/results/spec_replay_position_prior.txt`)."""
        trials = self.position_trials + PRIOR_WEIGHT
        rates = torch.empty_like(trials)
        prior = POSITION_PRIOR
        for j in range(self.k_max):
            rates[j] = (self.position_hits[j] + PRIOR_WEIGHT * prior) / trials[j]
            prior = float(rates[j])
        return rates, trials

    def _shrunk(self, seqs: list[Sequence], overall: torch.Tensor) -> torch.Tensor:
        """[b, k_max] each row's own recent rate, shrunk towards `overall`."""
        history = self._history(seqs)
        hits = torch.stack([h.hits for h in history])
        trials = torch.stack([h.trials for h in history])
        return ((hits + PRIOR_WEIGHT * overall) / (trials + PRIOR_WEIGHT)).clamp(max=MAX_ACCEPTANCE)

    def expected(self, seqs: list[Sequence]) -> torch.Tensor:
        """[b, k_max] each row's acceptance probability per draft position, before drafting: its own
        recent rate, shrunk towards the rate of all rows at that position."""
        return self._shrunk(seqs, self._overall()[0])

    def optimistic(self, seqs: list[Sequence]) -> torch.Tensor:
        """[b, k_max] as `expected`, with the rate of all rows raised by one standard deviation of
        what its trials tell (a Beta posterior's): high while little is known, the rate itself once
        much is. For investments whose return is learning as much as tokens (`leave_out`)."""
        overall, trials = self._overall()
        return self._shrunk(seqs, overall + (overall * (1 - overall) / (trials + 1)).sqrt())

    def _cells(self, position: torch.Tensor, confidence: torch.Tensor, source: torch.Tensor) -> tuple:
        bins = torch.where(torch.isnan(confidence), NO_CONFIDENCE,
                           (confidence.nan_to_num(0.0) * BINS).long().clamp(0, BINS - 1))
        return source, position, bins

    def _table(self, cells: tuple) -> torch.Tensor:
        return (self.cell_hits[cells] + PRIOR_WEIGHT * self.prior[cells]) / (self.cell_trials[cells] + PRIOR_WEIGHT)

    def calibrate(self, seqs: list[Sequence], position: int, confidence: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        """[b] acceptance probability of each row's draft at `position` given the drafter's
        confidence in it (NaN: none) and its source, corrected by how the row has fared against the
        table lately."""
        cells = self._cells(torch.full_like(source, position), confidence.double(), source)
        history = self._history(seqs)
        hits = torch.stack([h.hits.sum() for h in history])
        expected = torch.stack([h.expected.sum() for h in history])
        factor = (hits + ROW_PRIOR) / (expected + ROW_PRIOR)
        return (self._table(cells) * factor).clamp(0.0, MAX_ACCEPTANCE)

    def record(self, seqs: list[Sequence], lengths: torch.Tensor, accepted: torch.Tensor,
               confidence: torch.Tensor, source: torch.Tensor) -> None:
        """Outcomes of one round: row b verified lengths[b] drafts and accepted accepted[b]; slots after
        the first rejection were never judged and teach nothing."""
        width = confidence.shape[1]
        slots = torch.arange(width)[None, :]
        judged = (slots < lengths[:, None]) & (slots <= accepted[:, None])
        hit = (slots < accepted[:, None]).double() * judged
        position = slots.expand_as(judged)
        cells = self._cells(position, confidence.double(), source)
        expected = self._table(cells) * judged
        for table in (self.cell_hits, self.cell_trials, self.position_hits, self.position_trials):
            table.mul_(GLOBAL_DECAY)
        index = tuple(c[judged] for c in cells)
        self.cell_hits.index_put_(index, hit[judged], accumulate=True)
        self.cell_trials.index_put_(index, torch.ones_like(hit[judged]), accumulate=True)
        self.position_hits[:width] += hit.sum(dim=0)
        self.position_trials[:width] += judged.double().sum(dim=0)
        for history, h, j, e in zip(self._history(seqs), hit, judged.double(), expected):
            for values, new in ((history.hits, h), (history.trials, j), (history.expected, e)):
                values.mul_(ROW_DECAY)
                values[:width] += new

    def forget(self, seqs: list[Sequence]) -> None:
        for s in seqs:
            self.rows.pop(s.index, None)


@dataclass
class RoundSteering:
    """One round's drafting under the adaptive policy: knows each row's cap and, per slot, the
    acceptance probability used for decisions (predicted, replaced by the calibrated value once the
    drafter has drafted that slot). The `Steering` a drafter calls."""

    policy: AdaptiveSpeculation
    seqs: list[Sequence]
    caps: torch.Tensor  # [b] most drafts each row can use
    alpha: torch.Tensor  # [b, k_max] per-slot acceptance probability (conditional on the slots before)
    backlog: torch.Tensor  # [b] tokens the drafter must be fed (catch up on) before drafting for the row
    remaining: torch.Tensor  # [b] tokens each row may still commit: what a catch-up pays back over
    probe: bool = False
    steps: int = 0  # drafter steps run so far
    confidence: torch.Tensor = field(init=False)  # [b, k_max], NaN where not observed
    source: torch.Tensor = field(init=False)  # [b, k_max]
    predicted: torch.Tensor = field(init=False)  # [b, k_max] `alpha` as planned, before any draft

    def __post_init__(self) -> None:
        self.predicted = self.alpha.clone()
        self.confidence = torch.full(self.alpha.shape, float("nan"), dtype=torch.float64)
        self.source = torch.full(self.alpha.shape, SAMPLED, dtype=torch.long)

    def proceed(self, step: int) -> bool:
        if step == 0:
            return self.policy.open(self)
        stop = self.policy.best_width(self, 0, step, step)
        go = self.policy.best_width(self, step + 1, int(self.caps.max()), step)
        return go[1] > stop[1]

    def drafting(self) -> torch.Tensor:
        return self.caps > 0

    def observed(self, step: int, logits: torch.Tensor, tokens: torch.Tensor, forced: torch.Tensor | None) -> None:
        confidence = draft_confidence(logits, tokens, forced, self.seqs).double().cpu()
        source = torch.full((len(self.seqs),), SAMPLED, dtype=torch.long) if forced is None else forced.long().cpu()
        self.confidence[:, step] = confidence
        self.source[:, step] = source
        self.alpha[:, step] = self.policy.model.calibrate(self.seqs, step, confidence, source)
        self.steps = step + 1

    def cumulative(self, width: int, alpha: torch.Tensor | None = None) -> torch.Tensor:
        """[b, width] P(row b accepts its first j + 1 drafts), 0 past each row's cap; from `alpha`
        [b, k_max] per-slot probabilities instead of the round's own when given."""
        alive = torch.arange(width)[None, :] < self.caps[:, None]
        return torch.cumprod((self.alpha if alpha is None else alpha)[:, :width], dim=1) * alive


class AdaptiveSpeculation(Speculation):
    """LibraSpec's marginal rule over the whole round, on measured costs (see the module docstring)."""

    weighs_backlog = True

    def __init__(self, k_max: int, costs: Costs) -> None:
        self.k_max = k_max
        self.costs = costs
        self.model = AcceptanceModel(k_max)
        self.idle_s = 0.0  # predicted seconds of plain steps since the drafter last ran

    def round_time(self, rows: int, width: int, steps: int) -> float:
        """Seconds of a round verifying `width` drafts per row after `steps` drafter steps (the first
        feeds two tokens per row, the rest one)."""
        drafting = 0.0 if steps == 0 else self.costs.draft_time(rows, 2) + (steps - 1) * self.costs.draft_time(rows, 1)
        return drafting + self.costs.verify_time(rows, width + 1) + self.costs.overhead()

    def best_width(self, steer: RoundSteering, lo: int, hi: int, steps_run: int,
                   extra: float = 0.0, cumulative: torch.Tensor | None = None) -> tuple[int, float]:
        """The width in [lo, hi] with the most expected tokens per second, and that rate; widths
        beyond the `steps_run` drafts in hand pay for the drafter steps still needed, every width
        `extra` seconds. `cumulative` [b, >= hi]: acceptance to rate by (default the round's own,
        `steer.cumulative`). An empty range rates -inf."""
        if hi < lo:
            return lo, float("-inf")
        rows = len(steer.seqs)
        cumulative = steer.cumulative(hi) if cumulative is None else cumulative[:, :hi]
        gains = torch.cat([torch.zeros(1, dtype=torch.float64), cumulative.sum(dim=0).cumsum(dim=0)])
        best = (lo, float("-inf"))
        for width in range(lo, hi + 1):
            rate = (rows + float(gains[width])) / (self.round_time(rows, width, max(width, steps_run)) + extra)
            if rate > best[1]:
                best = (width, rate)
        return best

    def plan(self, seqs: list[Sequence], backlog: list[int] | None = None) -> RoundPlan:
        remaining = torch.tensor([s.remaining for s in seqs], dtype=torch.long)
        caps = (remaining - 1).clamp(min=0, max=self.k_max)
        top = int(caps.max())
        if top == 0:
            return RoundPlan(0)
        lags = torch.tensor(backlog if backlog is not None else [0] * len(seqs), dtype=torch.long)
        return RoundPlan(top, RoundSteering(self, seqs, caps, self.model.expected(seqs), lags, remaining))

    def catch_up_time(self, steer: RoundSteering, long: bool) -> float:
        """Predicted seconds of catching up the rows that draft this round: their long lags (`long`:
        a forward of each row's own) or their short ones (one forward shared by all rows)."""
        lags = torch.where(steer.drafting(), steer.backlog, 0)
        if long:
            return sum(self.costs.draft_time(1, int(n)) for n in lags[lags > SHARED_CATCH_UP])
        short = lags[lags <= SHARED_CATCH_UP]
        return self.costs.draft_time(len(steer.seqs), int(short.max())) if bool((short > 0).any()) else 0.0

    @staticmethod
    def saving(tokens: float, before: float, after: float) -> float:
        """Seconds saved decoding `tokens` at `after` tokens per second rather than `before`: what a
        catch-up buys, paid once for the rounds it opens."""
        return tokens * (1 / before - 1 / after)

    def leave_out(self, steer: RoundSteering) -> None:
        """Cap at 0 the rows whose long catch-up (a prompt the drafter has not prefilled, a long run
        of plain steps) is not worth its cost to the batch.

        The verify forward is rectangular, so a row left out of drafting still pays for the round's
        width: whether drafting pays at all depends on how many rows draft, and catching up one more
        row can be what makes the rounds worth running for every row. So the choice is of a set: the
        rows without a long lag plus the k cheapest lagging ones. With R_k the best rate a round of
        that set promises (a plain step's if `open` would not draft for it: its rate on expected
        acceptance does not beat a plain step's by OPEN_MARGIN), catching up those
        k rows saves W_k (1 / R_0 - 1 / R_k) seconds over the W_k tokens the batch decodes while they
        are in flight (rows times their mean remaining tokens; other rows, and rows that replace them,
        are taken to draft as now), and costs their catch-ups, which stall every row; the k that
        saves most beyond CATCH_UP_PAYBACK times that cost is taken (none if none does). The estimate
        assumes rows run to max_new_tokens, hence the margin. Acceptance is weighed optimistically
        here (`AcceptanceModel.optimistic`): a catch-up also buys what the rounds it opens teach.
        The baseline R_0 is what `open` will then do, not that optimism: weighed against seven rows
        drafting at the bound, a batch of 8 on the AMX Xeon left a new prompt out, `open` found the
        seven alone not worth drafting for, and the batch ran plain steps on. Weighed row by row
        instead (each row's own saving against its own catch-up), one
        summarization prompt at batch 4 was left out, the other three rows could not pay for the
        padded verify without it, and the batch ran plain steps to the end: a replay of 12 SpecBench
        prompts on the AMX Xeon's costs (`scripts/spec_replay.py`) drafted in 2% of row-rounds at
        1.01x of plain decoding, where fixed K = 2 ran at 1.10x."""
        lagging = steer.backlog > SHARED_CATCH_UP
        top = int(steer.caps.max())
        if not bool(lagging.any()) or top == 0:
            return
        rows = len(steer.seqs)
        expected = steer.cumulative(top)
        optimistic = steer.cumulative(top, self.model.optimistic(steer.seqs))
        plain = rows / self.round_time(rows, 0, 0)

        def rate(drafting: torch.Tensor) -> float:
            _, promised = self.best_width(steer, 1, top, 0, cumulative=expected * drafting[:, None])
            if promised <= plain * (1 + OPEN_MARGIN):
                return plain  # `open` would not draft for this set: its rounds are plain steps
            return self.best_width(steer, 1, top, 0, cumulative=optimistic * drafting[:, None])[1]

        cost = {b: self.costs.draft_time(1, int(steer.backlog[b])) for b in lagging.nonzero().flatten().tolist()}
        order = sorted(cost, key=cost.get)
        drafting = ~lagging
        before = rate(drafting)
        best = (0.0, 0)  # (seconds saved beyond the margin, rows caught up)
        tokens_left = spent = 0.0  # of the rows caught up so far
        for k, b in enumerate(order, start=1):
            drafting[b] = True
            tokens_left += int(steer.remaining[b])
            spent += cost[b]
            saved = self.saving(rows * tokens_left / k, before, rate(drafting)) - CATCH_UP_PAYBACK * spent
            if saved > best[0]:
                best = (saved, k)
        left_out = torch.zeros_like(lagging)
        left_out[order[best[1]:]] = True
        steer.caps = torch.where(left_out, 0, steer.caps)

    def open(self, steer: RoundSteering) -> bool:
        """Whether to run the drafter at all this round (its first step): if the best width promises
        OPEN_MARGIN more tokens per second than a plain step. Rows whose long catch-up does not pay
        are left out; a short one (after plain steps) must save more than CATCH_UP_PAYBACK times
        its cost over the drafting rows' remaining tokens (charged to this round alone, a batch of 8
        that declined one round found the next dearer by the catch-up, and the next dearer still, and
        never drafted again). When the estimates say no, a one-draft probe of every row runs once the
        plain steps since the drafter last ran have taken 1 / PROBE_SHARE times what the probe costs
        beyond a plain step."""
        everyone = steer.caps.clone()
        rows = len(steer.seqs)
        plain = self.round_time(rows, 0, 0)
        self.leave_out(steer)
        if int(steer.caps.max()) > 0:
            _, stop = self.best_width(steer, 0, 0, 0)
            _, go = self.best_width(steer, 1, int(steer.caps.max()), 0)
            if go > stop * (1 + OPEN_MARGIN):
                tokens = rows * float(steer.remaining[steer.drafting()].double().mean())
                if self.saving(tokens, stop, go) > CATCH_UP_PAYBACK * self.catch_up_time(steer, long=False):
                    self.idle_s = 0.0
                    return True
        steer.caps = everyone
        probe = sum(self.catch_up_time(steer, long) for long in (False, True)) + self.round_time(rows, 1, 1) - plain
        if probe <= PROBE_SHARE * self.idle_s:
            self.idle_s = 0.0
            steer.probe = True
            return True
        self.idle_s += plain
        return False

    def settle(self, plan: RoundPlan, draft: Draft) -> Draft:
        steer = plan.steer
        assert steer is not None
        width = draft.width
        deterministic = draft.forced if draft.forced is not None else torch.full(
            draft.tokens.shape, draft.logits is None, dtype=torch.bool)
        if draft.confidence is not None and width > steer.steps:  # slots no steered step looked at
            steer.confidence[:, steer.steps : width] = draft.confidence[:, steer.steps :].double().cpu()
        for step in range(steer.steps, width):  # ... calibrated from the drafter's own confidence, if any
            source = deterministic[:, step].long().cpu()
            steer.source[:, step] = source
            steer.alpha[:, step] = self.model.calibrate(steer.seqs, step, steer.confidence[:, step], source)
        planned = steer.caps  # before the drafts: how far each row could go
        steer.caps = torch.minimum(steer.caps, draft.row_lengths().cpu())
        chosen, _ = self.best_width(steer, 0, width, steer.steps)
        sampled = torch.tensor([rule(s.params) == REJECTION for s in steer.seqs])
        caps = torch.full_like(steer.caps, chosen)
        if bool(sampled.any()):
            caps = torch.where(sampled, self.blind_width(steer, planned, width), caps)
        if steer.probe and width:
            caps = caps.clamp(min=1)
        return draft.capped(torch.minimum(steer.caps, caps).to(draft.tokens.device))

    def blind_width(self, steer: RoundSteering, planned: torch.Tensor, drafted: int) -> int:
        """The width for rejection-sampled rows: slot j is verified only if, on what was known before
        draft j was drawn, verifying it (and the best of the slots after it) promised a better rate
        than stopping before it, slot by slot up to the `drafted` slots, stopping at the first that
        does not. Known before draft j: the calibrated acceptance of slots <= j (their confidence
        sum(q^2) precedes each draw), the pre-round prediction beyond, the rows' `planned` caps and
        the j + 1 drafter steps run; not how many were drafted after it, nor anything else later,
        since slot j + 1's confidence is computed after d_j was drawn. Choosing over every drafted
        slot at once (as greedy and seeded rows may) lets d_j's own value decide whether d_j is
        verified: where the rate is not unimodal in the width (a cheap 1-token step, 2-6 tokens
        about as dear, as the measured CPU tables are) that biases the emitted tokens
        (`tests/test_speculation.py`)."""
        top = int(planned.max())
        alive = torch.arange(top)[None, :] < planned[:, None]
        for slot in range(min(drafted, top)):
            alpha = steer.predicted.clone()
            alpha[:, : slot + 1] = steer.alpha[:, : slot + 1]
            cumulative = torch.cumprod(alpha[:, :top], dim=1) * alive
            _, stop = self.best_width(steer, 0, slot, slot + 1, cumulative=cumulative)
            _, go = self.best_width(steer, slot + 1, top, slot + 1, cumulative=cumulative)
            if go <= stop:
                return slot
        return drafted

    def observe(self, seqs: list[Sequence], plan: RoundPlan, draft: Draft, count: torch.Tensor,
                times: tuple[float, float, float]) -> None:
        steps = 0
        if plan.steer is not None:
            steer = plan.steer
            steps = steer.steps
            width = draft.width
            lengths = draft.row_lengths().cpu()
            self.model.record(seqs, lengths, count.cpu() - 1, steer.confidence[:, :width], steer.source[:, :width])
        self.costs.observe(len(seqs), draft.width, steps, *times)

    def forget(self, seqs: list[Sequence]) -> None:
        self.model.forget(seqs)


def make_speculation(kind: str, k: int, costs: Costs | None) -> Speculation:
    if kind == "adaptive":
        if costs is None:
            raise ValueError("adaptive speculation needs a cost model")
        return AdaptiveSpeculation(k, costs)
    return FixedSpeculation(k)
