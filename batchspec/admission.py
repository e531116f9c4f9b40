"""What a request must be before it is queued, checked once with one clear line each: token ids in
the vocabulary, within the model's context, within the K/V slots a row can have. What plain decoding
could not serve either is refused the same way by the audit's oracle."""

from __future__ import annotations

from numbers import Integral

from .config import SamplingParams
from .errors import BatchspecError


def token_ids(prompt: object, vocab: int) -> list[int]:
    """The prompt as a list of ints, or BatchspecError: not a list of ids, or an id outside 0..vocab-1."""
    if isinstance(prompt, (str, bytes)) or not hasattr(prompt, "__iter__"):
        raise BatchspecError(f"a prompt must be a list of token ids here, got {type(prompt).__name__}")
    ids = list(prompt)  # type: ignore[call-overload]
    bad = next((t for t in ids if not isinstance(t, Integral) or isinstance(t, bool) or not 0 <= t < vocab), None)
    if bad is not None:
        raise BatchspecError(f"token id {bad!r} is not in the model's vocabulary (ids 0..{vocab - 1})")
    return [int(t) for t in ids]


def validate_prompt(prompt_ids: list[int], params: SamplingParams, limit: int | None) -> None:
    """Reject what plain decoding could not serve either, with one clear line."""
    if not prompt_ids:
        raise BatchspecError("empty prompt")
    if limit is not None and len(prompt_ids) + params.max_new_tokens > limit:
        raise BatchspecError(
            f"prompt of {len(prompt_ids)} tokens + max_new_tokens {params.max_new_tokens} exceeds the "
            f"model's context of {limit} tokens"
        )


def check_slots(prompt_len: int, params: SamplingParams, need: int, round_slots: int,
                budget: int | None, capacity: int | None) -> None:
    """Reject a row needing `need` K/V slots (its prompt, max_new_tokens and `round_slots` for a round
    in flight) beyond `max_kv_slots` (`budget`) or what the engine reserved per row (`capacity`)."""
    what = (f"prompt of {prompt_len} tokens + max_new_tokens {params.max_new_tokens} + {round_slots} slots for a "
            f"round in flight needs {need} K/V slots")
    if budget is not None and need > budget:
        raise BatchspecError(f"{what}, more than max_kv_slots {budget}")
    if capacity is not None and need > capacity:
        raise BatchspecError(f"{what} per row; this engine reserved {capacity}")
