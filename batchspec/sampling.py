"""Token choice under SamplingParams: the one place that filters logits and draws randomness.

Each request decodes under one of three rules, fixed by its params:

- greedy (temperature 0): argmax of the raw logits, exactly the greedy path.
- rejection (temperature > 0, no seed): Leviathan/Chen rejection sampling; the drafter samples its
  drafts from its own filtered distribution q and the target accepts or corrects them
  (`acceptance.rejection`). Randomness comes from the engine's generator, so the output follows
  the target's distribution but is not reproducible by a plain decoder.
- coupled (temperature > 0, seed given): the token at absolute generated position t is
  argmax(filtered logits / T + Gumbel(seed, t)) with noise keyed by (seed, t) only. The drafter
  proposes with the same noise; a draft is accepted iff it equals the target's token. The output is
  then a function of (model, prompt, params) alone, token-identical to plain seeded sampling
  (`reference.sample_decode`) whatever the batch, drafter, K, layout or scheduler.
  Shared noise is never combined with the p/q rule: that would bias the distribution.

All sampling is Gumbel-max (argmax of scores plus Gumbel noise), with the noise either keyed or drawn
from the engine's generator: exact up to the float32 resolution of the uniforms, a few O(vocab)
passes per row. (`torch.multinomial` is slower per row at a 151,936-token vocabulary on CPU; a float32
inverse CDF accumulates rounding bias over a 150k-term cumulative sum.)
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence as Seq

import torch

from . import acceptance
from .config import BatchspecError, SamplingParams
from .draft import Draft, Picker, pick_argmax
from .sequence import Sequence

GREEDY = "greedy"
REJECTION = "rejection"
COUPLED = "coupled"

# First top-k window used to find a top-p cutoff; nuclei are usually far smaller than the vocabulary,
# so a partial sort of a few dozen entries replaces a full sort (hundreds of ms at vocab 151,936).
_FIRST_WINDOW = 64
_WINDOW_GROWTH = 8


def rule(params: SamplingParams) -> str:
    """The decoding rule of a request: greedy, coupled (seeded) or rejection (unseeded)."""
    if params.greedy:
        return GREEDY
    return COUPLED if params.seed is not None else REJECTION


# ---- filtering: temperature, top-k, top-p ----------------------------------------------------------
def filter_logits(logits: torch.Tensor, params: Seq[SamplingParams]) -> torch.Tensor:
    """logits / T with -inf outside each row's top-k / top-p support.

    logits: [n, ..., vocab]; row i (first dimension) uses params[i], which must have temperature > 0.
    Order as in transformers: temperature, then top-k, then top-p over the top-k-renormalised mass.
    The support is a threshold on the scaled logit (every token tied with the last kept one stays),
    so it does not depend on how a sort breaks ties. Target and drafter logits go through this same
    function, and so does the oracle.
    """
    n, vocab = logits.shape[0], logits.shape[-1]
    flat = logits.reshape(n, -1, vocab)
    temperature = torch.tensor([p.temperature for p in params], dtype=flat.dtype, device=flat.device)
    scaled = flat / temperature[:, None, None]
    limited = [i for i, p in enumerate(params) if 0 < p.top_k < vocab or p.top_p < 1]
    if limited and scaled.shape[1] > 0:
        index = torch.tensor(limited, device=flat.device)
        steps = scaled.shape[1]
        rows = scaled[index].reshape(-1, vocab)
        top_k = torch.tensor(
            [params[i].top_k if 0 < params[i].top_k < vocab else vocab for i in limited], device=flat.device
        ).repeat_interleave(steps)
        top_p = torch.tensor([params[i].top_p for i in limited], dtype=flat.dtype, device=flat.device)
        cutoff = _support_cutoff(rows, top_k, top_p.repeat_interleave(steps))
        rows = rows.masked_fill(rows < cutoff[:, None], float("-inf"))
        scaled[index] = rows.reshape(len(limited), steps, vocab)
    return scaled.reshape(logits.shape)


def _support_cutoff(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The smallest scaled logit each row keeps. logits [r, vocab]; top_k [r] (vocab = off); top_p [r].

    Looks only at each row's largest `width` entries and widens the window, for the rows whose
    support does not end inside it, until all do. Exact, since the top-p set is a prefix of the sorted
    order; a full sort happens only for rows whose nucleus is a large part of the vocabulary.
    """
    vocab = logits.shape[-1]
    cutoff = torch.empty(logits.shape[0], dtype=logits.dtype, device=logits.device)
    pending = torch.arange(logits.shape[0], device=logits.device)
    restricted = top_k < vocab
    width = min(vocab, max(_FIRST_WINDOW, int(top_k[restricted].max()) if bool(restricted.any()) else 0))
    while pending.numel():
        rows, k, p = logits[pending], top_k[pending], top_p[pending, None]
        values = rows.topk(width, dim=-1).values  # sorted, descending
        in_k = torch.arange(width, device=logits.device)[None, :] < k[:, None]
        # top-p mass is renormalised over the top-k set; without top-k, over the whole row.
        lse = torch.where(
            k < vocab, torch.logsumexp(values.masked_fill(~in_k, float("-inf")), dim=-1), torch.logsumexp(rows, dim=-1)
        )
        probs = torch.exp(values - lse[:, None]).masked_fill(~in_k, 0.0)
        before = torch.cumsum(probs, dim=-1) - probs  # mass strictly above each entry
        kept = (in_k & ((before < p) | (p >= 1))).sum(dim=-1).clamp(min=1)
        done = (kept < width) | (kept >= k) | (width == vocab)
        cutoff[pending[done]] = values[done].gather(1, (kept[done] - 1)[:, None]).squeeze(1)
        pending = pending[~done]
        width = min(vocab, width * _WINDOW_GROWTH)
    return cutoff


# ---- noise -----------------------------------------------------------------------------------------
def noise_key(seed: int, position: int) -> int:
    """Generator seed for (request seed, generated position). Hashed, so that neighbouring keys such
    as (s, t + 1) and (s + 1, t) (requests get seed + i) give unrelated streams."""
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def gumbel(uniform: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise from uniforms in [0, 1) (clamped away from 0, which would give -inf)."""
    tiny = torch.finfo(uniform.dtype).tiny
    return -torch.log(-torch.log(uniform.clamp(min=tiny)))


def keyed_gumbel(keys: Seq[tuple[int, int]], width: int) -> torch.Tensor:
    """Gumbel noise [len(keys), width] on the CPU, row i a function of keys[i] = (seed, position) only.

    One CPU generator reseeded per key: the stream is the same on any device and in any batch. The
    uniforms are drawn per key (the bulk of the cost), the log-log runs once over all keys.
    """
    generator = torch.Generator()
    uniform = torch.empty(len(keys), width)
    for row, (seed, position) in zip(uniform, keys):
        generator.manual_seed(noise_key(seed, position))
        row.uniform_(generator=generator)
    return gumbel(uniform)


def gumbel_argmax(scores: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """A sample from softmax(scores) (scores may be -inf) given Gumbel noise of the same shape."""
    return (scores + noise).argmax(dim=-1)


class Randomness:
    """An engine's random state: a generator for rejection rows and a cache of keyed noise.

    The cache exists because coupled rows need the same (seed, position) noise several times: the
    drafter's step j and the target's slot j of a round share it, and positions past a rejection are
    needed again next round. Entries are immutable and keyed by (seed, position, width), so reuse can
    never change a result, only save the noise's cost.
    """

    def __init__(self, seed: int | None, device: torch.device | str = "cpu", cache_entries: int = 64) -> None:
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)
        self.cache_entries = cache_entries
        self._noise: OrderedDict[tuple[int, int, int], torch.Tensor] = OrderedDict()

    def keyed(self, keys: Seq[tuple[int, int]], width: int) -> torch.Tensor:
        """keyed_gumbel(keys, width) on this engine's device, through the cache."""
        missing = list(dict.fromkeys(k for k in keys if (*k, width) not in self._noise))
        if missing:
            for key, row in zip(missing, keyed_gumbel(missing, width).to(self.device)):
                self._noise[(*key, width)] = row
        rows = []
        for key in keys:
            self._noise.move_to_end((*key, width))
            rows.append(self._noise[(*key, width)])
        while len(self._noise) > self.cache_entries:
            self._noise.popitem(last=False)
        return torch.stack(rows)

    def fresh(self, shape: tuple[int, ...]) -> torch.Tensor:
        """Gumbel noise from the engine's generator (rejection rows)."""
        return gumbel(torch.rand(shape, generator=self.generator, device=self.device))

    def uniform(self, shape: tuple[int, ...]) -> torch.Tensor:
        """Uniforms in [0, 1) from the engine's generator (rejection rows' accept/reject draws)."""
        return torch.rand(shape, generator=self.generator, device=self.device)


# ---- the engine's three hooks ----------------------------------------------------------------------
def _rows_by_rule(seqs: Seq[Sequence]) -> dict[str, list[int]]:
    rows: dict[str, list[int]] = {GREEDY: [], REJECTION: [], COUPLED: []}
    for i, s in enumerate(seqs):
        rows[rule(s.params)].append(i)
    return rows


def _selector(rows: list[int], batch: int, device: torch.device) -> torch.Tensor | slice:
    """Indexes a rule's rows; a slice when they are the whole batch, the common case, so that no
    [b, k+1, vocab] tensor gets copied."""
    return slice(None) if len(rows) == batch else torch.tensor(rows, device=device)


def choose_tokens(logits: torch.Tensor, seqs: Seq[Sequence], offset: int, randomness: Randomness) -> torch.Tensor:
    """One token per row from logits [b, vocab] predicting generated position len(generated) + offset.

    Serves the target's first token (offset 0) and the drafter's step `offset`: greedy rows take the
    argmax, rejection rows sample the filtered distribution, coupled rows use the keyed noise.
    """
    groups = _rows_by_rule(seqs)
    tokens = torch.empty(len(seqs), dtype=torch.long, device=logits.device)
    if rows := groups[GREEDY]:
        pick = _selector(rows, len(seqs), logits.device)
        tokens[pick] = logits[pick].argmax(dim=-1)
    if rows := groups[REJECTION]:
        pick = _selector(rows, len(seqs), logits.device)
        scores = filter_logits(logits[pick], [seqs[i].params for i in rows])
        tokens[pick] = gumbel_argmax(scores, randomness.fresh(tuple(scores.shape)))
    if rows := groups[COUPLED]:
        pick = _selector(rows, len(seqs), logits.device)
        scores = filter_logits(logits[pick], [seqs[i].params for i in rows])
        keys = [(seqs[i].params.seed, len(seqs[i].generated) + offset) for i in rows]
        tokens[pick] = gumbel_argmax(scores, randomness.keyed(keys, logits.shape[-1]).to(scores.device))
    return tokens


def draft_picker(seqs: Seq[Sequence], randomness: Randomness) -> Picker:
    """The drafter's picker: draft `step` of row b stands at generated position len(generated) + step."""
    if all(s.params.greedy for s in seqs):
        return pick_argmax

    def pick(logits: torch.Tensor, step: int) -> torch.Tensor:
        return choose_tokens(logits, seqs, step, randomness)

    return pick


def accept_round(
    draft: Draft, logits: torch.Tensor, seqs: Seq[Sequence], randomness: Randomness
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [b, k+1], count [b]) for target logits [b, k+1, vocab], each row by its own rule.

    Rows are split by rule and each group is handled by one vectorized call, so rules never see each
    other's rows and a greedy row's result is the same as in an all-greedy batch. Row b is capped at
    its own draft count (`Draft.lengths`), so padding slots are never accepted.
    """
    groups = _rows_by_rule(seqs)
    k, vocab = draft.width, logits.shape[-1]
    lengths = draft.lengths
    tokens = torch.empty((len(seqs), k + 1), dtype=torch.long, device=logits.device)
    count = torch.empty(len(seqs), dtype=torch.long, device=logits.device)

    def capped(pick: torch.Tensor | slice) -> torch.Tensor | None:
        return None if lengths is None else lengths[pick]

    if rows := groups[GREEDY]:
        pick = _selector(rows, len(seqs), logits.device)
        tokens[pick], count[pick] = acceptance.greedy(draft.tokens[pick], logits[pick], capped(pick))
    if rows := groups[COUPLED]:
        pick = _selector(rows, len(seqs), logits.device)
        scores = filter_logits(logits[pick], [seqs[i].params for i in rows])
        tokens[pick], count[pick] = acceptance.matching(
            draft.tokens[pick], gumbel_argmax(scores, _slot_noise(seqs, rows, draft, randomness, scores)), capped(pick)
        )
    if rows := groups[REJECTION]:
        pick = _selector(rows, len(seqs), logits.device)
        params = [seqs[i].params for i in rows]
        drafts = draft.tokens[pick]
        p = torch.softmax(filter_logits(logits[pick], params), dim=-1)
        point_mass = torch.nn.functional.one_hot(drafts, vocab).to(p.dtype)
        if draft.logits is None:
            # A drafter without probabilities is treated as deterministic given its inputs: q is a
            # point mass on the draft, for which the rule still yields exactly p.
            q = point_mass
        elif draft.logits.shape[-1] != vocab:
            raise BatchspecError(
                f"drafter logits width {draft.logits.shape[-1]} differs from the target's {vocab}: "
                "rejection sampling compares their probabilities token by token"
            )
        else:
            q = torch.softmax(filter_logits(draft.logits[pick], params), dim=-1)
            if draft.forced is not None:
                q = torch.where(draft.forced[pick][..., None], point_mass, q)
        uniform = randomness.uniform(tuple(drafts.shape))
        noise = randomness.fresh((len(rows), vocab))
        tokens[pick], count[pick] = acceptance.rejection(drafts, p, q, uniform, noise, capped(pick))
    return tokens, count


def _slot_noise(
    seqs: Seq[Sequence], rows: list[int], draft: Draft, randomness: Randomness, scores: torch.Tensor
) -> torch.Tensor:
    """Keyed noise for coupled rows' slots [len(rows), k+1, vocab]: slot j of a row is generated
    position len(generated) + j. Only slots a row can emit from (its drafts and the one after) get
    noise (a vocabulary-wide draw per key); padding slots get zeros, their picks are never used."""
    lengths = draft.row_lengths().tolist()
    reach = [lengths[i] + 1 for i in rows]
    keys = [(seqs[i].params.seed, len(seqs[i].generated) + j) for i, n in zip(rows, reach) for j in range(n)]
    noise = randomness.keyed(keys, scores.shape[-1]).to(scores.device)
    if all(n == scores.shape[1] for n in reach):
        return noise.view(scores.shape)
    full = torch.zeros_like(scores)
    full[torch.arange(scores.shape[1], device=scores.device)[None, :] < torch.tensor(reach, device=scores.device)[:, None]] = noise
    return full


def draft_confidence(
    logits: torch.Tensor, tokens: torch.Tensor, forced: torch.Tensor | None, seqs: Seq[Sequence]
) -> torch.Tensor:
    """How likely the drafter itself finds draft `tokens` [b], from its logits [b, vocab] at that step:
    the feature adaptive speculation calibrates into an acceptance probability (LibraSpec).

    Greedy and coupled rows: the drafter's probability of the drafted token (its filtered
    distribution for coupled rows); their output is the same whatever is drafted, so the choice of
    how many to verify may look at the token. Rejection rows: the expected probability of a token
    drawn from q, sum(q^2), which is known before the draw; deciding from the drawn token's own
    probability whether to keep it would bias rejection sampling. Forced tokens are deterministic,
    so their own probability is fair for every rule.
    """
    groups = _rows_by_rule(seqs)
    out = torch.empty(len(seqs), dtype=torch.float32, device=logits.device)
    if rows := groups[GREEDY]:
        pick = _selector(rows, len(seqs), logits.device)
        out[pick] = torch.softmax(logits[pick].float(), dim=-1).gather(-1, tokens[pick][:, None]).squeeze(-1)
    for rule_name in (COUPLED, REJECTION):
        if rows := groups[rule_name]:
            pick = _selector(rows, len(seqs), logits.device)
            q = torch.softmax(filter_logits(logits[pick].float(), [seqs[i].params for i in rows]), dim=-1)
            own = q.gather(-1, tokens[pick][:, None]).squeeze(-1)
            if rule_name == REJECTION:
                expected = (q * q).sum(dim=-1)
                own = expected if forced is None else torch.where(forced[pick], own, expected)
            out[pick] = own
    return out
