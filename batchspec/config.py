"""User-facing settings, validated on construction so that bad input fails early with one clear line."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field, replace
from typing import Any

from .errors import BatchspecError
from .methods import METHODS, SCHEDULERS, correct_methods, method_help, wrong_methods


def option(default: Any, help: str, *flags: str, **argparse_kwargs: Any) -> Any:
    """A dataclass field that is also a command-line option (`batchspec.commands.common` builds the
    option from it): one definition of each setting's default and meaning for the Python API, the CLI
    and the bench. `flags` default to --field-name; `argparse_kwargs` (type, choices, action) as for
    `add_argument`; a float field's option refuses NaN and infinities."""
    return field(default=default, metadata={"help": help, "flags": flags, **argparse_kwargs})


NGRAM = "ngram"  # ModelConfig.draft naming prompt lookup instead of a model
DRAFTERS = ("model", NGRAM, "hybrid")
SPECULATION = ("fixed", "adaptive")
LINEAR_KERNELS = ("auto", "packed", "torch")  # batchspec.kernels: auto = packed where supported
QUANTIZATIONS = ("none", "int8", "int4")  # weight-only, batchspec.kernels.apply_quantization
DRAFT_QUANTIZATIONS = (*QUANTIZATIONS, "auto")  # auto: int4 where its kernel runs (models.draft_quantization)
GROUP_SIZES = (32, 128)  # int4: inputs sharing one scale and zero
PREFILL_KERNELS = ("weights", "int8")  # prompt tokens of quantized linears: batchspec.kernels.PREFILL_INT8
# Tokens a continuous-scheduler step may prefill (and feed a lagging drafter) besides its round, by
# default. Every row waits for them: the bundled 1.5B target prefills ~40-100 tokens/s on a 2-core CPU
# and a decoding step takes 0.1-0.5 s, so 128 tokens stall the rows ~1.3-3 s a step (256: ~2.5-6 s,
# ten plain steps and more; a whole 1,000-token prompt ~25 s), while a ~1,000-token prompt still
# enters in ~8 steps. Much smaller chunks would pay each forward's fixed cost (every weight read
# once, ~0.1-0.4 s) for few tokens and delay a new prompt's first token for little gain.
DEFAULT_PREFILL_TOKENS = 128
# Prefix cache budget (GiB of K/V, target and drafter together) where `prefix_cache_gb` is None: what
# `serve` runs by default. The bundled float32 target's K/V is ~57 KB a token, so 1 GiB holds ~18,000
# prompt tokens (a 1,000-token system prompt and a few dozen conversations); offline runs (`generate`,
# the API, the bench) default to no cache, so timings never depend on what an earlier run left in it.
DEFAULT_PREFIX_CACHE_GB = 1.0
# The smallest sampling temperature (0 is greedy). Logits are divided by it in the model's dtype: at
# 1e-38 float32 logits became inf and NaN and decoded EOS or token 0 forever, and a float16 logit of
# 10 overflows below ~1.5e-4. vLLM raises temperatures below 0.01 to 0.01 for the same reason; a
# request is refused instead, so that what it asked for is never silently changed.
MIN_TEMPERATURE = 0.01
# Alternatives (most likely tokens) a position's logprobs may list: OpenAI's `top_logprobs` maximum
# and vLLM's default `max_logprobs`.
MAX_LOGPROBS = 20
# torch.Generator.manual_seed takes 0 .. 2**64 - 1 (a larger seed raised "Overflow" deep inside torch).
MAX_GENERATOR_SEED = 2**64 - 1


@dataclass(frozen=True)
class ModelConfig:
    """Which models to load and how prompts are turned into ids: everything `LLM`, the CLI and the
    bench need to know about the models, in one place.

    target/draft: a local Hugging Face folder, a `.gguf` file, or None for the bundled pair; draft
    `ngram` loads no drafter model and drafts by prompt lookup (`SpecConfig.drafter` "ngram").
    draft_dtype None: the target's dtype; "auto": bfloat16 where the device computes it natively, else the
    target's (`models.draft_dtype`). A different drafter dtype changes acceptance, never the output.
    chat_template: wrap text prompts in the tokenizer's chat template when it has one.
    allow_special_tokens: parse control tokens spelled in prompt text (e.g. `<|im_end|>`); off, prompt
    text is plain text and cannot forge chat turns.
    quantization: the target's linears as weight-only int8 or int4 (`kernels.apply_quantization`); plain
    decoding, `--verify` and the oracle run the same quantized model, so exact means token-identical to
    plain decoding of the model as loaded. draft_quantization None: "auto" under draft_dtype "auto",
    else the target's; "auto": int4 where its kernel runs and bfloat16 is not native, where it measured
    faster (`models.draft_quantization`). Like the drafter's dtype it changes acceptance, never the output.
    prefill_kernel "int8": the target's quantized linears compute prompt tokens as int8 x int8 products
    (`kernels.PREFILL_INT8`), generated tokens by the weights' kernel; plain decoding does the same.
    A quantized drafter has the int8 path whatever this says, for its prefills, deferred ones included
    (`models.draft_prefill_kernel`): drafts are proposals, so it changes speed, never the output.
    """

    target: str | None = option(None, "HF model folder or .gguf file (default: bundled Qwen2.5-Coder-1.5B-Instruct)")
    draft: str | None = option(None, "HF model folder or .gguf file, or `ngram`: prompt lookup over each row's context, "
                               "no second model (default: bundled Qwen2.5-Coder-0.5B-Instruct)")
    dtype: str = option("float32", "target dtype: float32 | bfloat16 | float16")
    draft_dtype: str | None = option(None, "drafter dtype (default: --dtype); auto = bfloat16 where the device "
                                     "computes it natively, else --dtype; changes acceptance, never the output")
    device: str = option("cpu", "cpu, cuda, cuda:1, ...")
    linear_kernel: str = option(
        "auto", "linear layers: packed = oneDNN with weights packed once at load (CPU, float32/bfloat16: "
        "~1.5x faster steps, and a K+1-token verify costs about one step); torch = torch's default; "
        "auto = packed where supported", choices=list(LINEAR_KERNELS))
    quantization: str = option(
        "none", "target weights: none (as loaded) | int8 (per output channel) | int4 (groups of "
        "--quantization-group-size; the output layer int8); CPU kernels of torch on bfloat16 activations; plain "
        "decoding and --verify run the same quantized model", choices=list(QUANTIZATIONS))
    draft_quantization: str | None = option(
        None, "drafter weights: none | int8 | int4 | auto = int4 where the CPU runs its kernel and has no native "
        "bfloat16, else --quantization (default: auto with --draft-dtype auto, else --quantization); changes "
        "acceptance, never the output",
        choices=list(DRAFT_QUANTIZATIONS))
    quantization_group_size: int = option(32, "int4: inputs per scale and zero (32 or 128)", type=int,
                                          choices=list(GROUP_SIZES))
    prefill_kernel: str = option(
        "weights", "prompt tokens of the quantized target's linears: weights = the weights' own kernel; int8 = "
        "int8 activations (a scale per token and block of <= 1536 inputs) times int8 weights, ~2x faster prefill for one int8 copy "
        "of the int4 weights; generated tokens always take the weights' kernel, and plain decoding does the same",
        choices=list(PREFILL_KERNELS))
    chat_template: bool = option(True, "feed prompts raw, without the chat template", "--no-chat-template",
                                 action="store_false")
    allow_special_tokens: bool = option(
        False, "parse control tokens spelled in prompt text (e.g. <|im_end|>) as control tokens; by default "
        "prompt text is tokenized as plain text, so it cannot forge chat turns", action="store_true")

    def __post_init__(self) -> None:
        if self.quantization not in QUANTIZATIONS:
            raise BatchspecError(f"unknown quantization {self.quantization!r}; choose one of {', '.join(QUANTIZATIONS)}")
        if self.draft_quantization is not None and self.draft_quantization not in DRAFT_QUANTIZATIONS:
            raise BatchspecError(f"unknown draft quantization {self.draft_quantization!r}; choose one of "
                                 f"{', '.join(DRAFT_QUANTIZATIONS)}")
        if self.prefill_kernel not in PREFILL_KERNELS:
            raise BatchspecError(f"unknown prefill kernel {self.prefill_kernel!r}; choose one of {', '.join(PREFILL_KERNELS)}")
        if self.prefill_kernel == "int8" and self.quantization == "none":
            raise BatchspecError("--prefill-kernel int8 is for quantized targets: add --quantization int8 or int4")
        _require_int("quantization_group_size", self.quantization_group_size)
        if self.quantization_group_size not in GROUP_SIZES:
            raise BatchspecError(f"quantization_group_size must be one of {', '.join(map(str, GROUP_SIZES))}, "
                                 f"got {self.quantization_group_size}")


def half_precision_refusal(dtype_name: str) -> BatchspecError:
    """Why a half-precision target is refused: the engine's exactness is batch invariance (a row's
    logits do not depend on the rows and tokens sharing its forward), and torch's bfloat16 and
    float16 products round differently with the number of rows (issue 33's review found plain
    decoding at batch 4 differing from batch 1 on a tiny model), so outputs could differ."""
    return BatchspecError(
        f"a {dtype_name} target is not batch-invariant (torch's half-precision products round differently with "
        "the number of rows a forward feeds), so outputs could differ from plain decoding of each prompt alone: "
        "load the target in float32 (the drafter may stay in bfloat16: --draft-dtype, it changes acceptance only)")


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

    method: a name from `batchspec.methods.METHODS` (`ar` plain decoding, `eqspec`, `ragged`,
    `exspec`, and the deliberately wrong ones kept for audits). scheduler None: the method's default.
    generator_seed: seeds the engine's generator, which only unseeded sampled requests (rejection
    rule) draw from, so such runs are repeatable; requests with their own seed never depend on it
    (with adaptive speculation, how many drafts a round verifies depends on measured times, so an
    unseeded run repeats only under the same decisions).
    speculation: `fixed` verifies num_draft_tokens drafts every round; `adaptive` (batchspec.speculation)
    at most that many, as many as pay for themselves on measured costs. None: the method's default
    (`adaptive` for ragged, `fixed` for the paper's eqspec and exspec, as the paper runs them).
    drafter: `model` (the draft model), `ngram` (prompt lookup, no second model) or `hybrid`.
    prefix_cache_gb: the prefix cache's budget (`batchspec.kv.prefix`); 0 off, None the default budget
    where the method and target allow it (what `serve` runs), off elsewhere.
    """

    method: str = option("ragged", method_help(), choices=list(METHODS))
    num_draft_tokens: int = option(5, "K: the most drafts a row verifies per round (every round with --speculation "
                                   "fixed)", "--num-draft-tokens", "-k",
                                   type=int)
    batch_size: int = option(4, "rows decoded together (with --scheduler continuous: the most sequences in flight)",
                             "--batch-size", "--max-num-seqs", type=int)
    scheduler: str | None = option(
        None, "static: whole batches; continuous: refill a finished row at once; pool: EXSPEC's window "
        "(default: the method's own: " + ", ".join(f"{n} {m.default_scheduler}" for n, m in METHODS.items()
                                                    if not m.deliberately_wrong) + ")", choices=SCHEDULERS)
    check_invariants: bool = option(False, "verify layout invariants and cached K/V every round", action="store_true")
    window_size: int | None = option(None, "exspec: sequences in the sliding window (default 4x batch size)", type=int)
    sort_by_length: bool = option(False, "exspec: admit the shortest waiting prompts first", action="store_true")
    max_kv_slots: int | None = option(None, "K/V budget per model, in token slots (rows x slots per row); fewer rows "
                                      "are admitted at once if needed", type=int)
    max_prefill_tokens: int | None = option(
        None, "continuous scheduler: prompt tokens prefilled, and drafter catch-up tokens fed, per step at most "
        "(chunked prefill), so a long prompt does not stall the rows already decoding; 0: whole prompts in one "
        f"forward (default: {DEFAULT_PREFILL_TOKENS} with the continuous scheduler where the models allow it, "
        "whole prompts otherwise and for recurrent-state models)", type=int)
    generator_seed: int | None = option(None, "seed of the engine's generator, which only unseeded sampled requests "
                                        "draw from: makes such runs repeatable", type=int)
    speculation: str | None = option(
        None, "fixed: verify --num-draft-tokens drafts every round; adaptive: at most that many per row, only as "
        "many as are expected to pay for their drafting and verification on this machine's measured costs (down to "
        "none: a plain decoding step) (default: the method's own: " + ", ".join(
            f"{n} {m.default_speculation}" for n, m in METHODS.items() if m.speculative and not m.deliberately_wrong)
        + ")", choices=list(SPECULATION))
    drafter: str = option(
        "model", "model: the --draft model proposes; ngram: prompt lookup, the tokens that followed the first earlier "
        "occurrence of the longest context suffix of --ngram-min..--ngram-max tokens (no second model; --draft ngram "
        "selects it too); hybrid: the n-gram continuation where a row's context has one, the draft model elsewhere",
        choices=list(DRAFTERS))
    ngram_min: int = option(2, "prompt lookup: shortest context suffix to match (vLLM's prompt_lookup_min)", type=int)
    ngram_max: int = option(5, "prompt lookup: longest context suffix to match (vLLM's prompt_lookup_max)", type=int)
    prefix_cache_gb: float | None = option(
        0.0, "GiB of K/V (target and drafter) kept of prompts prefilled before, in blocks of 16 tokens, so a prompt "
        "that starts the same (a shared system prompt, the next turn of a chat) prefills only the rest, with "
        "outputs unchanged bit for bit; least recently used blocks go first; 0: off (default: 0; serve: "
        f"{DEFAULT_PREFIX_CACHE_GB:g} where the method and model allow it: ragged, ar or exspec, no recurrent state)",
        type=float)

    def __post_init__(self) -> None:
        for name in ("num_draft_tokens", "batch_size", "ngram_min", "ngram_max"):
            _require_int(name, getattr(self, name))
        for name in ("window_size", "max_kv_slots", "max_prefill_tokens", "generator_seed"):
            _require_int(name, getattr(self, name), optional=True)
        if self.method not in METHODS:
            raise BatchspecError(
                f"unknown method {self.method!r}; choose one of {', '.join(correct_methods())} "
                f"(deliberately wrong, for audits: {', '.join(wrong_methods())})"
            )
        method = METHODS[self.method]
        if self.scheduler is None:
            object.__setattr__(self, "scheduler", method.default_scheduler)
        if self.scheduler not in SCHEDULERS:
            raise BatchspecError(f"unknown scheduler {self.scheduler!r}; choose one of {', '.join(SCHEDULERS)}")
        if self.scheduler not in method.schedulers:
            raise BatchspecError(
                f"method {self.method} supports the {' and '.join(method.schedulers)} scheduler"
                f"{'s' if len(method.schedulers) > 1 else ''}, not {self.scheduler}"
                + (" (continuous batching needs per-row cursors: ragged or ar)" if self.scheduler == "continuous" else "")
            )
        if self.method != "ar" and self.num_draft_tokens < 1:
            raise BatchspecError(f"num_draft_tokens must be >= 1 for speculative methods, got {self.num_draft_tokens}")
        if self.batch_size < 1:
            raise BatchspecError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.max_prefill_tokens is not None and self.max_prefill_tokens < 0:
            raise BatchspecError(f"max_prefill_tokens must be >= 0 (0: whole prompts), got {self.max_prefill_tokens}")
        if self.max_prefill_tokens and self.scheduler != "continuous":
            raise BatchspecError("max_prefill_tokens (chunked prefill) needs the continuous scheduler")
        if self.max_kv_slots is not None and self.max_kv_slots < 1:
            raise BatchspecError(f"max_kv_slots must be >= 1, got {self.max_kv_slots}")
        if self.scheduler == "pool" and self.window_size is not None and self.window_size < self.batch_size:
            raise BatchspecError(f"window_size ({self.window_size}) must be >= batch_size ({self.batch_size})")
        if self.speculation is None:
            object.__setattr__(self, "speculation", method.default_speculation)
        if self.speculation not in SPECULATION:
            raise BatchspecError(f"unknown speculation {self.speculation!r}; choose one of {', '.join(SPECULATION)}")
        if self.drafter not in DRAFTERS:
            raise BatchspecError(f"unknown drafter {self.drafter!r}; choose one of {', '.join(DRAFTERS)}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise BatchspecError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min} and {self.ngram_max}")
        if self.prefix_cache_gb is not None:
            _require_finite("prefix_cache_gb", self.prefix_cache_gb)
            if self.prefix_cache_gb < 0:
                raise BatchspecError(f"prefix_cache_gb must be >= 0 (0: off), got {self.prefix_cache_gb}")
            if self.prefix_cache_gb > 0 and not method.prefix_cache:
                able = ", ".join(n for n, m in METHODS.items() if m.prefix_cache)
                raise BatchspecError(
                    f"prefix_cache_gb needs rows that start at slot 0 ({able}); method {self.method} "
                    + ("is deliberately wrong (kept for audits)" if method.deliberately_wrong else
                       "keeps rows in a left-padded rectangle, where a row's slots shift with the others'"))
        if self.generator_seed is not None and not 0 <= self.generator_seed <= MAX_GENERATOR_SEED:
            raise BatchspecError(f"generator_seed must be in 0..2**64-1, got {self.generator_seed}")

    @property
    def speculative(self) -> bool:
        return METHODS[self.method].speculative

    @property
    def needs_draft_model(self) -> bool:
        return self.speculative and self.drafter != NGRAM

    @property
    def prefill_budget(self) -> int | None:
        """Prompt and drafter catch-up tokens a step may feed besides its round (None: unbounded, whole
        prompts): `max_prefill_tokens`, or by default DEFAULT_PREFILL_TOKENS under the continuous
        scheduler (the others admit only between batches or fill a pool, and prefill whole prompts)."""
        if self.max_prefill_tokens is None:
            return DEFAULT_PREFILL_TOKENS if self.scheduler == "continuous" else None
        return self.max_prefill_tokens or None

    def prefix_cache_bytes(self, stateful: bool) -> int:
        """The prefix cache's budget in bytes for a target with (`stateful`) or without recurrent state:
        `prefix_cache_gb`, or where it is None DEFAULT_PREFIX_CACHE_GB where the method and target allow
        it, else 0 (off). Asked for explicitly, it is refused where it cannot work."""
        if self.prefix_cache_gb is None:
            usable = METHODS[self.method].prefix_cache and not stateful
            return int(DEFAULT_PREFIX_CACHE_GB * 2**30) if usable else 0
        if self.prefix_cache_gb > 0 and stateful:
            raise BatchspecError("prefix_cache_gb is not supported for targets with recurrent state: a cached "
                                 "prefix would need the state at each block boundary too (use 0)")
        return int(self.prefix_cache_gb * 2**30)

    @property
    def max_drafts(self) -> int:
        """Drafts a round may verify per row: K, or 0 for plain decoding."""
        return self.num_draft_tokens if self.speculative else 0


def resolve_drafter(model: ModelConfig, spec: SpecConfig) -> SpecConfig:
    """`--draft ngram` (ModelConfig.draft) means drafting by prompt lookup: the spec's drafter follows."""
    if model.draft != NGRAM or spec.drafter == NGRAM:
        return spec
    if spec.drafter == "hybrid":
        raise BatchspecError("the hybrid drafter needs a draft model, but --draft ngram loads none")
    return replace(spec, drafter=NGRAM)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding settings. temperature 0 means greedy; a sampled temperature is at least
    MIN_TEMPERATURE."""

    max_new_tokens: int = option(64, "token budget per request", type=int)
    temperature: float = option(0.0, f"0 = greedy; else at least {MIN_TEMPERATURE}", type=float)
    top_p: float = option(1.0, "nucleus sampling mass, in (0, 1]; 1 = off", type=float)
    top_k: int = option(0, "sample among the k most likely tokens; 0 = off", type=int)
    seed: int | None = option(None, "seeded sampling, token-identical to plain seeded sampling (on the command "
                              "line a base: request i gets seed + i)", type=int)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # Log-probabilities (`batchspec.logprobs`): None: none; k: each generated token's, with the k most
    # likely alternatives at its position (0..MAX_LOGPROBS). Not options of every command (a bench
    # would pay for them): `generate --logprobs` adds its own.
    logprobs: int | None = None
    # The same for the prompt's tokens (each given the tokens before it; the first has none), computed
    # by one plain forward of the prompt (`reference.prompt_logprobs`), as OpenAI's `echo` reports them.
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_new_tokens", "top_k"):
            _require_int(name, getattr(self, name))
        for name in ("seed", "logprobs", "prompt_logprobs"):
            _require_int(name, getattr(self, name), optional=True)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise BatchspecError(f"{name} must be in 0..{MAX_LOGPROBS} (alternatives per token; None: no "
                                     f"logprobs), got {value}")
        for name in ("temperature", "top_p"):
            _require_finite(name, getattr(self, name))
        if self.max_new_tokens < 1:
            raise BatchspecError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise BatchspecError(f"temperature must be >= 0, got {self.temperature}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise BatchspecError(f"temperature must be 0 (greedy) or >= {MIN_TEMPERATURE}, got {self.temperature}: "
                                 f"dividing logits by less overflows them")
        if not 0 < self.top_p <= 1:
            raise BatchspecError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise BatchspecError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if isinstance(self.stop_token_ids, (str, bytes)) or not hasattr(self.stop_token_ids, "__iter__"):
            raise BatchspecError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
        stops = tuple(self.stop_token_ids)
        for token in stops:
            _require_int("stop_token_ids entries", token)
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in stops))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def choice_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """The requests behind n choices of one request (OpenAI's `n`): choice i is decoded as the same
    request with seed `seed + i`, so each seeded choice is token-identical to that request sent alone
    with that seed (the rule `generate --seed` uses for its prompts). Unseeded choices are n independent
    samples; greedy ones are n identical decodes."""
    if n < 1:
        raise BatchspecError(f"n must be >= 1, got {n}")
    return [params if params.seed is None else replace(params, seed=params.seed + i) for i in range(n)]
