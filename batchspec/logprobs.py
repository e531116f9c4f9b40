"""Log-probabilities of chosen tokens: the one computation the engine and plain decoding share.

The engine reports a token's logprob from the target's logits at the position that emitted it (the
prefill's last position for the first token, a verify slot for the others); plain decoding
(`batchspec.reference`) from its own forward at that position. Those logits are equal bit for bit
(batch-invariant forwards: the reason outputs are exact), so the logprobs are too, provided the
computation after them cannot depend on the tensor the row came from. Hence `token_logprob` takes a
single position's logits as a 1-D vocabulary vector, copies it into a fresh float32 tensor (no view
into a [b, k+1, vocab] batch whose offset or strides a kernel could notice) and reduces it alone:
the same values in, the same arithmetic, the same bits out, whatever batch, layout or round shape
the logits came from.

Which distribution: greedy requests get the raw log-softmax of the target's logits; sampled
requests (temperature > 0) the log-softmax of what they sample from, the logits after temperature,
top-k and top-p (`sampling.filter_logits`): vLLM's `logprobs_mode="processed_logprobs"` (its
default is the raw one). Tokens outside the top-k/top-p support get -inf.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import SamplingParams
from .sampling import filter_logits


@dataclass(frozen=True)
class TokenLogprob:
    """One position: the chosen token's logprob and the `top` most likely tokens with theirs, most
    likely first (ties: lower token id first), as (token id, logprob) pairs."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprob(logits: torch.Tensor, params: SamplingParams, token: int, top: int) -> TokenLogprob:
    """`token`'s logprob at one position from that position's logits [vocab] (float32), with the
    `top` most likely tokens' (0: none), under `params`' distribution (module docstring)."""
    if logits.dim() != 1:
        raise ValueError(f"one position's logits, a [vocab] vector, expected; got shape {tuple(logits.shape)}")
    row = logits.to(dtype=torch.float32, copy=True)  # fresh and contiguous: no view into a batch
    if not params.greedy:
        row = filter_logits(row[None], [params])[0]
    logp = torch.log_softmax(row, dim=-1)
    return TokenLogprob(int(token), float(logp[token]), _most_likely(logp, top))


def logprobs_of(logits: torch.Tensor, params: SamplingParams, tokens: list[int], top: int) -> list[TokenLogprob]:
    """`token_logprob` for consecutive positions: logits [len(tokens), vocab], row j chose tokens[j];
    each row is computed alone."""
    return [token_logprob(logits[j], params, token, top) for j, token in enumerate(tokens)]


def _most_likely(logp: torch.Tensor, top: int) -> tuple[tuple[int, float], ...]:
    """The `top` largest entries of a [vocab] vector, ties broken by lower token id: a definition,
    not whichever tied entries `topk` happens to pick. Every entry above the k-th largest value is
    in, then the lowest ids equal to it; ordered by value, then id."""
    top = min(top, logp.shape[0])
    if top <= 0:
        return ()
    kth = logp.topk(top).values[-1]
    above = (logp > kth).nonzero().flatten()
    tied = (logp == kth).nonzero().flatten()[: top - above.numel()]
    ids = torch.cat([above, tied])  # ascending ids within each part, `tied` all below `above`
    ids = ids[torch.sort(logp[ids], descending=True, stable=True).indices]
    return tuple(zip(ids.tolist(), logp[ids].tolist()))
