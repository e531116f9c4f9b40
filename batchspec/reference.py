"""The oracle: plain autoregressive decoding of one prompt alone (batch 1, no speculation).

Deliberately independent of the engine's bookkeeping: it uses transformers' own DynamicCache,
default positions and default causal masks, so a bug in our layouts cannot hide by being repeated
here. What it shares is the arithmetic: the same weights and the same batch-invariant attention
(`kv.use_exact_attention`), so a row's logits in any engine equal these bit for bit; and the
definitions of what is computed from logits: sampling (`batchspec.sampling`) and logprobs
(`batchspec.logprobs`), so that the engine's logprobs can be compared with these bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from .config import BatchspecError, SamplingParams
from .kv import forward_plain, forward_plain_positions, new_dynamic_cache
from .logprobs import TokenLogprob, token_logprob
from .roles import prompt_pass
from .sampling import filter_logits, gumbel_argmax, keyed_gumbel

# Prompt positions whose logits one forward of `prompt_logprobs` keeps: [chunk, vocab] float32 is
# ~78 MB at a 151,936-token vocabulary, where a whole 2,000-token prompt's would be 1.2 GB.
PROMPT_CHUNK = 128


@torch.inference_mode()
def _decode(
    model: torch.nn.Module,
    prompt_ids: list[int],
    max_new_tokens: int,
    stop_ids: Iterable[int],
    choose: Callable[[torch.Tensor, int], int],
    observe: Callable[[torch.Tensor, int], None] | None = None,
) -> list[int]:
    """The plain loop: prefill, then one token at a time; `choose(logits [1, vocab], t)` picks the
    token at generated position t, and `observe(logits [vocab], token)` sees each choice (logprobs).
    Stops after the first stop token or max_new_tokens."""
    stop = set(stop_ids)
    device = next(model.parameters()).device
    cache = new_dynamic_cache(model)
    with prompt_pass():  # prompt tokens take the prompt path where the model has one, as in the engines
        logits = forward_plain(model, torch.tensor([prompt_ids], device=device), cache)
    generated: list[int] = []
    while True:
        token = choose(logits, len(generated))
        if observe is not None:
            observe(logits[0], token)
        generated.append(token)
        if token in stop or len(generated) >= max_new_tokens:
            return generated
        logits = forward_plain(model, torch.tensor([[token]], device=device), cache)


def greedy_decode(
    model: torch.nn.Module, prompt_ids: list[int], max_new_tokens: int, stop_ids: Iterable[int] = ()
) -> list[int]:
    """Greedy continuation of `prompt_ids`, up to and including the first stop token."""
    return _decode(model, prompt_ids, max_new_tokens, stop_ids, _greedy)


def _greedy(logits: torch.Tensor, t: int) -> int:
    return int(logits.argmax(dim=-1))


def sample_decode(
    model: torch.nn.Module, prompt_ids: list[int], params: SamplingParams, stop_ids: Iterable[int] = ()
) -> list[int]:
    """Plain seeded sampling: the token at generated position t is the Gumbel-max sample of the
    filtered logits with noise keyed by (params.seed, t), exactly as the engine's coupled rule defines
    it. The sampling math is shared with the engine on purpose (it is the definition of the output);
    what stays independent is everything that produces the logits."""
    return _decode(model, prompt_ids, params.max_new_tokens, stop_ids, _seeded(params))


def _seeded(params: SamplingParams) -> Callable[[torch.Tensor, int], int]:
    if params.seed is None:
        raise BatchspecError(
            "sampling without a seed has no single reference output: give the request a seed to compare "
            "token by token, or compare distributions with `batchspec verify-distribution`"
        )
    seed = params.seed

    def choose(logits: torch.Tensor, t: int) -> int:
        scores = filter_logits(logits, [params])
        return int(gumbel_argmax(scores, keyed_gumbel([(seed, t)], scores.shape[-1]).to(logits.device)))

    return choose


def reference_decode(
    model: torch.nn.Module, prompt_ids: list[int], params: SamplingParams, stop_ids: Iterable[int] = ()
) -> list[int]:
    """What plain decoding of this prompt alone produces under `params` (the oracle for any run).
    Unseeded sampling has no single answer and raises BatchspecError."""
    stop = set(stop_ids) | set(params.stop_token_ids)
    if params.greedy:
        return greedy_decode(model, prompt_ids, params.max_new_tokens, stop)
    return sample_decode(model, prompt_ids, params, stop)


def reference_logprobs(
    model: torch.nn.Module, prompt_ids: list[int], params: SamplingParams, stop_ids: Iterable[int] = ()
) -> tuple[list[int], list[TokenLogprob]]:
    """`reference_decode` with each generated token's logprob (and `params.logprobs` alternatives,
    none when None) from the logits that chose it: what the engine must report, bit for bit."""
    stop = set(stop_ids) | set(params.stop_token_ids)
    found: list[TokenLogprob] = []

    def observe(logits: torch.Tensor, token: int) -> None:
        found.append(token_logprob(logits, params, token, params.logprobs or 0))

    choose = _greedy if params.greedy else _seeded(params)
    return _decode(model, prompt_ids, params.max_new_tokens, stop, choose, observe), found


@torch.inference_mode()
def prompt_logprobs(model: torch.nn.Module, prompt_ids: list[int], params: SamplingParams) -> list[TokenLogprob | None]:
    """Each prompt token's logprob given the tokens before it (None for the first, which has nothing
    before it), with `params.prompt_logprobs` alternatives (none when None), under `params`'
    distribution as for generated tokens (`batchspec.logprobs`).

    A property of the prompt alone, so computed here only, by plain forwards of the prompt in
    PROMPT_CHUNK-token pieces on transformers' own cache (memory: one piece's logits at a time);
    the engine never computes them, and the server and the Python API call this same function."""
    device = next(model.parameters()).device
    cache = new_dynamic_cache(model)
    top = params.prompt_logprobs or 0
    found: list[TokenLogprob | None] = [None]
    fed = len(prompt_ids) - 1  # the last token's logits predict generated text, not the prompt
    for start in range(0, fed, PROMPT_CHUNK):
        piece = prompt_ids[start : min(start + PROMPT_CHUNK, fed)]
        with prompt_pass():
            logits = forward_plain_positions(model, torch.tensor([piece], device=device), cache)
        for j, row in enumerate(logits):
            found.append(token_logprob(row, params, prompt_ids[start + j + 1], top))
    return found
