"""The adaptive speculation policy on scripted costs (no timing anywhere): when it drafts, how much it
verifies, how its acceptance estimates learn, and that its confidence never looks at a sampled draft."""

from __future__ import annotations

import math

import pytest
import torch
from tinyworld import ScriptedCosts

from batchspec import sampling
from batchspec.acceptance import rejection
from batchspec.config import SamplingParams
from batchspec.costs import break_even
from batchspec.drafters import Draft
from batchspec.sequence import Sequence
from batchspec.speculation import (
    ACCOUNT_STEPS,
    FORCED,
    OPEN_MARGIN,
    PROBE_SHARE,
    SAMPLED,
    AcceptanceModel,
    AdaptiveSpeculation,
    FixedSpeculation,
    RoundPlan,
    RoundTimes,
)

K = 5


def rows(count: int, budget: int = 50, params: SamplingParams | None = None) -> list[Sequence]:
    return [Sequence(i, [5, 6, 7], params or SamplingParams(max_new_tokens=budget), frozenset()) for i in range(count)]


def teach(policy: AdaptiveSpeculation, seqs: list[Sequence], accepted: int, rounds: int = 30) -> None:
    """Rounds in which every row verified K drafts (no confidence) and accepted `accepted` of them."""
    b = len(seqs)
    for _ in range(rounds):
        policy.model.record(seqs, torch.full((b,), K), torch.full((b,), accepted),
                            torch.full((b, K), float("nan"), dtype=torch.float64), torch.full((b, K), SAMPLED))


def expected(model: AcceptanceModel, seqs: list[Sequence]) -> torch.Tensor:
    """[b, k_max] the model's pre-round acceptance estimates (`expected_rows`) as a tensor."""
    return torch.tensor(model.expected_rows(seqs), dtype=torch.float64)


def peaked(b: int, vocab: int, token: int, p: float) -> torch.Tensor:
    """Logits [b, vocab] giving `token` probability p, the rest spread evenly."""
    rest = (1 - p) / (vocab - 1)
    logits = torch.full((b, vocab), float(torch.log(torch.tensor(rest))))
    logits[:, token] = float(torch.log(torch.tensor(p)))
    return logits


@pytest.mark.parametrize("lag", [0, 10, 100])
def test_expensive_drafting_and_low_acceptance_choose_plain_steps_with_rare_probes(lag):
    """Probes whether drafting pays again take at most PROBE_SHARE of the plain steps' time: a probe
    (one draft for every row, after catching them up) runs once the plain steps since the drafter last
    ran cost 1 / PROBE_SHARE times what it adds to a plain step, so a dearer catch-up probes rarer."""
    costs = ScriptedCosts(verify_base=1.0, verify_token=0.3, draft_step=1.0, draft_token=0.01)
    policy = AdaptiveSpeculation(K, costs)
    seqs = rows(2, budget=1000)
    teach(policy, seqs, accepted=0)
    decisions = []
    for _ in range(400):
        steer = policy.plan(seqs, [lag, min(lag, 5)]).steer
        decisions.append((steer.proceed(0), steer.probe))
        if steer.probe:
            assert steer.drafting().all()  # every row, whatever its catch-up
    probes = [i for i, (go, probe) in enumerate(decisions) if probe]
    assert all(go == probe for go, probe in decisions)  # it drafts only to probe
    plain = policy.round_time(2, 0, 0)
    catch_up = {0: 0.0, 10: costs.draft_time(2, 10), 100: costs.draft_time(1, 100) + costs.draft_time(2, 5)}[lag]
    cost = catch_up + policy.round_time(2, 1, 1) - plain
    every = math.ceil(cost / (PROBE_SHARE * plain)) + 1  # plain steps until the budget allows one, then the probe
    assert probes == list(range(every - 1, 400, every))


def taught_pair(costs: ScriptedCosts, accepted: int) -> tuple[AdaptiveSpeculation, list[Sequence], float]:
    """A policy taught that 2 long rows accept `accepted` of K drafts, the rows, and a plain step's time."""
    policy = AdaptiveSpeculation(K, costs)
    seqs = rows(2, budget=100_000)
    teach(policy, seqs, accepted=accepted)
    return policy, seqs, policy.round_time(2, 0, 0)


@pytest.mark.parametrize("overrun", [1.0, 5.0])
def test_probes_cost_at_most_their_share_of_plain_time_as_measured(overrun):
    """Probes whose rounds measure `overrun` times dearer than predicted (a catch-up or verify the
    table underrates) are charged the difference before the next probe: what probes measured to
    cost beyond plain steps stays within PROBE_SHARE of the plain steps' time (plus the one probe
    that overdraws), where the prediction-only rule would spend `overrun` times that."""
    costs = ScriptedCosts(verify_base=1.0, verify_token=0.3, draft_step=1.0, draft_token=0.01)
    policy, seqs, plain = taught_pair(costs, accepted=0)
    plain_s = loss_s = 0.0
    probes = 0
    for _ in range(3000):
        plan = policy.plan(seqs, [0, 0])
        steer = plan.steer
        if not steer.proceed(0):
            plain_s += plain
            continue
        probes += 1
        cost = steer.probe_cost  # predicted: what a probe adds to a plain step
        draft = Draft(torch.zeros(2, 1, dtype=torch.long), None)
        extra = overrun * cost  # ... and what it measured
        policy.observe(seqs, plan, draft, torch.ones(2, dtype=torch.long), RoundTimes(0.0, plain + extra, 0.0))
        loss_s += extra
    predicted_every = math.ceil(cost / (PROBE_SHARE * plain)) + 1  # plain steps + the probe
    assert loss_s <= PROBE_SHARE * plain_s + overrun * cost
    assert probes >= 0.9 * 3000 / predicted_every / overrun  # probing goes on, as often as the share allows
    if overrun > 1:
        assert probes < 0.5 * 3000 / predicted_every  # the prediction alone would probe `overrun` times as often


@pytest.mark.parametrize("slowdown", [1.0, 8.0])
def test_drafting_that_measures_a_loss_waits_until_plain_steps_have_paid_for_it(slowdown):
    """The estimates promise that drafting pays (4 of 5 drafts accepted, as taught and as happens),
    but the rounds take `slowdown` times their predicted time (a cost table that underrates them and
    is never corrected). Measured against plain steps emitting the same tokens, drafting may lose at
    most PROBE_SHARE of the plain steps' time (and probes as much again) plus ACCOUNT_STEPS plain
    steps and one round, where the estimates alone would draft, and lose, every round; rounds that
    deliver what was promised draft every round."""
    costs = ScriptedCosts(verify_base=1.0, verify_token=0.01, draft_step=0.05)
    policy, seqs, plain = taught_pair(costs, accepted=4)
    plain_s = lost_s = worst = 0.0
    drafted = 0
    for _ in range(2000):
        plan = policy.plan(seqs, [0, 0])
        steer = plan.steer
        if not steer.proceed(0):
            plain_s += plain
            continue
        width = 1 if steer.probe else K
        steer.steps = width  # the drafter ran
        spent = slowdown * policy.round_time(2, width, width)
        count = torch.full((2,), 1 + min(width, 4))
        policy.observe(seqs, plan, Draft(torch.zeros(2, width, dtype=torch.long), None), count,
                       RoundTimes(0.0, spent, 0.0))
        loss = spent - plain * float(count.sum()) / 2
        lost_s += loss
        worst = max(worst, loss)
        drafted += not steer.probe
    if slowdown == 1.0:
        assert drafted == 2000 and lost_s < 0
    else:
        assert lost_s <= 2 * PROBE_SHARE * plain_s + (ACCOUNT_STEPS + 1) * plain + worst
        assert 2 <= drafted < 100  # it tries again now and then, as the plain steps pay for it


@pytest.mark.parametrize("repaid", [True, False])
def test_a_catch_up_waits_for_the_last_ones_to_be_paid_back_but_never_stops_the_drafting_that_repays_them(repaid):
    """Each round brings a row whose prompt the drafter has not seen (a long lag), estimated worth
    catching up; the catch-up measures 3 plain steps. Where the drafting after it saves what was
    promised (`repaid`), every lagging row is caught up and drafting goes on; where it saves nothing,
    the next catch-up waits until plain steps have paid for the last (PROBE_SHARE of their time)."""
    costs = ScriptedCosts(verify_base=1.0, verify_token=0.01, draft_step=0.05, draft_token=0.0001)
    policy, seqs, plain = taught_pair(costs, accepted=4)
    caught_up = rounds = 0
    for _ in range(300):
        plan = policy.plan(seqs, [0, 200])  # row 1 lags by a whole prompt
        steer = plan.steer
        if not steer.proceed(0) or steer.probe:
            continue
        rounds += 1
        joined = bool(steer.drafting()[1])
        caught_up += joined
        steer.steps = K
        spent = policy.round_time(2, K, K) if repaid else plain * 5  # 5 tokens a row: a saving, or none
        policy.observe(seqs, plan, Draft(torch.zeros(2, K, dtype=torch.long), None), torch.full((2,), 5),
                       RoundTimes(0.0, spent, 0.0, catch_up=3 * plain if joined else 0.0))
        assert policy.draft_account >= 0  # drafting itself never lost: it never stops
    if repaid:
        assert caught_up == rounds == 300
    else:
        assert rounds == 300 and caught_up <= 300 * PROBE_SHARE / 3 + 1


@pytest.mark.parametrize("asks_first", [False, True])
def test_a_round_drafts_only_for_a_gain_beyond_the_margin(asks_first):
    """Drafting that promises less than OPEN_MARGIN more tokens per second than a plain step is
    turned down: the estimates are noisier than that. The same margin holds where a round can be
    settled before the drafter is asked (`asks_first`: `idle` says no only where `open` would)."""
    ratios, decisions = [], []
    for step in torch.linspace(0.5, 1.2, 71).tolist():
        costs = ScriptedCosts(verify_base=1.0, verify_token=0.0, draft_step=step)
        policy, twin = AdaptiveSpeculation(K, costs, asks_first=asks_first), AdaptiveSpeculation(K, costs)
        seqs = rows(2)
        teach(policy, seqs, accepted=1)
        teach(twin, seqs, accepted=1)
        steer = twin.plan(seqs).steer
        ratios.append(twin.best_width(steer, 1, K, 0)[1] / twin.best_width(steer, 0, 0, 0)[1])
        plan = policy.plan(seqs)
        decisions.append(plan.steer is not None and plan.steer.proceed(0))
    assert decisions == [r > 1 + OPEN_MARGIN for r in ratios]
    assert any(1 < r <= 1 + OPEN_MARGIN for r in ratios) and any(decisions) and not all(decisions)


def test_high_acceptance_and_cheap_drafting_verify_k_max():
    vocab = 11
    policy = AdaptiveSpeculation(K, ScriptedCosts(verify_base=1.0, verify_token=0.02, draft_step=0.05))
    seqs = rows(3)
    teach(policy, seqs, accepted=K)
    steer = policy.plan(seqs).steer
    assert steer.proceed(0)
    tokens = torch.full((3,), 4)
    for step in range(K):
        steer.observed(step, peaked(3, vocab, 4, 0.97), tokens, None)
        if step + 1 < K:
            assert steer.proceed(step + 1)
    draft = Draft(tokens[:, None].expand(3, K), torch.zeros(3, K, vocab))
    assert policy.settle(RoundPlan(K, steer), draft).width == K


def test_a_position_never_drafted_is_expected_to_do_as_well_as_the_one_before_it():
    """A draft position is judged only in rounds that drafted that far. A row that has verified 4
    drafts and accepted every one expects its 5th to be accepted about as often, not at the prior's
    0.6, so on costs like a memory-bound CPU's (the verify barely grows with tokens) it drafts the 5th;
    with a fixed prior the 5th would never be drafted, and never learnt."""
    vocab = 11
    policy = AdaptiveSpeculation(K, ScriptedCosts(verify_base=0.26, verify_token=0.0, draft_step=0.06))
    seqs = rows(1)
    for _ in range(40):
        policy.model.record(seqs, torch.tensor([4]), torch.tensor([4]),
                            torch.full((1, 4), float("nan"), dtype=torch.float64), torch.full((1, 4), SAMPLED))
    alpha = expected(policy.model, seqs)[0]
    assert alpha[4] == pytest.approx(float(alpha[3]), abs=1e-9) and alpha[4] > 0.95
    steer = policy.plan(seqs).steer
    assert steer.proceed(0)
    tokens = torch.full((1,), 4)
    for step in range(4):
        steer.observed(step, peaked(1, vocab, 4, 0.97), tokens, None)
    assert steer.proceed(4)


def test_a_confident_drafter_is_trusted_until_it_is_not():
    """Low drafter confidence at a step stops the round there; the drafts in hand are verified only as
    far as they pay."""
    vocab = 11
    policy = AdaptiveSpeculation(K, ScriptedCosts(verify_base=1.0, verify_token=0.1, draft_step=0.1))
    seqs = rows(2)
    steer = policy.plan(seqs).steer
    assert steer.proceed(0)
    tokens = torch.full((2,), 3)
    steer.observed(0, peaked(2, vocab, 3, 0.95), tokens, None)
    assert steer.proceed(1)
    steer.observed(1, peaked(2, vocab, 3, 0.02), tokens, None)
    assert not steer.proceed(2)
    assert policy.settle(RoundPlan(K, steer), Draft(tokens[:, None].expand(2, 2), torch.zeros(2, 2, vocab))).width == 1


@pytest.mark.parametrize("rows_in_batch", [1, 4])
def test_width_grows_with_acceptance_and_shrinks_with_cost(rows_in_batch):
    seqs = rows(rows_in_batch)
    levels = [i / 20 for i in range(1, 20)]

    def width(acceptance: float, draft_step: float) -> int:
        policy = AdaptiveSpeculation(K, ScriptedCosts(verify_base=1.0, verify_token=0.1, draft_step=draft_step))
        steer = policy.plan(seqs).steer
        steer.alpha[:] = acceptance
        return policy.best_width(steer, 0, K, 0)[0]

    for cost in (0.05, 0.3, 0.6):
        widths = [width(a, cost) for a in levels]
        assert widths == sorted(widths) and widths[0] == 0 and widths[-1] > 0
    for a in levels:
        by_cost = [width(a, cost) for cost in (0.0, 0.1, 0.3, 1.0, 3.0)]
        assert by_cost == sorted(by_cost, reverse=True)


def test_one_draft_pays_exactly_above_the_break_even_acceptance():
    costs = ScriptedCosts(verify_base=1.0, verify_token=0.2, draft_step=0.3)
    seqs = rows(2)
    policy = AdaptiveSpeculation(1, costs)
    even = break_even(costs, 2, 1)
    assert 0 < even < 1
    for acceptance, drafts in ((even - 0.02, 0), (even + 0.02, 1)):
        steer = policy.plan(seqs).steer
        steer.alpha[:] = acceptance
        assert policy.best_width(steer, 0, 1, 0)[0] == drafts
    assert break_even(ScriptedCosts(1.0, 0.2, 10.0), 2, 1) is None  # a step dearer than two tokens' worth


def test_rows_whose_catch_up_does_not_pay_are_left_out():
    """A row the drafter has not caught up on (a prompt it has not prefilled) joins the round only if
    catching it up is expected to save the batch more than feeding it costs: a longer backlog or
    fewer tokens left leave it out; rows without backlog stay. Whether a catch-up pays depends on the
    other rows: where they already draft it adds one row's drafts, where they all lag too, catching
    them all up is what makes drafting worth it (the verify is padded to every row), so a bigger
    backlog each is worth paying for."""
    costs = ScriptedCosts(verify_base=1.0, verify_token=0.02, draft_step=0.05, draft_token=0.002)
    policy = AdaptiveSpeculation(K, costs)
    seqs = rows(4, budget=40) + [Sequence(9, [5, 6, 7], SamplingParams(max_new_tokens=3), frozenset())]
    teach(policy, seqs, accepted=4)
    steer = policy.plan(seqs, [0, 300, 800, 100000, 300]).steer
    assert steer.proceed(0)
    assert steer.drafting().tolist() == [True, True, False, False, False]  # the last: 2 tokens left

    def joined(backlog: int, batch: int, others: int = 0) -> bool:
        seqs = rows(batch, budget=40)
        teach(policy, seqs, accepted=4)
        steer = policy.plan(seqs, [backlog] + [others] * (batch - 1)).steer
        return steer.proceed(0) and bool(steer.drafting()[0])

    backlogs = (0, 500, 2000, 8000, 30000, 100000)
    limits = {}
    for batch, together in ((1, False), (4, False), (4, True)):
        verdicts = [joined(n, batch, n if together else 0) for n in backlogs]
        assert verdicts[0] and not verdicts[-1]
        assert verdicts == sorted(verdicts, reverse=True)  # monotone in the backlog
        limits[batch, together] = verdicts.count(True)
    assert limits[1, False] > limits[4, False]  # a lone catch-up at batch 4 stalls three rows that draft anyway
    assert limits[4, True] > limits[4, False]  # ... but when every row lags, catching all up opens the rounds


def test_catch_ups_are_judged_optimistically_while_acceptance_is_unknown():
    """Catching a row up is an investment whose return is also what the round teaches about
    acceptance: while few drafts have been judged it is weighed at one standard deviation above the
    rate of all rows (the prior's 0.6 with its 8 pseudo-trials: ~0.76), and the bound closes in on the
    rate as trials accumulate. A catch-up that pays at the bound but not at the rate is taken by a
    fresh policy and declined once the rate is known for certain."""
    model = AcceptanceModel(K)
    seqs = rows(2)
    gaps = []
    for trials in (0, 10, 100, 1000):
        model.position_trials.fill_(trials)
        model.position_hits.fill_(0.6 * trials)
        gaps.append(float((model.optimistic(seqs) - expected(model, seqs)).min()))
    assert gaps[0] == pytest.approx(math.sqrt(0.6 * 0.4 / 9), abs=1e-9)
    assert gaps == sorted(gaps, reverse=True) and gaps[-1] < 0.02

    costs = ScriptedCosts(verify_base=1.0, verify_token=0.02, draft_step=0.05, draft_token=0.002)

    def joins(policy: AdaptiveSpeculation, backlog: int) -> bool:
        steer = policy.plan(rows(4, budget=40), [backlog] * 4).steer  # four new rows: every prompt a catch-up
        return steer.proceed(0) and bool(steer.drafting().any())

    fresh, certain = AdaptiveSpeculation(K, costs), AdaptiveSpeculation(K, costs)
    certain.model.position_trials.fill_(1e5)
    certain.model.position_hits.fill_(0.6e5)  # the prior's rate, known for certain
    assert torch.allclose(expected(fresh.model, rows(4)), expected(certain.model, rows(4)))
    assert joins(fresh, 2000) and not joins(certain, 2000)
    assert joins(certain, 1000) and not joins(fresh, 3000)  # both still weigh what it costs


def test_lagging_rows_alone_do_not_open_the_drafter_when_catching_up_does_not_pay():
    policy = AdaptiveSpeculation(K, ScriptedCosts(1.0, 0.02, 0.05, draft_token=0.01))
    seqs = rows(2)
    teach(policy, seqs, accepted=4)
    steer = policy.plan(seqs, [5000, 6000]).steer
    assert not steer.proceed(0)
    steer = policy.plan(seqs, [0, 6000]).steer
    assert steer.proceed(0) and steer.drafting().tolist() == [True, False]  # the row without backlog drafts


def test_rows_cap_at_their_budget_and_rows_without_budget_plan_nothing():
    policy = AdaptiveSpeculation(K, ScriptedCosts(1.0, 0.0, 0.0))
    seqs = rows(3, budget=3)
    seqs[0].generated = [9, 9]  # one token left: no draft can be used
    seqs[1].generated = [9]  # two left: one draft
    plan = policy.plan(seqs)
    assert plan.steps == 2 and plan.steer.caps.tolist() == [0, 1, 2]
    assert policy.plan(seqs[:1]).steps == 0
    assert FixedSpeculation(K).plan(seqs).steps == 2


def test_calibration_learns_what_the_target_accepts():
    model = AcceptanceModel(K)
    seqs = rows(2)
    confident = torch.tensor([0.95, 0.95], dtype=torch.float64)
    source = torch.tensor([SAMPLED, SAMPLED])
    before = model.calibrate(seqs, 0, confident, source)
    assert before.tolist() == pytest.approx([0.95, 0.95])  # the prior trusts the drafter's confidence
    # confident drafts that the target accepts only a third of the time
    for r in range(60):
        hit = 1 if r % 3 == 0 else 0
        model.record(seqs, torch.tensor([1, 1]), torch.tensor([hit, hit]),
                     torch.full((2, 1), 0.95, dtype=torch.float64), torch.full((2, 1), SAMPLED))
    after = model.calibrate(seqs, 0, confident, source)
    assert after.max() < 0.5
    assert expected(model, seqs)[:, 0].max() < 0.5
    lookup = model.calibrate(seqs, 0, torch.tensor([float("nan")] * 2, dtype=torch.float64), torch.tensor([FORCED] * 2))
    assert lookup.tolist() == pytest.approx([0.5, 0.5], abs=0.2)  # another cell: n-gram drafts learn apart


def test_lookup_drafts_are_verified_by_how_long_a_suffix_matched():
    """Before anything is learned, a prompt-lookup proposal after a long match is verified and one
    after a 1-token match is declined where verifying costs; then the table learns the real rates:
    long matches that the target keeps rejecting are declined too."""
    from batchspec.drafters.ngram import match_confidence

    policy = AdaptiveSpeculation(K, ScriptedCosts(verify_base=1.0, verify_token=1.0, draft_step=0.0))
    seqs = rows(1)  # a draft pays above 50% acceptance

    def width(matched: int) -> int:
        steer = policy.plan(seqs).steer
        draft = Draft(torch.full((1, K), 4), None, confidence=match_confidence(torch.tensor([matched]), K))
        return policy.settle(RoundPlan(K, steer), draft).width

    widths = [width(n) for n in range(1, 9)]
    assert widths == sorted(widths) and widths[0] == 0 and widths[-1] >= 2
    rejected = match_confidence(torch.tensor([8]), K).double()
    for _ in range(40):
        policy.model.record(seqs, torch.tensor([K]), torch.tensor([0]), rejected, torch.full((1, K), FORCED))
    assert width(8) == 0


def test_a_row_that_beats_the_table_is_trusted_more():
    model = AcceptanceModel(K)
    seqs = rows(2)
    for _ in range(20):  # row 0 accepts everything, row 1 nothing, at the same confidence
        model.record(seqs, torch.tensor([2, 2]), torch.tensor([2, 0]),
                     torch.full((2, 2), 0.55, dtype=torch.float64), torch.full((2, 2), SAMPLED))
    calibrated = model.calibrate(seqs, 1, torch.tensor([0.55, 0.55], dtype=torch.float64), torch.tensor([SAMPLED] * 2))
    assert calibrated[0] > 0.8 > 0.2 > calibrated[1]
    model.forget(seqs[:1])
    assert 0 not in model.rows and 1 in model.rows


def test_confidence_of_sampled_rows_never_looks_at_the_drawn_token():
    """Rejection rows: sum(q^2), the same whatever token was drawn (keeping a draft because of its own
    probability would bias rejection sampling); greedy and coupled rows: the drafted token's probability;
    forced (n-gram) tokens: their probability under every rule."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]] * 3)
    seqs = [Sequence(0, [1], SamplingParams(), frozenset()),
            Sequence(1, [1], SamplingParams(temperature=1.0, seed=3), frozenset()),
            Sequence(2, [1], SamplingParams(temperature=1.0), frozenset())]
    q = torch.softmax(logits[0], dim=-1)
    for token in range(4):
        tokens = torch.tensor([0, token, token])
        got = sampling.draft_confidence(logits, tokens, None, seqs)
        assert got.tolist() == pytest.approx([float(q[0]), float(q[token]), float((q * q).sum())])
        forced = sampling.draft_confidence(logits, tokens, torch.tensor([False, False, True]), seqs)
        assert float(forced[2]) == pytest.approx(float(q[token]))


@pytest.mark.parametrize("budget, resumes", [(40, True), (3, False)])
def test_a_batch_resumes_drafting_when_its_short_catch_up_pays_over_the_rows_remaining_tokens(budget, resumes):
    """After plain steps every row lags the drafter by a few tokens, caught up in one shared forward
    before drafting resumes. That forward opens every round after it, so it is weighed against what
    drafting saves over the tokens the rows have left, not charged to one round: charged to one round
    (an earlier version), a batch of 8 that declined a single round on the AMX Xeon found the next
    round dearer by the catch-up and never drafted again (0.97x of plain decoding where drafting paid)."""
    costs = ScriptedCosts(verify_base=1.0, verify_token=0.02, draft_step=0.3, draft_token=0.05)
    policy = AdaptiveSpeculation(K, costs)
    seqs = rows(8, budget=budget)
    teach(policy, seqs, accepted=4)
    lag = 10  # a shared catch-up, dearer than a plain step here
    steer = policy.plan(seqs, [lag] * 8).steer
    go = policy.best_width(steer, 1, int(steer.caps.max()), 0)[1]
    plain = policy.best_width(steer, 0, 0, 0)[1]
    extra = costs.draft_time(8, lag)
    assert go > plain * (1 + OPEN_MARGIN) > policy.best_width(steer, 1, int(steer.caps.max()), 0, extra)[1]
    assert steer.proceed(0) == resumes
    if resumes:
        assert steer.drafting().all()


def test_a_catch_up_is_weighed_against_what_the_batch_does_without_it():
    """The baseline a catch-up is weighed against is the rounds the batch would run without it, decided
    as `open` decides them (on expected acceptance): here seven rows drafting would not beat plain
    steps by OPEN_MARGIN, so leaving the eighth row out means plain steps for all, and catching it up
    is what opens drafting. Weighed against seven rows drafting at the optimistic bound (an earlier
    version), the catch-up looked worth less than its cost, the row was left out, the round stayed
    plain, and the batch ran plain steps on."""
    costs = ScriptedCosts(verify_base=1.0, verify_token=0.05, draft_step=0.28, draft_token=0.002)
    policy = AdaptiveSpeculation(K, costs)  # fresh: acceptance 0.6 expected, ~0.76 optimistic
    seqs = rows(8, budget=40)
    backlog = [0] * 7 + [2000]
    steer = policy.plan(seqs, backlog).steer
    plain = policy.best_width(steer, 0, 0, 0)[1]
    seven = steer.cumulative(K) * torch.tensor([True] * 7 + [False])[:, None]
    assert policy.best_width(steer, 1, K, 0, cumulative=seven)[1] <= plain * (1 + OPEN_MARGIN)
    assert policy.best_width(steer, 1, K, 0)[1] > plain * (1 + OPEN_MARGIN)
    assert steer.proceed(0) and steer.drafting().all()
    steer = policy.plan(seqs, [0] * 7 + [20000]).steer  # ten times the backlog: not worth it, all plain
    assert not steer.proceed(0)


# ---- unseeded sampling: the width must not depend on the drafts it decides about -------------------
class StepShapedCosts(ScriptedCosts):
    """The shape of the measured CPU tables: a 1-token step is cheap, verifies of 2 to 7 tokens cost
    about the same, so the expected rate is not unimodal in the width."""

    def verify_time(self, rows: int, tokens: int) -> float:
        return 1.0 if tokens == 1 else 2.0

    def draft_time(self, rows: int, tokens: int) -> float:
        return 0.05


TARGET_P = torch.tensor([0.10, 0.30, 0.30, 0.30])  # the target's next-token distribution, everywhere


def _drafter_q(drafts: list[int]) -> torch.Tensor:
    """The drafter's distribution after `drafts`: after drafting token 0 or 1 it is sure of the next
    one (high sum(q^2)), after 2 or 3 it is not, so the confidence of slot j + 1 depends on draft j."""
    if not drafts:
        return torch.tensor([0.05, 0.72, 0.115, 0.115])
    return torch.tensor([0.94, 0.02, 0.02, 0.02]) if drafts[-1] in (0, 1) else torch.full((4,), 0.25)


def sampled_pairs(rounds: int, seed: int, old_rule: bool = False) -> tuple[list[tuple[int, int]], list[int]]:
    """The first two tokens emitted by `rounds` independent rounds of one unseeded row under the adaptive
    policy (plan -> steered drafting -> settle -> rejection sampling), and each round's width. The
    second token, when the round emitted only one, is drawn from the target directly. `old_rule`: the
    width chosen over every drafted slot at once, as before the fix."""
    gen = torch.Generator().manual_seed(seed)
    policy = AdaptiveSpeculation(K, StepShapedCosts())
    if old_rule:
        policy.blind_width = lambda steer, planned, width: policy.best_width(steer, 0, width, steer.steps)[0]
    seqs = rows(1, budget=50, params=SamplingParams(max_new_tokens=50, temperature=1.0))
    pairs, widths = [], []
    for _ in range(rounds):
        plan = policy.plan(seqs, [0])
        steer = plan.steer
        tokens: list[int] = []
        qs: list[torch.Tensor] = []
        while steer is not None and len(tokens) < plan.steps and steer.proceed(len(tokens)):
            q = _drafter_q(tokens)
            token = int(torch.multinomial(q, 1, generator=gen))
            steer.observed(len(tokens), q.log()[None], torch.tensor([token]), None)
            tokens.append(token)
            qs.append(q)
        width = 0
        emitted: list[int] = []
        if tokens:
            draft = policy.settle(plan, Draft(torch.tensor([tokens]), torch.stack(qs).log()[None]))
            width = draft.width
        if width:
            p = TARGET_P.expand(1, width + 1, 4)
            uniform = torch.rand((1, width), generator=gen)
            noise = sampling.gumbel(torch.rand((1, 4), generator=gen))
            out, count = rejection(draft.tokens, p, torch.stack(qs[:width])[None], uniform, noise)
            emitted = out[0, : int(count)].tolist()
        while len(emitted) < 2:
            emitted.append(int(torch.multinomial(TARGET_P, 1, generator=gen)))
        pairs.append((emitted[0], emitted[1]))
        widths.append(width)
    return pairs, widths


def _p_values(pairs: list[tuple[int, int]]) -> list[float]:
    """Chi-square goodness of fit against the target, for position 0, position 1 and the joint pair."""
    from scipy import stats

    n = len(pairs)
    p = TARGET_P.double() / TARGET_P.double().sum()
    out = []
    for position in (0, 1):
        counts = torch.bincount(torch.tensor([p[position] for p in pairs]), minlength=4).double()
        out.append(float(stats.chisquare(counts.numpy(), (p * n).numpy()).pvalue))
    joint = torch.bincount(torch.tensor([4 * a + b for a, b in pairs]), minlength=16).double()
    out.append(float(stats.chisquare(joint.numpy(), (torch.outer(p, p).flatten() * n).numpy()).pvalue))
    return out


def test_unseeded_rows_keep_the_targets_distribution_on_a_step_shaped_cost_table():
    """Whether a rejection row's draft j is verified is decided before draft j is drawn: the emitted
    tokens follow the target, per position and jointly, while drafts still get verified. The same
    harness with the width chosen over every drafted slot at once (slot j + 1's confidence, computed
    after d_j was drawn, deciding whether d_j is verified) fails it."""
    pairs, widths = sampled_pairs(3000, seed=2)
    assert min(_p_values(pairs)) > 0.01 / 3
    assert sum(w > 0 for w in widths) > 300  # the policy did speculate
    old_pairs, _ = sampled_pairs(3000, seed=2, old_rule=True)
    assert min(_p_values(old_pairs)) < 1e-6


def test_a_deferred_prefill_on_the_drafters_prompt_path_is_priced_by_it():
    """A row whose catch-up runs on the drafter's prompt path (`Drafter.backlog`: a deferred
    prefill) is priced by `Costs.prompt_time`, its pieces too; others by `draft_time`. A prompt too dear
    to catch up by the weights' kernel is caught up where the prompt path makes it cheap enough."""
    costs = ScriptedCosts(verify_base=1.0, verify_token=0.05, draft_step=0.28, draft_token=0.002, prompt_share=0.25)
    policy = AdaptiveSpeculation(K, costs)
    assert policy.catch_up_cost(600, fast=True) == pytest.approx(0.25 * costs.draft_time(1, 600))
    assert policy.catch_up_cost(600) == pytest.approx(costs.draft_time(1, 600))
    chunked = AdaptiveSpeculation(K, costs, chunk=100)
    assert chunked.catch_up_cost(250, fast=True) == pytest.approx(2 * costs.prompt_time(100) + costs.prompt_time(50))
    seqs = rows(8, budget=40)
    backlog = [0] * 7 + [12000]  # as `test_a_catch_up_is_weighed_against_what_the_batch_does_without_it`, dearer
    assert not policy.plan(seqs, backlog).steer.proceed(0)
    steer = AdaptiveSpeculation(K, costs).plan(seqs, backlog, fast=[False] * 7 + [True]).steer
    assert steer.proceed(0) and steer.drafting().all()


def test_catch_ups_fit_the_steps_allowance_in_pieces():
    """Under a per-step token budget a catch-up is priced as the forwards of its pieces and pays back
    only over the tokens a row has left after the steps it spends being caught up; a round fits its
    drafting rows' lags into the step's allowance smallest first, the first that does not fit is fed
    the rest as a piece, and no row whose lag does not fit drafts this round."""
    costs = ScriptedCosts(verify_base=1.0, verify_token=0.02, draft_step=0.05, draft_token=0.002)
    chunked = AdaptiveSpeculation(K, costs, chunk=100)
    assert chunked.catch_up_cost(250) == pytest.approx(2 * costs.draft_time(1, 100) + costs.draft_time(1, 50))
    assert chunked.catch_up_cost(80) == AdaptiveSpeculation(K, costs).catch_up_cost(80) == costs.draft_time(1, 80)
    assert [chunked.catch_up_delay(n) for n in (0, 100, 101, 250)] == [0, 0, 1, 2]
    seqs = rows(4, budget=40)
    teach(chunked, seqs, accepted=4)
    steer = chunked.plan(seqs, [0, 10, 60, 50], allowance=70).steer
    assert steer.proceed(0)
    assert steer.drafting().tolist() == [True, True, False, True]
    assert steer.pieces().tolist() == [0, 0, 10, 0]
    steer = chunked.plan(seqs, [0, 10, 60, 50]).steer  # no allowance given: unbounded, everyone whole
    assert steer.proceed(0) and steer.drafting().all() and not steer.pieces().any()

    def joins(policy: AdaptiveSpeculation, backlog: int) -> bool:
        seqs = rows(1, budget=40)
        teach(policy, seqs, accepted=4)
        steer = policy.plan(seqs, [backlog], allowance=policy.chunk).steer
        return steer.proceed(0) and bool(steer.drafting()[0] or steer.pieces()[0])

    # 300 tokens at 10 a step: 30 steps of plain decoding before the row drafts, 10 of its 40 tokens left
    assert joins(AdaptiveSpeculation(K, costs), 300) and not joins(AdaptiveSpeculation(K, costs, chunk=10), 300)


def test_a_catch_up_chosen_while_drafting_waits_is_fed_its_piece():
    """Drafting that measured a loss waits for plain steps to pay for it (`book`), but a catch-up
    worth starting for the rounds after it is still fed a piece of the step's budget: with a
    drafter that asks first too, such a round is weighed in full, not settled as idle."""
    costs = ScriptedCosts(verify_base=1.0, verify_token=0.02, draft_step=0.05, draft_token=0.002)
    for asks_first in (False, True):
        policy = AdaptiveSpeculation(K, costs, chunk=64, asks_first=asks_first)
        seqs = rows(2, budget=200)
        teach(policy, seqs, accepted=4)
        policy.draft_account = -1.0
        plan = policy.plan(seqs, [0, 300], allowance=64)
        assert plan.steer is not None and not plan.steer.proceed(0)
        assert plan.steer.pieces().tolist() == [0, 64]


# ---- the idle shortcut: rounds settled before the drafter is asked are the rounds `open` declines --
@pytest.mark.parametrize("seed", range(12))
def test_rounds_settled_idle_are_exactly_the_rounds_open_declines(seed):
    """A policy for a drafter that asks first (`asks_first`: a model drafter) settles most rounds where
    speculation does not pay in `plan` (`idle`, in Python floats), without the drafter; its twin weighs
    every round in `open`. Fed the same outcomes over batches that lag, learn, probe, draft and run
    out, the two make the same decision every round (whether to draft, probe, which rows, which
    pieces) and end each round with the same accounts and estimates, bit for bit (that the shortcut
    is taken where drafting cannot pay: `test_engine.py`)."""
    gen = torch.Generator().manual_seed(seed)

    def uniform(lo: float, hi: float) -> float:
        return lo + (hi - lo) * float(torch.rand((), generator=gen))

    costs = ScriptedCosts(verify_base=1.0, verify_token=uniform(0.0, 0.3), draft_step=uniform(0.05, 1.0),
                          draft_token=uniform(0.0, 0.01))
    chunk = [None, 64][seed % 2]
    fast, full = AdaptiveSpeculation(K, costs, chunk, asks_first=True), AdaptiveSpeculation(K, costs, chunk)
    batch = 1 + seed % 4
    seqs = rows(batch, budget=120)
    teach(fast, seqs, accepted=seed % 4)
    teach(full, seqs, accepted=seed % 4)
    choices = [0, 3, 20, 40, 300]  # short lags (one shared forward, pieces under a small allowance) and long ones
    backlog = [choices[int(torch.randint(0, len(choices), (), generator=gen))] for _ in seqs]
    while not all(s.finished for s in seqs):
        live = [s for s in seqs if not s.finished]
        lags = [backlog[s.index] for s in live]
        allowance = None if chunk is None else int(torch.randint(0, 2 * chunk, (), generator=gen))
        plans = [policy.plan(live, lags, allowance) for policy in (fast, full)]
        outcome = []
        for plan in plans:
            go = plan.steer is not None and plan.steer.proceed(0)
            rows_in = plan.steer.drafting().tolist() if go else [False] * len(live)
            pieces = plan.steer.pieces().tolist() if plan.steer is not None else [0] * len(live)
            outcome.append((go, go and plan.steer.probe, rows_in, pieces))
        assert outcome[0] == outcome[1]
        go, probe, rows_in, pieces = outcome[0]
        width = (1 if probe else K) if go else 0
        accepted = [int(torch.randint(0, width + 1, (), generator=gen)) if r else 0 for r in rows_in]
        count = torch.tensor([1 + a for a in accepted])
        caught_up = sum(costs.draft_time(1, lag) for lag, r in zip(lags, rows_in) if r and lag) + sum(
            costs.draft_time(1, n) for n in pieces if n)
        times = RoundTimes(costs.draft_time(len(live), 2) * width, costs.verify_time(len(live), width + 1) * uniform(0.8, 1.3),
                           0.0, caught_up)
        for plan in plans:
            if plan.steer is not None:
                plan.steer.steps = width
            lengths = torch.tensor([width if r else 0 for r in rows_in])
            draft = Draft(torch.zeros(len(live), width, dtype=torch.long), None, lengths)
            (fast if plan is plans[0] else full).observe(live, plan, draft, count, times)
        assert (fast.probe_credit, fast.draft_account, fast.catch_up_account) == (
            full.probe_credit, full.draft_account, full.catch_up_account)
        assert torch.equal(fast.model.cells, full.model.cells) and torch.equal(fast.model.positions, full.model.positions)
        assert all(torch.equal(fast.model.rows[i].counts, full.model.rows[i].counts) for i in full.model.rows)
        for s, a, r, n in zip(live, accepted, rows_in, pieces):
            backlog[s.index] = 0 if r else max(backlog[s.index] - n, 0) + 1
            s.extend([9] * min(1 + a, s.remaining))
