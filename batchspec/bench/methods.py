"""Method specs: what a bench run compares, one entry per measured column.

    method[+option...][@batch]

options, in any order, each kind at most once:
    static | continuous | pool    the scheduler (default: the method's own)
    chunkN                        N prompt tokens a step (continuous scheduler; chunk0: whole prompts;
                                  default: the engine's, config.DEFAULT_PREFILL_TOKENS)
    kN                            at most N drafts per row and round (default: --num-draft-tokens)
    fixed | adaptive              the speculation policy (default: the method's own, as in `generate`)
    model | ngram | hybrid        the drafter (default: model)
e.g. ragged@1 (adaptive, ragged's default), ragged+k3+fixed@1, ragged+ngram@1, ragged+ngram+fixed@4,
ragged+hybrid@8; a name shows only the options that differ from the method's defaults.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from ..config import DRAFTERS, SPECULATION, BatchspecError
from ..methods import METHODS, SCHEDULERS

HF_PLAIN = "hf"
HF_ASSISTED = "hf-assisted"
BASELINES = (HF_PLAIN, HF_ASSISTED)
# engine methods, the deliberately wrong ones included: they put the "fast but wrong" plot to work
KNOWN = (*METHODS, *BASELINES)
DEFAULT_METHODS = "ar@1,ar,eqspec,ragged"
SYNTAX_HELP = (
    "comma-separated method[+option...][@batch]. Methods: ar, eqspec, ragged, exspec, hf (transformers generate, "
    "batched greedy), hf-assisted (generate with the drafter, batch 1 only), and the deliberately wrong naive-kv, "
    "naive-positions, naive-bonus. Options, any order: a scheduler (static, continuous, pool), chunkN (chunked "
    "prefill of N tokens a step; chunk0: whole prompts), kN (at most N drafts per row and round; default --num-draft-tokens), fixed or adaptive "
    "(speculation policy; default the method's own: adaptive for ragged, fixed for eqspec and exspec), model, "
    "ngram or hybrid (drafter; default model). E.g. ar@1,ragged+k1+fixed@1,ragged+k3+fixed@1,ragged+fixed@1,"
    "ragged@1,ragged+ngram@1,ragged+hybrid@1,eqspec@4,hf@4,hf-assisted@1. Without @batch a method runs at every "
    "--batch-sizes. ar@1 is always measured (the speedup base)."
)
_NUMBERED = re.compile(r"(chunk|k)(\d+)")


@dataclass(frozen=True)
class MethodSpec:
    """One measured configuration. `method` is an engine method or an HF baseline; `scheduler` and
    `speculation` None mean the method's default (as in `generate`); HF baselines have neither.
    `num_draft_tokens` None: the bench's --num-draft-tokens."""

    method: str
    batch_size: int
    scheduler: str | None = None
    prefill_chunk: int | None = None  # continuous scheduler: max_prefill_tokens (None: the default; 0: whole prompts)
    num_draft_tokens: int | None = None
    speculation: str | None = None
    drafter: str = "model"

    def __post_init__(self) -> None:
        if self.method in METHODS:
            method = METHODS[self.method]
            if self.scheduler is None:
                object.__setattr__(self, "scheduler", method.default_scheduler)
            if self.speculation is None:
                object.__setattr__(self, "speculation", method.default_speculation)

    @property
    def family(self) -> str:
        """The label without the batch size: one line per family in the throughput plot. Options
        are named only where they are not the default."""
        parts = [self.method]
        if self.method in METHODS and self.scheduler != METHODS[self.method].default_scheduler:
            parts.append(str(self.scheduler))
        if self.prefill_chunk is not None:
            parts.append(f"chunk{self.prefill_chunk}")
        if self.num_draft_tokens is not None:
            parts.append(f"k{self.num_draft_tokens}")
        if self.drafter != "model":
            parts.append(self.drafter)
        if self.method in METHODS and self.speculation != METHODS[self.method].default_speculation:
            parts.append(str(self.speculation))
        return "+".join(parts)

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

    @property
    def needs_draft_model(self) -> bool:
        return self.speculative and self.drafter != "ngram"


BASELINE_SPEC = MethodSpec("ar", 1)


def _options(item: str, method: str, words: list[str]) -> dict:
    """The keyword arguments of MethodSpec that `words` (the +options of `item`) set."""
    chosen: dict[str, object] = {}

    def put(kind: str, key: str, value: object) -> None:
        if key in chosen:
            raise BatchspecError(f"two {kind} options in {item!r}")
        chosen[key] = value

    for word in words:
        numbered = _NUMBERED.fullmatch(word)
        if word in SCHEDULERS:
            put("scheduler", "scheduler", word)
        elif word in SPECULATION:
            put("speculation", "speculation", word)
        elif word in DRAFTERS:
            put("drafter", "drafter", word)
        elif numbered:
            put(numbered[1], "prefill_chunk" if numbered[1] == "chunk" else "num_draft_tokens", int(numbered[2]))
        else:
            raise BatchspecError(f"unknown option {word!r} in {item!r}; use a scheduler ({', '.join(SCHEDULERS)}), "
                                 f"chunkN, kN, {' or '.join(SPECULATION)}, or a drafter ({', '.join(DRAFTERS)})")
    if method in BASELINES and chosen:
        raise BatchspecError(f"{method} takes no options ({item!r})")
    speculative = method in METHODS and METHODS[method].speculative
    if not speculative and chosen.keys() & {"num_draft_tokens", "speculation", "drafter"}:
        raise BatchspecError(f"{method} does not draft: kN, {'/'.join(SPECULATION)} and drafters do not apply ({item!r})")
    scheduler = chosen.get("scheduler")
    if scheduler is not None and scheduler not in METHODS[method].schedulers:
        raise BatchspecError(f"{method} supports the {' and '.join(METHODS[method].schedulers)} scheduler(s), "
                             f"not {scheduler} ({item!r})")
    if "prefill_chunk" in chosen:
        if (scheduler or METHODS[method].default_scheduler) != "continuous":
            raise BatchspecError(f"chunked prefill needs the continuous scheduler ({item!r})")
        if chosen["prefill_chunk"] < 0:
            raise BatchspecError(f"chunkN needs N >= 0 ({item!r})")
    if chosen.get("num_draft_tokens") == 0:
        raise BatchspecError(f"kN needs N >= 1 ({item!r})")
    return chosen


def _parse_one(item: str, batch_sizes: list[int]) -> list[MethodSpec]:
    head, at, size = item.partition("@")
    method, *words = head.split("+")
    if method not in KNOWN:
        raise BatchspecError(f"unknown method {method!r} in {item!r}; choose one of {', '.join(KNOWN)}")
    options = _options(item, method, words)
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
    return [MethodSpec(method, b, **options) for b in sizes]


def parse_methods(text: str, batch_sizes: list[int], prefill_chunks: list[int | None] | None = None) -> list[MethodSpec]:
    """Specs in the order given, duplicates dropped; `ar@1` is added first when missing because
    every speedup is measured against it. Methods on the continuous scheduler without their own
    chunkN run once per entry of `prefill_chunks` (None: the engine's default; 0: whole prompts; N:
    chunked prefill of N tokens a step)."""
    specs: list[MethodSpec] = []
    for item in (part.strip() for part in text.split(",")):
        if item:
            for spec in _parse_one(item, batch_sizes):
                if spec.scheduler == "continuous" and spec.prefill_chunk is None:
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


def parse_prefill_chunks(text: str | None) -> list[int | None]:
    """`--prefill-chunks`: token counts, 0 meaning whole prompts (no chunking); not given: the
    engine's default only."""
    return [None] if text is None else _int_list(text, "--prefill-chunks", 0)


def parse_batch_sizes(text: str) -> list[int]:
    return _int_list(text, "--batch-sizes", 1)
