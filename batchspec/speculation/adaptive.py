"""Adaptive speculation: how many drafts pay for themselves, round by round, on measured costs (the
package docstring has the model)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..costs import Costs, round_time
from ..draft import SHARED_CATCH_UP, Draft
from ..sampling import REJECTION, draft_confidence, rule
from ..sequence import Sequence
from .estimates import SAMPLED, AcceptanceModel
from .plan import RoundPlan, RoundTimes, Speculation

# Catch-ups must be expected to save this many times their cost (see `leave_out`): a margin for the
# estimate's errors, small enough to let through the drafter's prefill of long prompts where it pays
# (the replay that chose it: docs/results/history.md, "Constants in the code").
CATCH_UP_PAYBACK = 1.25
PROBE_SHARE = 0.03  # of the time spent in plain steps, at most this goes to probing whether drafting pays again
# The measured accounts (`AdaptiveSpeculation.draft_account`, `.catch_up_account`) hold at most this many
# plain steps' worth of savings: enough to ride out a few rounds that reject every draft, or a long
# prompt's catch-up, where drafting pays on the whole; little enough that when it stops paying (the
# batch grew, the text changed) plain decoding takes over within about as many steps' loss.
ACCOUNT_STEPS = 8
# A round drafts only if it promises this much more than a plain step: its costs and acceptance are
# noisy estimates, and drafting for a 1% gain loses whenever they err.
OPEN_MARGIN = 0.05
PROMISE_SLACK = 1e-9  # relative: far beyond float64 rounding, far below any estimate's error


def drafting_lags(lags: list[int], caps: list[int]) -> list[int]:
    """[b] the lag of each row that may draft (cap > 0), 0 for the others: what catching up costs."""
    return [lag if cap > 0 else 0 for lag, cap in zip(lags, caps)]


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
    fast: list[bool]  # [b] row b's catch-up runs on the drafter's prompt path
    allowance: int | None = None  # catch-up tokens this step may still feed (None: unbounded)
    probe: bool = False
    probe_cost: float = 0.0  # predicted seconds a probe adds to a plain step (set when it is one)
    steps: int = 0  # drafter steps run so far
    confidence: torch.Tensor = field(init=False)  # [b, k_max], NaN where not observed
    source: torch.Tensor = field(init=False)  # [b, k_max]
    predicted: torch.Tensor = field(init=False)  # [b, k_max] `alpha` as planned, before any draft
    feed: torch.Tensor = field(init=False)  # [b] tokens of a catch-up fed without drafting (`pieces`)

    def __post_init__(self) -> None:
        self.predicted = self.alpha.clone()
        self.feed = torch.zeros_like(self.backlog)
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

    def lags(self) -> list[int]:
        """[b] the backlog of the rows that draft, 0 for the others."""
        return drafting_lags(self.backlog.tolist(), self.caps.tolist())

    def pieces(self) -> torch.Tensor:
        return self.feed

    def observed(self, step: int, logits: torch.Tensor, tokens: torch.Tensor, forced: torch.Tensor | None) -> None:
        confidence = draft_confidence(logits, tokens, forced, self.seqs).double().cpu()
        source = torch.full((len(self.seqs),), SAMPLED, dtype=torch.long) if forced is None else forced.long().cpu()
        self.confidence[:, step] = confidence
        self.source[:, step] = source
        self.alpha[:, step] = self.policy.model.calibrate(self.seqs, step, confidence, source)
        self.steps = step + 1

    def cumulative(self, width: int, alpha: torch.Tensor | None = None,
                   caps: torch.Tensor | None = None) -> torch.Tensor:
        """[b, width] P(row b accepts its first j + 1 drafts), 0 past each row's cap; from `alpha`
        [b, k_max] per-slot probabilities and `caps` [b] instead of the round's own when given."""
        alive = torch.arange(width)[None, :] < (self.caps if caps is None else caps)[:, None]
        return torch.cumprod((self.alpha if alpha is None else alpha)[:, :width], dim=1) * alive


class AdaptiveSpeculation(Speculation):
    """LibraSpec's marginal rule over the whole round, on measured costs (see the module docstring)."""

    weighs_backlog = True

    def __init__(self, k_max: int, costs: Costs, chunk: int | None = None, asks_first: bool = False) -> None:
        self.k_max = k_max
        self.costs = costs
        self.chunk = chunk  # catch-up tokens a step may feed (the engine's per-step budget; None: any)
        self.asks_first = asks_first  # the drafter drafts only where `open` says to: `idle` may settle a round
        self.model = AcceptanceModel(k_max)
        # Seconds of probing earned: PROBE_SHARE of each plain step since the drafter last ran, less
        # what probes measured to cost beyond their prediction (`observe`), so probing stays within
        # PROBE_SHARE of plain decoding's time even where catch-ups or verifies cost more than the table
        # says.
        self.probe_credit = 0.0
        # Measured accounts, seconds, each capped at ACCOUNT_STEPS plain steps and raised by PROBE_SHARE
        # of every plain step: `draft_account`, what drafting rounds saved (+) or lost (-) against plain
        # steps emitting the same tokens (drafting waits while it is negative); `catch_up_account`, the
        # catch-ups' seconds against what the drafting rounds after them saved (a new catch-up waits
        # while it is negative). Apart, because a catch-up pays back only through the drafting it
        # opens: one account for both would stop the drafting that repays it.
        self.draft_account = 0.0
        self.catch_up_account = 0.0

    def round_time(self, rows: int, width: int, steps: int) -> float:
        """Seconds of a round verifying `width` drafts per row after `steps` drafter steps."""
        return round_time(self.costs, rows, width, steps)

    def best_width(self, steer: RoundSteering, lo: int, hi: int, steps_run: int,
                   extra: float = 0.0, cumulative: torch.Tensor | None = None) -> tuple[int, float]:
        """The width in [lo, hi] with the most expected tokens per second, and that rate; widths
        beyond the `steps_run` drafts in hand pay for the drafter steps still needed, every width
        `extra` seconds. `cumulative` [b, >= hi]: acceptance to rate by (default the round's own,
        `steer.cumulative`). An empty range rates -inf."""
        if hi < lo:
            return lo, float("-inf")
        cumulative = steer.cumulative(hi) if cumulative is None else cumulative[:, :hi]
        return self.best_rate(len(steer.seqs), [0.0, *cumulative.sum(dim=0).cumsum(dim=0).tolist()], lo, hi,
                              steps_run, extra)

    def best_rate(self, rows: int, gains: list[float], lo: int, hi: int, steps_run: int = 0,
                  extra: float = 0.0) -> tuple[int, float]:
        """`best_width` for `rows` rows whose width w is expected to commit gains[w] drafts in all."""
        best = (lo, float("-inf"))
        for width in range(lo, hi + 1):
            rate = (rows + gains[width]) / (self.round_time(rows, width, max(width, steps_run)) + extra)
            if rate > best[1]:
                best = (width, rate)
        return best

    def plan(self, seqs: list[Sequence], backlog: list[int] | None = None, allowance: int | None = None,
             fast: list[bool] | None = None) -> RoundPlan:
        remaining = [s.remaining for s in seqs]
        caps = [min(max(left - 1, 0), self.k_max) for left in remaining]
        if max(caps) == 0:
            return RoundPlan(0)
        lags = backlog if backlog is not None else [0] * len(seqs)
        fast = fast if fast is not None else [False] * len(seqs)
        alpha = self.model.expected_rows(seqs)
        if self.asks_first and self.idle(alpha, caps, lags, allowance, fast):
            return RoundPlan(0, declined=True)
        return RoundPlan(max(caps), RoundSteering(self, seqs, torch.tensor(caps), torch.tensor(alpha, dtype=torch.float64),
                                                  torch.tensor(lags), torch.tensor(remaining), fast, allowance))

    def idle(self, alpha: list[list[float]], caps: list[int], lags: list[int], allowance: int | None,
             fast: list[bool]) -> bool:
        """Whether `open` would surely make this round a plain step that feeds no catch-up and runs
        no probe, found on the rows' lists in Python floats (most rounds are such rounds where
        speculation does not pay, and `open`'s few dozen operations on [b, k] tensors would cost
        ~1% of a plain step); if so, the round is booked as `open` books a declined one and the
        drafter is not asked. `alpha` [b][k_max], `caps` [b], `lags` [b] and `fast` [b] as
        `RoundSteering` holds them. Such a round is one where no long catch-up starts and no row
        drafts, because either
        - not even every row drafting promises the margin, so no set of rows does (a row more only
          adds to what a width promises): `leave_out` would catch no row up; or
        - drafting has measured a loss not yet paid back (`book`), and no row lags long or
          catch-ups too wait for theirs to be paid back."""
        plain = self.round_time(len(caps), 0, 0)
        lags = drafting_lags(lags, caps)
        waiting = self.draft_account < 0 and (self.catch_up_account < 0 or max(lags) <= SHARED_CATCH_UP)
        if not waiting and self.promising(alpha, caps, plain):
            return False
        if allowance is not None and sum(n for n in lags if n <= SHARED_CATCH_UP) > allowance:
            return False  # a short catch-up would be fed a piece (`within_budget`)
        if self.probe_price(lags, plain, fast) is not None:
            return False
        self.decline(plain)
        return True

    def promising(self, alpha: list[list[float]], caps: list[int], plain: float) -> bool:
        """Whether some width could beat a plain step (`plain` seconds) by OPEN_MARGIN if every row
        drafted up to its cap at `alpha` [b][k_max] (`best_width`'s rate, in Python floats: its
        sums may differ in the last bits, so the margin is taken PROMISE_SLACK narrower and a
        round this calls hopeless is one `best_width` would too)."""
        rows, top = len(caps), max(caps)
        by_slot = [0.0] * top  # sum over rows of P(first j + 1 drafts accepted)
        for row, cap in zip(alpha, caps):
            accepted = 1.0
            for j in range(cap):
                accepted *= row[j]
                by_slot[j] += accepted
        gains = [0.0]
        for expected in by_slot:
            gains.append(gains[-1] + expected)
        _, best = self.best_rate(rows, gains, 1, top)
        return best * (1 + PROMISE_SLACK) > rows / plain * (1 + OPEN_MARGIN)

    def probe_price(self, lags: list[int], plain: float, fast: list[bool]) -> float | None:
        """Seconds a one-draft probe of rows lagging `lags` tokens (0: not drafting; `fast`: on the
        drafter's prompt path) would add to a plain step (`plain` seconds), if the probe credit covers
        them (None: not yet)."""
        one_draft = self.round_time(len(lags), 1, 1)
        if one_draft - plain > self.probe_credit:  # its catch-ups only add to that: priced only when not
            return None
        probe = sum(self.catch_up_time(lags, long, fast) for long in (False, True)) + one_draft - plain
        return probe if probe <= self.probe_credit else None

    def decline(self, plain: float) -> None:
        """A plain step (`plain` seconds) the policy chose: probing and both accounts earn their share."""
        self.probe_credit += PROBE_SHARE * plain
        self.draft_account = min(self.draft_account + PROBE_SHARE * plain, ACCOUNT_STEPS * plain)
        self.catch_up_account = min(self.catch_up_account + PROBE_SHARE * plain, ACCOUNT_STEPS * plain)

    def catch_up_time(self, lags: list[int], long: bool, fast: list[bool]) -> float:
        """Predicted seconds of catching up rows lagging `lags` tokens (0: a row that does not
        draft): their long lags (`long`: a forward of each row's own, on the drafter's prompt path
        where `fast` says so) or their short ones (one forward shared by all rows)."""
        if long:
            return sum(self.catch_up_cost(n, f) for n, f in zip(lags, fast) if n > SHARED_CATCH_UP)
        short = max((n for n in lags if n <= SHARED_CATCH_UP), default=0)
        return self.costs.draft_time(len(lags), short) if short > 0 else 0.0

    def catch_up_cost(self, lag: int, fast: bool = False) -> float:
        """Predicted seconds of feeding one row a lag of `lag` tokens alone: one forward, or under a
        per-step budget one forward per `chunk` tokens (a piece a step); on the drafter's prompt path
        if `fast` (a deferred prefill: its pieces continue on it), else by its weights' kernel."""
        forward = self.costs.prompt_time if fast else (lambda tokens: self.costs.draft_time(1, tokens))
        if self.chunk is None or lag <= self.chunk:
            return forward(lag)
        whole, rest = divmod(lag, self.chunk)
        return whole * forward(self.chunk) + (forward(rest) if rest else 0.0)

    def catch_up_delay(self, lag: int) -> int:
        """Steps a row decodes plainly while its catch-up of `lag` tokens is fed a piece a step,
        before the step that finishes it (and drafts): 0 when unbounded or one piece holds it."""
        return 0 if self.chunk is None else max(-(-lag // self.chunk) - 1, 0)

    def within_budget(self, steer: RoundSteering) -> None:
        """Fit this step's catch-ups into its allowance: the drafting rows' lags, smallest first (so
        a catch-up begun in earlier steps, with little left, tends to finish first), as long as they
        fit; the first that does not is fed what is left of the allowance as a piece
        (`RoundSteering.pieces`), and no row whose lag does not fit drafts this round. Pieces go to short lags too: with an allowance under
        SHARED_CATCH_UP, a short lag that waited for room to be fed whole would never be."""
        steer.feed = torch.zeros_like(steer.backlog)
        if steer.allowance is None:
            return
        steer.caps = steer.caps.clone()
        left = steer.allowance
        lagging = (steer.caps > 0) & (steer.backlog > 0)
        for b in sorted(lagging.nonzero().flatten().tolist(), key=lambda b: int(steer.backlog[b])):
            lag = int(steer.backlog[b])
            if lag <= left:
                left -= lag
                continue
            steer.caps[b] = 0
            if left > 0:
                steer.feed[b], left = left, 0

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
        The baseline R_0 is what `open` will then do, not that optimism: weighed against the other
        rows drafting at the bound, a new prompt can be left out and `open` then find the rest not
        worth drafting for. And the choice is of a set, not row by row (each row's own saving against
        its own catch-up): leaving out one row can leave the others unable to pay for the padded
        verify, and the batch runs plain steps to the end (both seen in replays: docs/results/history.md)."""
        lagging = steer.backlog > SHARED_CATCH_UP
        top = int(steer.caps.max())
        if not bool(lagging.any()) or top == 0:
            return
        if self.catch_up_account < 0:  # catch-ups have not yet been paid back by drafting: no new one
            steer.caps = torch.where(lagging, 0, steer.caps)
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

        cost = {b: self.catch_up_cost(int(steer.backlog[b]), steer.fast[b]) for b in lagging.nonzero().flatten().tolist()}
        order = sorted(cost, key=cost.get)
        drafting = ~lagging
        before = rate(drafting)
        best = (0.0, 0)  # (seconds saved beyond the margin, rows caught up)
        tokens_left = spent = 0.0  # of the rows caught up so far
        for k, b in enumerate(order, start=1):
            drafting[b] = True
            # fed a piece a step (`chunk`), a row drafts only from the step that finishes its catch-up
            backlog = int(steer.backlog[b])
            tokens_left += max(int(steer.remaining[b]) - self.catch_up_delay(backlog), 0)
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
        beyond a plain step, less what earlier probes cost beyond their prediction. No round drafts
        (probes aside) while the drafting account is negative (`book`). Under a per-step budget the
        catch-ups are fitted into this step's allowance first (`within_budget`); the pieces of the
        long ones chosen are fed even when the round then does not draft, since they were chosen for
        the rounds after it."""
        everyone = steer.caps.clone()
        rows = len(steer.seqs)
        plain = self.round_time(rows, 0, 0)
        self.leave_out(steer)
        self.within_budget(steer)
        chosen = steer.feed
        if int(steer.caps.max()) > 0 and self.draft_account >= 0:
            _, stop = self.best_width(steer, 0, 0, 0)
            _, go = self.best_width(steer, 1, int(steer.caps.max()), 0)
            if go > stop * (1 + OPEN_MARGIN):
                tokens = rows * float(steer.remaining[steer.drafting()].double().mean())
                if self.saving(tokens, stop, go) > CATCH_UP_PAYBACK * self.catch_up_time(steer.lags(), False, steer.fast):
                    self.probe_credit = min(self.probe_credit, 0.0)  # earned while idle; a debt stays
                    return True
        steer.caps = everyone
        probe = self.probe_price(steer.lags(), plain, steer.fast)
        if probe is not None:
            self.within_budget(steer)
            if int(steer.caps.max()) > 0:
                self.probe_credit = 0.0
                steer.probe, steer.probe_cost = True, probe
                return True
        steer.feed = chosen
        self.decline(plain)
        return False

    def settle(self, plan: RoundPlan, draft: Draft) -> Draft:
        steer = plan.steer
        assert steer is not None
        width = draft.width
        if width == 0:  # the drafter did not run: a plain step
            return draft
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
        for slot in range(min(drafted, top)):
            alpha = steer.predicted.clone()
            alpha[:, : slot + 1] = steer.alpha[:, : slot + 1]
            cumulative = steer.cumulative(top, alpha, planned)
            _, stop = self.best_width(steer, 0, slot, slot + 1, cumulative=cumulative)
            _, go = self.best_width(steer, slot + 1, top, slot + 1, cumulative=cumulative)
            if go <= stop:
                return slot
        return drafted

    def observe(self, seqs: list[Sequence], plan: RoundPlan, draft: Draft, count: torch.Tensor,
                times: RoundTimes) -> None:
        steps = 0
        if plan.declined:
            self.model.age(seqs)  # a round that judged no draft (as `record` of one)
        elif plan.steer is not None:
            steer = plan.steer
            steps = steer.steps
            width = draft.width
            lengths = draft.row_lengths().cpu()
            self.model.record(seqs, lengths, count.cpu() - 1, steer.confidence[:, :width], steer.source[:, :width])
            if steer.probe:
                self.probe_credit -= max(0.0, self.round_loss(len(seqs), count, times) - steer.probe_cost)
            else:
                self.book(len(seqs), count, times, drafted=steps > 0)
        self.costs.observe(len(seqs), draft.width, steps, times.draft, times.verify, times.other)

    def book(self, rows: int, count: torch.Tensor, times: RoundTimes, drafted: bool) -> None:
        """Enter a round in the measured accounts: a drafting round's own loss or saving (its
        catch-ups apart), its saving again as the return on the catch-ups before it, and any
        catch-up's seconds."""
        cap = ACCOUNT_STEPS * self.round_time(rows, 0, 0)
        returned = 0.0
        if drafted:
            loss = self.round_loss(rows, count, times._replace(catch_up=0.0))
            self.draft_account = min(self.draft_account - loss, cap)
            returned = max(0.0, -loss)
        self.catch_up_account = min(self.catch_up_account + returned - times.catch_up, cap)

    def round_loss(self, rows: int, count: torch.Tensor, times: RoundTimes) -> float:
        """Seconds a round measured to cost beyond what plain steps take to emit its tokens (negative:
        saved): a plain step of these rows emits one token per row, the round emitted count [b]."""
        return times.total - self.round_time(rows, 0, 0) * float(count.sum()) / rows

    def forget(self, seqs: list[Sequence]) -> None:
        self.model.forget(seqs)
