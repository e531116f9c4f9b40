"""Arguments and builders shared by the commands, so every command spells options the same way."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from ..config import ModelConfig, SamplingParams, SpecConfig
from ..llm import LLM
from ..methods import METHODS, SCHEDULERS, method_help
from ..models import ModelPair, encode_prompt, load_pair
from ..prompts import FORMATS


def finite_float(text: str) -> float:
    """argparse type for every float option: Python's float() accepts 'nan' and 'inf', which pass
    every range check (NaN compares false with everything) and then decode garbage."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """argparse type for counts such as --limit, where 0 or a negative value (a slice would drop
    prompts from the end) is never what the user meant."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_prompt_format_argument(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    p.add_argument("--format", choices=FORMATS, default="auto",
                   help="how to read --prompts: jsonl (one JSON object a line), text (one prompt a line) or auto "
                   "(jsonl for .jsonl/.ndjson/.json in any case, or when the first non-empty line starts with '{')")


def add_model_arguments(p: argparse.ArgumentParser, with_draft: bool = True) -> None:
    """Model options; `with_draft=False` for commands that never load a drafter (so --help does
    not offer options they would ignore)."""
    g = p.add_argument_group("models")
    g.add_argument("--target", help="HF model folder or .gguf file (default: bundled Qwen2.5-Coder-1.5B-Instruct)")
    if with_draft:
        g.add_argument("--draft", help="HF model folder or .gguf file (default: bundled Qwen2.5-Coder-0.5B-Instruct)")
    g.add_argument("--dtype", default="float32", help="target dtype: float32 | bfloat16 | float16")
    if with_draft:
        g.add_argument("--draft-dtype", help="drafter dtype (default: --dtype); changes acceptance, never the output")
    g.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    g.add_argument("--no-chat-template", action="store_true", help="feed prompts raw, without the chat template")
    g.add_argument("--allow-special-tokens", action="store_true",
                   help="parse control tokens spelled in prompt text (e.g. <|im_end|>) as control tokens; by "
                   "default prompt text is tokenized as plain text, so it cannot forge chat turns")


def add_decoding_arguments(p: argparse.ArgumentParser, method_default: str = "ragged") -> None:
    g = p.add_argument_group("decoding")
    g.add_argument("--method", default=method_default, choices=list(METHODS), help=method_help())
    g.add_argument("--batch-size", "--max-num-seqs", dest="batch_size", type=int, default=4,
                   help="rows decoded together (with --scheduler continuous: the most sequences in flight)")
    g.add_argument("--num-draft-tokens", "-k", type=int, default=5, help="K: tokens the drafter proposes per round")
    g.add_argument("--scheduler", choices=SCHEDULERS,
                   help="static: whole batches; continuous: refill a finished row's slot at once "
                   "(default: the method's own, " + ", ".join(f"{n} {m.default_scheduler}" for n, m in METHODS.items()
                                                               if not m.deliberately_wrong) + ")")
    g.add_argument("--window-size", type=int, help="exspec: sequences in the sliding window (default 4x batch size)")
    g.add_argument("--sort-by-length", action="store_true", help="exspec: sort prompts by length first")
    g.add_argument("--max-kv-slots", type=int, help="K/V budget per model, in token slots (rows x slots per row); "
                   "fewer rows are admitted at once if needed")
    g.add_argument("--check-invariants", action="store_true", help="verify layout invariants and cached K/V every round")


def add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-new-tokens", type=int, default=64, help="token budget per prompt")
    g.add_argument("--temperature", type=finite_float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=finite_float, default=1.0, help="nucleus sampling mass, in (0, 1]; 1 = off")
    g.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens; 0 = off")
    g.add_argument("--seed", type=int, help="per-request seed base: request i uses seed + i")


def spec_from_args(args: argparse.Namespace, **overrides) -> SpecConfig:
    fields = dict(
        method=args.method,
        num_draft_tokens=args.num_draft_tokens,
        batch_size=args.batch_size,
        scheduler=args.scheduler,
        check_invariants=args.check_invariants,
        window_size=args.window_size,
        sort_by_length=args.sort_by_length,
        max_kv_slots=args.max_kv_slots,
    )
    fields.update(overrides)
    return SpecConfig(**fields)


def params_for(args: argparse.Namespace, count: int) -> list[SamplingParams]:
    """One SamplingParams per request; with --seed, request i gets seed + i (distinct streams)."""
    return [
        SamplingParams(
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=None if args.seed is None else args.seed + i,
        )
        for i in range(count)
    ]


def model_config(args: argparse.Namespace) -> ModelConfig:
    return ModelConfig(target=args.target, draft=getattr(args, "draft", None), dtype=args.dtype,
                       draft_dtype=getattr(args, "draft_dtype", None), device=args.device,
                       chat_template=not args.no_chat_template, allow_special_tokens=args.allow_special_tokens)


def load_models(args: argparse.Namespace, need_draft: bool) -> ModelPair:
    return load_pair(model_config(args), need_draft=need_draft)


def prompt_encoder(args: argparse.Namespace, models: ModelPair) -> Callable[[str], list[int]]:
    """Prompt text -> token ids as the command line asked (chat template, control tokens)."""
    config = model_config(args)
    return lambda text: encode_prompt(models.tokenizer, text, config.chat_template, config.allow_special_tokens)


def make_llm(args: argparse.Namespace, models: ModelPair, spec: SpecConfig) -> LLM:
    return LLM(model_config(args), spec=spec, models=models)
