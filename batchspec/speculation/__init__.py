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
1 / PROBE_SHARE times what a probe costs beyond a plain step. A probe that measures dearer than
predicted (a catch-up longer than the table's, a busy machine) is charged the difference before the
next one, so probing costs at most PROBE_SHARE of plain decoding's time as measured, not as predicted.
Drafting rounds and catch-ups are held to the same standard (`AdaptiveSpeculation.book`): what
drafting rounds measured to save or lose against plain steps emitting the same tokens is summed, and
so are catch-ups' seconds against the savings of the drafting after them; plain steps add PROBE_SHARE
of their time to both, and while one is negative the policy does not draft (probes aside), or does
not start a catch-up: estimates that keep promising what the rounds do not deliver cost a bounded share.

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

from ..costs import Costs
from .adaptive import ACCOUNT_STEPS, CATCH_UP_PAYBACK, OPEN_MARGIN, PROBE_SHARE, AdaptiveSpeculation, RoundSteering
from .estimates import FORCED, SAMPLED, AcceptanceModel
from .plan import FixedSpeculation, RoundPlan, RoundTimes, Speculation

__all__ = ["ACCOUNT_STEPS", "CATCH_UP_PAYBACK", "FORCED", "OPEN_MARGIN", "PROBE_SHARE", "SAMPLED", "AcceptanceModel",
           "AdaptiveSpeculation", "FixedSpeculation", "RoundPlan", "RoundSteering", "RoundTimes",
           "Speculation", "make_speculation"]


def make_speculation(kind: str, k: int, costs: Costs | None, chunk: int | None = None,
                     asks_first: bool = False) -> Speculation:
    """`chunk`: the engine's per-step token budget, which catch-ups are fed in pieces of (None: any);
    `asks_first`: the drafter's (`Drafter.asks_first`)."""
    if kind == "adaptive":
        if costs is None:
            raise ValueError("adaptive speculation needs a cost model")
        return AdaptiveSpeculation(k, costs, chunk, asks_first)
    return FixedSpeculation(k)
