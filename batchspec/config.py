"""User-facing settings, validated on construction so that bad input fails early with one clear line."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field


class BatchspecError(Exception):
    """An error the user can act on (bad input, missing files, incompatible models).

    The CLI prints its message as one line instead of a traceback.
    """


METHODS = ("ar", "eqspec", "ragged", "exspec")
# Deliberately wrong methods (batchspec.forensics.broken), one published failure mode each; opt-in,
# for showing what the audit catches. Never use them for output.
BROKEN_METHODS = ("naive-kv", "naive-positions", "naive-bonus")
SCHEDULERS = ("static", "continuous")


def _require_int(name: str, value: object, optional: bool = False) -> None:
    """Refuse anything but an integer (None too when `optional`). Without this, 2.5 tokens fails
    deep inside torch and a string seed is silently hashed; bool is an int subclass in Python but
    `batch_size=True` is a mistake, not a request."""
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise BatchspecError(f"{name} must be an integer{' or None' if optional else ''}, got {value!r}")


def _require_finite(name: str, value: object) -> None:
    """Refuse non-numbers, NaN and infinities: NaN passes every `<`/`>` range check (a NaN
    temperature decoded token 0 forever)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise BatchspecError(f"{name} must be a finite number, got {value!r}")


@dataclass(frozen=True)
class SpecConfig:
    """How to decode: which method/layout, how many draft tokens, how many rows at once.

    method: `ar` plain decoding (no drafter), `eqspec` left-padded layout realigned every round (the
    paper's algorithm), `ragged` per-row KV cursors (never realigns), `exspec` sequence pool with
    same-length grouping.
    """

    method: str = "ragged"
    num_draft_tokens: int = 5
    batch_size: int = 4
    scheduler: str | None = None  # None: continuous for ragged (measured faster), static otherwise
    check_invariants: bool = False
    window_size: int | None = None
    sort_by_length: bool = False
    max_kv_slots: int | None = None

    def __post_init__(self) -> None:
        for name in ("num_draft_tokens", "batch_size"):
            _require_int(name, getattr(self, name))
        for name in ("window_size", "max_kv_slots"):
            _require_int(name, getattr(self, name), optional=True)
        if self.method not in METHODS + BROKEN_METHODS:
            raise BatchspecError(
                f"unknown method {self.method!r}; choose one of {', '.join(METHODS)} "
                f"(deliberately wrong, for audits: {', '.join(BROKEN_METHODS)})"
            )
        if self.scheduler is None:
            object.__setattr__(self, "scheduler", "continuous" if self.method == "ragged" else "static")
        if self.scheduler not in SCHEDULERS:
            raise BatchspecError(f"unknown scheduler {self.scheduler!r}; choose one of {', '.join(SCHEDULERS)}")
        if self.method != "ar" and self.num_draft_tokens < 1:
            raise BatchspecError(f"num_draft_tokens must be >= 1 for speculative methods, got {self.num_draft_tokens}")
        if self.batch_size < 1:
            raise BatchspecError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.scheduler == "continuous" and self.method not in ("ar", "ragged"):
            raise BatchspecError("the continuous scheduler needs per-row cursors (--method ragged or ar)")
        if self.max_kv_slots is not None and self.max_kv_slots < 1:
            raise BatchspecError(f"max_kv_slots must be >= 1, got {self.max_kv_slots}")
        if self.window_size is not None and self.window_size < self.batch_size:
            raise BatchspecError(f"window_size ({self.window_size}) must be >= batch_size ({self.batch_size})")

    @property
    def speculative(self) -> bool:
        return self.method != "ar"


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding settings. temperature 0 means greedy."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        for name in ("max_new_tokens", "top_k"):
            _require_int(name, getattr(self, name))
        _require_int("seed", self.seed, optional=True)
        for name in ("temperature", "top_p"):
            _require_finite(name, getattr(self, name))
        if self.max_new_tokens < 1:
            raise BatchspecError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise BatchspecError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise BatchspecError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise BatchspecError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
