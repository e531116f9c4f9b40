"""Is speculative sampling distributed like plain sampling? Two checks.

- Statistical: per-position token histograms of many sampled continuations, plain vs speculative,
  compared with a two-sample chi-square test of homogeneity. Catches anything that changes the output
  distribution end to end (models, layouts, filtering, the rule), but only up to its power.
- Exact: on tiny vocabularies, enumerate every path of one speculative round with the acceptance
  probabilities and residuals the sampler itself uses (`acceptance`), and compare the resulting
  distribution of the first k+1 tokens with the target's own, to rounding error.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import Counter, defaultdict
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass

import numpy as np
import torch
from scipy import stats

from . import acceptance
from .config import SamplingParams
from .sampling import filter_logits

END = "<end>"  # the category of a sample that had already stopped before a position


# ---- chi-square ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ChiSquare:
    """A two-sample chi-square test. dof 0 (a single bin) means nothing to test: p_value is 1."""

    chi2: float
    dof: int
    p_value: float
    bins: int
    samples: tuple[int, int]

    def to_json(self) -> dict:
        return asdict(self)


def two_sample_chi2(a: Mapping[Hashable, int], b: Mapping[Hashable, int], min_expected: float = 5.0) -> ChiSquare:
    """Test whether two histograms come from one distribution (chi-square test of homogeneity).

    The chi-square approximation needs every expected cell count >= `min_expected`; categories too
    rare for that are merged into one "other" bin (and that bin, if still too small, into the
    smallest kept one). Sample sizes may differ.
    """
    na, nb = sum(a.values()), sum(b.values())
    if na == 0 or nb == 0:
        raise ValueError("both histograms need at least one sample")
    # Expected count of category c in the smaller sample is min(na, nb) * total_c / (na + nb).
    needed = min_expected * (na + nb) / min(na, nb)
    categories = sorted(set(a) | set(b), key=lambda c: (-(a.get(c, 0) + b.get(c, 0)), repr(c)))
    bins = [[a.get(c, 0), b.get(c, 0)] for c in categories if a.get(c, 0) + b.get(c, 0) >= needed]
    other = [sum(a.get(c, 0) for c in categories) - sum(x for x, _ in bins),
             sum(b.get(c, 0) for c in categories) - sum(y for _, y in bins)]
    if sum(other) >= needed or (sum(other) > 0 and not bins):
        bins.append(other)
    elif sum(other) > 0:
        bins[-1] = [bins[-1][0] + other[0], bins[-1][1] + other[1]]
    if len(bins) < 2:
        return ChiSquare(0.0, 0, 1.0, len(bins), (na, nb))
    chi2, p_value, dof, _ = stats.chi2_contingency(np.array(bins).T, correction=False)
    return ChiSquare(float(chi2), int(dof), float(p_value), len(bins), (na, nb))


def position_histograms(samples: Iterable[Sequence[int]], positions: int) -> list[Counter]:
    """Token counts at each generated position 0..positions-1 (END where a sample already stopped)."""
    histograms: list[Counter] = [Counter() for _ in range(positions)]
    for sample in samples:
        for t, histogram in enumerate(histograms):
            histogram[sample[t] if t < len(sample) else END] += 1
    return histograms


def compare_positions(
    plain: Iterable[Sequence[int]], speculative: Iterable[Sequence[int]], positions: int, min_expected: float = 5.0
) -> list[ChiSquare]:
    """One two-sample chi-square test per generated position."""
    return [
        two_sample_chi2(a, b, min_expected)
        for a, b in zip(position_histograms(plain, positions), position_histograms(speculative, positions))
    ]


# ---- exact enumeration -----------------------------------------------------------------------------
# A toy language model: the next-token distribution [vocab] after a prefix of generated tokens.
Model = Callable[[tuple[int, ...]], torch.Tensor]


def random_model(vocab: int, seed: int, params: SamplingParams, scale: float = 2.0) -> Model:
    """A context-dependent toy model: Gaussian logits keyed by (seed, prefix), filtered by `params`
    exactly as the engine filters (so top-k/top-p supports and their zeros are exercised), in float64."""

    def next_token(prefix: tuple[int, ...]) -> torch.Tensor:
        digest = hashlib.blake2b(f"{seed}:{prefix}".encode(), digest_size=8).digest()
        generator = torch.Generator().manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))
        logits = torch.randn(1, vocab, generator=generator, dtype=torch.float64) * scale
        return torch.softmax(filter_logits(logits, [params]), dim=-1)[0]

    return next_token


def _complete(out: dict[tuple[int, ...], float], prefix: tuple[int, ...], weight: float, p: Model, length: int) -> None:
    """Add weight * P(plain sampling from p extends `prefix` to each sequence of `length`)."""
    if len(prefix) == length:
        out[prefix] += weight
        return
    for token, prob in enumerate(p(prefix).tolist()):
        if prob > 0:
            _complete(out, prefix + (token,), weight * prob, p, length)


def target_distribution(p: Model, length: int) -> dict[tuple[int, ...], float]:
    """P(first `length` tokens) under plain sampling from p."""
    out: dict[tuple[int, ...], float] = defaultdict(float)
    _complete(out, (), 1.0, p, length)
    return dict(out)


def speculative_distribution(p: Model, q: Model, vocab: int, k: int) -> dict[tuple[int, ...], float]:
    """P(first k+1 tokens) when one round of k drafts from q is verified by rejection sampling against
    p (with `acceptance.acceptance_probability` and `acceptance.residual`, the functions the sampler
    uses) and plain sampling from p completes whatever the round left short of k+1 tokens. Equal to
    `target_distribution(p, k+1)` iff the round preserves p."""
    drafts = list(itertools.product(range(vocab), repeat=k))
    draft_tokens = torch.tensor(drafts, dtype=torch.long).view(len(drafts), k)
    target = torch.stack([torch.stack([p(x[:j]) for j in range(k + 1)]) for x in drafts])
    proposal = torch.stack([torch.stack([q(x[:j]) for j in range(k)]) for x in drafts]) if k else target[:, :0]
    accept_prob = acceptance.acceptance_probability(draft_tokens, target, proposal)
    residuals = torch.stack(
        [acceptance.residual(target, proposal, torch.full((len(drafts),), j)) for j in range(k + 1)], dim=1
    )
    out: dict[tuple[int, ...], float] = defaultdict(float)
    for d, x in enumerate(drafts):
        reach = float(np.prod([float(proposal[d, j, x[j]]) for j in range(k)]))  # P(drafter proposes x)
        for a in range(k + 1):  # the round keeps a drafts, then emits a token from residuals[a]
            stop = reach * (1.0 - float(accept_prob[d, a])) if a < k else reach
            for token, prob in enumerate(residuals[d, a].tolist()):
                if stop * prob > 0:
                    _complete(out, x[:a] + (token,), stop * prob, p, k + 1)
            if a < k:
                reach *= float(accept_prob[d, a])
    return dict(out)


def max_abs_difference(a: Mapping[Hashable, float], b: Mapping[Hashable, float]) -> float:
    return max((abs(a.get(key, 0.0) - b.get(key, 0.0)) for key in set(a) | set(b)), default=0.0)


def exact_rejection_check(vocab: int, k: int, params: SamplingParams, seed: int = 0) -> float:
    """Max |P_speculative - P_target| over all sequences of k+1 tokens, for random toy target and
    drafter models (float64: a correct rule gives ~1e-16, any algorithmic slip far more)."""
    p = random_model(vocab, 2 * seed, params)
    q = random_model(vocab, 2 * seed + 1, params)
    return max_abs_difference(speculative_distribution(p, q, vocab, k), target_distribution(p, k + 1))
