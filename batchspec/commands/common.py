"""Arguments and builders shared by the commands, so every command spells options the same way."""

from __future__ import annotations

import argparse
import math
import os
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from ..config import BatchspecError, ModelConfig, SamplingParams, SpecConfig
from ..llm import LLM
from ..models import ModelPair, encode_prompt, load_pair
from ..prompts import FORMATS

C = TypeVar("C")

if TYPE_CHECKING:
    from ..ray import RayLLM


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


def check_writable(path: str | Path, option: str, inputs: Iterable[str | Path] = ()) -> Path:
    """Make sure a file a command writes at the end can be written, before the command's work: an
    audit that ran for an hour and then found `--report`'s folder missing lost its result. Creates
    the folder, probes it with a temporary file, and refuses a path that is one of `inputs`."""
    target = Path(path)
    for given in inputs:
        if target.resolve() == Path(given).resolve():
            raise BatchspecError(f"{option} {path} is an input of this command: writing it would destroy it")
    if target.is_dir():
        raise BatchspecError(f"{option} is a directory, not a file: {path}")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=target.parent):
            pass
    except OSError as err:
        raise BatchspecError(f"cannot write {option} {path}: {err.strerror}") from None
    if target.exists() and not os.access(target, os.W_OK):
        raise BatchspecError(f"cannot write {option} {path}: it is not writable")
    return target


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


def add_config_arguments(
    p: argparse.ArgumentParser, cls: type, title: str, only: Iterable[str] | None = None, **defaults: Any
) -> None:
    """One option per field of the dataclass `cls` (ModelConfig, SpecConfig, SamplingParams) that
    declares one (`batchspec.config.option`), in an argument group `title`: the field's default, help
    and flags, so a setting is defined once for the API and every command. `only` limits the fields;
    `defaults` override a field's default for this command."""
    g = p.add_argument_group(title)
    for f in fields(cls):
        meta = dict(f.metadata)
        if "help" not in meta or (only is not None and f.name not in only):
            continue
        flags = meta.pop("flags") or ("--" + f.name.replace("_", "-"),)
        if meta.get("type") is float:
            meta["type"] = finite_float
        g.add_argument(*flags, dest=f.name, default=defaults.get(f.name, f.default), **meta)


def config_from_args(cls: type[C], args: argparse.Namespace, **overrides: Any) -> C:
    """An instance of `cls` from the parsed options named like its fields (others keep their
    defaults), so its own validation speaks for the command line too."""
    values = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
    return cls(**{**values, **overrides})


def add_model_arguments(p: argparse.ArgumentParser, with_draft: bool = True) -> None:
    """Model options; `with_draft=False` for commands that never load a drafter (so --help does
    not offer options they would ignore)."""
    names = [f.name for f in fields(ModelConfig) if with_draft or not f.name.startswith("draft")]
    add_config_arguments(p, ModelConfig, "models", only=names)


def add_decoding_arguments(p: argparse.ArgumentParser, **defaults: Any) -> None:
    add_config_arguments(p, SpecConfig, "decoding", **defaults)


def add_sampling_arguments(p: argparse.ArgumentParser, only: Iterable[str] | None = None, **defaults: Any) -> None:
    add_config_arguments(p, SamplingParams, "sampling", only=only, **defaults)


def params_for(args: argparse.Namespace, count: int) -> list[SamplingParams]:
    """One SamplingParams per request; with --seed, request i gets seed + i (distinct streams)."""
    base = config_from_args(SamplingParams, args)
    return [base if base.seed is None else replace(base, seed=base.seed + i) for i in range(count)]


def model_config(args: argparse.Namespace) -> ModelConfig:
    return config_from_args(ModelConfig, args)


def load_models(args: argparse.Namespace, need_draft: bool) -> ModelPair:
    return load_pair(model_config(args), need_draft=need_draft)


def prompt_encoder(args: argparse.Namespace, models: ModelPair) -> Callable[[str], list[int]]:
    """Prompt text -> token ids as the command line asked (chat template, control tokens)."""
    config = model_config(args)
    return lambda text: encode_prompt(models.tokenizer, text, config.chat_template, config.allow_special_tokens)


def make_llm(args: argparse.Namespace, models: ModelPair, spec: SpecConfig) -> LLM:
    return LLM(model_config(args), spec=spec, models=models)


def add_ray_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("ray (scale-out; needs `pip install batchspec[ray]`)")
    g.add_argument("--ray", action="store_true", help="decode on a Ray cluster, one engine per worker")
    g.add_argument("--ray-address", help="auto: the cluster `ray start` runs on this node; HOST:6379: that cluster's "
                   "head (default: start a local cluster)")
    g.add_argument("--ray-workers", type=int, default=1, help="actors, each with its own models loaded once")
    g.add_argument("--ray-batch-rows", type=int, help="prompts per call to a worker (default: enough calls to "
                   "keep every worker busy, at most 64 prompts each)")
    g.add_argument("--ray-cpus-per-worker", type=float, default=1, help="CPUs Ray reserves for each worker "
                   "(torch uses as many threads)")
    g.add_argument("--ray-gpus-per-worker", type=float, default=0, help="GPUs Ray reserves for each worker "
                   "(with --device cuda)")


def make_ray_llm(args: argparse.Namespace, spec: SpecConfig) -> RayLLM:
    """The cluster counterpart of make_llm: same `stream` and `stats`, no models loaded here.
    Ray is imported only now, so commands without --ray never load it."""
    from ..ray import RayLLM

    return RayLLM(model_config(args), spec, workers=args.ray_workers, address=args.ray_address,
                  rows_per_call=args.ray_batch_rows, num_cpus=args.ray_cpus_per_worker,
                  num_gpus=args.ray_gpus_per_worker)
