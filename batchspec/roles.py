"""Which tokens of the forward running now are prompt tokens: the one fact a layer may route on.

Under `--prefill-kernel int8` the target's quantized linears compute prompt tokens by another
product than generated ones (`batchspec.kernels.PREFILL_INT8`), as a quantized drafter's always do
(its deferred prefills too: `drafters.model`). Exactness needs a token to take the
same product wherever it is computed, so the route is the token's role, set here by whoever runs the
forward (the layouts' prefills, plain decoding's prefill, a fresh forward over a prompt and its
continuation), never a forward's size. A module of its own, importing nothing of batchspec, so
that layouts, the cache adapter and the kernels can all read it.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

ALL_POSITIONS = sys.maxsize
# How many leading positions of each sequence in the forward running now are prompt tokens.
_PROMPT_POSITIONS: ContextVar[int] = ContextVar("batchspec_prompt_positions", default=0)


@contextmanager
def prompt_pass(positions: int = ALL_POSITIONS) -> Iterator[None]:
    """Within: the first `positions` positions of each sequence a forward feeds are prompt tokens,
    the rest generated ones. Entered around prefills (every position) and around a fresh forward over
    a prompt and its continuation (its prompt's length); never around a forward of generated tokens
    only (a decoding step, a verify)."""
    token = _PROMPT_POSITIONS.set(positions)
    try:
        yield
    finally:
        _PROMPT_POSITIONS.reset(token)


def prompt_positions() -> int:
    """How many leading positions of each sequence in the current forward are prompt tokens."""
    return _PROMPT_POSITIONS.get()
