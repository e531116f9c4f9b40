"""`method[+scheduler]@batch` specs: what a bench run compares, one entry per measured column."""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..config import BatchspecError
from ..methods import METHODS, SCHEDULERS

HF_PLAIN = "hf"
HF_ASSISTED = "hf-assisted"
BASELINES = (HF_PLAIN, HF_ASSISTED)
# engine methods, the deliberately wrong ones included: they put the "fast but wrong" plot to work
KNOWN = (*METHODS, *BASELINES)
DEFAULT_METHODS = "ar@1,ar,eqspec,ragged"


@dataclass(frozen=True)
class MethodSpec:
    """One measured configuration. `method` is an engine method or an HF baseline; `scheduler`
    None means the method's default (as in `generate`); HF baselines have none."""

    method: str
    batch_size: int
    scheduler: str | None = None
    prefill_chunk: int | None = None  # continuous scheduler: max_prefill_tokens (None: whole prompts)

    def __post_init__(self) -> None:
        if self.scheduler is None and self.method in METHODS:
            object.__setattr__(self, "scheduler", METHODS[self.method].default_scheduler)

    @property
    def family(self) -> str:
        """The label without the batch size: one line per family in the throughput plot. The
        scheduler is named only where it is not the method's default."""
        name = self.method
        if self.method in METHODS and self.scheduler != METHODS[self.method].default_scheduler:
            name += f"+{self.scheduler}"
        return name if self.prefill_chunk is None else f"{name}+chunk{self.prefill_chunk}"

    @property
    def name(self) -> str:
        return f"{self.family}@{self.batch_size}"

    @property
    def is_baseline(self) -> bool:
        """Hugging Face's own generate: no engine, so no phase breakdown."""
        return self.method in BASELINES

    @property
    def speculative(self) -> bool:
        return self.method != HF_PLAIN and (self.method not in METHODS or METHODS[self.method].speculative)


BASELINE_SPEC = MethodSpec("ar", 1)


def _parse_one(item: str, batch_sizes: list[int]) -> list[MethodSpec]:
    head, at, size = item.partition("@")
    method, plus, scheduler_name = head.partition("+")
    scheduler = scheduler_name if plus else None
    if method not in KNOWN:
        raise BatchspecError(f"unknown method {method!r} in {item!r}; choose one of {', '.join(KNOWN)}")
    if scheduler is not None and method in BASELINES:
        raise BatchspecError(f"{method} has no scheduler choice ({item!r})")
    if scheduler is not None and scheduler not in SCHEDULERS:
        raise BatchspecError(f"unknown scheduler {scheduler!r} in {item!r}; choose one of {', '.join(SCHEDULERS)}")
    if scheduler is not None and scheduler not in METHODS[method].schedulers:
        raise BatchspecError(f"{method} supports the {' and '.join(METHODS[method].schedulers)} scheduler(s), "
                             f"not {scheduler} ({item!r})")
    if at:
        try:
            sizes = [int(size)]
        except ValueError:
            raise BatchspecError(f"batch size in {item!r} is not an integer") from None
        if method == HF_ASSISTED and sizes != [1]:
            raise BatchspecError(f"{HF_ASSISTED} runs at batch size 1 only (transformers' limit), not {item!r}")
    else:
        # a sweep: assisted generation only exists at batch 1, so it contributes that one column
        sizes = [1] if method == HF_ASSISTED else batch_sizes
    if any(b < 1 for b in sizes):
        raise BatchspecError(f"batch size must be >= 1 in {item!r}")
    return [MethodSpec(method, b, scheduler) for b in sizes]


def parse_methods(text: str, batch_sizes: list[int], prefill_chunks: list[int | None] | None = None) -> list[MethodSpec]:
    """Specs in the order given, duplicates dropped; `ar@1` is added first when missing because
    every speedup is measured against it. Methods on the continuous scheduler run once per entry of
    `prefill_chunks` (None: whole prompts; N: chunked prefill of N tokens a step)."""
    specs: list[MethodSpec] = []
    for item in (part.strip() for part in text.split(",")):
        if item:
            for spec in _parse_one(item, batch_sizes):
                if spec.scheduler == "continuous":
                    specs.extend(replace(spec, prefill_chunk=chunk) for chunk in prefill_chunks or [None])
                else:
                    specs.append(spec)
    if not specs:
        raise BatchspecError("no methods given")
    unique = list(dict.fromkeys(specs))
    if BASELINE_SPEC not in unique:
        unique.insert(0, BASELINE_SPEC)
    return unique


def _int_list(text: str, option: str, minimum: int) -> list[int]:
    """Comma-separated integers >= minimum, duplicates dropped, or one clear error naming `option`."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise BatchspecError(f"{option} must be comma-separated integers, got {text!r}") from None
    if not values or any(v < minimum for v in values):
        raise BatchspecError(f"{option} must list integers >= {minimum}, got {text!r}")
    return list(dict.fromkeys(values))


def parse_prefill_chunks(text: str) -> list[int | None]:
    """`--prefill-chunks`: token counts, 0 meaning whole prompts (no chunking)."""
    return list(dict.fromkeys(c or None for c in _int_list(text, "--prefill-chunks", 0)))


def parse_batch_sizes(text: str) -> list[int]:
    return _int_list(text, "--batch-sizes", 1)
