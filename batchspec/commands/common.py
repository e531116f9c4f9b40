"""Arguments and builders shared by the commands, so every command spells options the same way."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from ..config import ModelConfig, SamplingParams, SpecConfig
from ..llm import LLM
from ..methods import METHODS, SCHEDULERS, method_help
from ..models import ModelPair, load_pair

if TYPE_CHECKING:
    from ..ray import RayLLM


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("models")
    g.add_argument("--target", help="HF model folder or .gguf file (default: bundled Qwen2.5-Coder-1.5B-Instruct)")
    g.add_argument("--draft", help="HF model folder or .gguf file (default: bundled Qwen2.5-Coder-0.5B-Instruct)")
    g.add_argument("--dtype", default="float32", help="target dtype: float32 | bfloat16 | float16")
    g.add_argument("--draft-dtype", help="drafter dtype (default: --dtype); changes acceptance, never the output")
    g.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    g.add_argument("--no-chat-template", action="store_true", help="feed prompts raw, without the chat template")


def add_decoding_arguments(p: argparse.ArgumentParser, method_default: str = "ragged") -> None:
    g = p.add_argument_group("decoding")
    g.add_argument("--method", default=method_default, choices=list(METHODS), help=method_help())
    g.add_argument("--batch-size", "--max-num-seqs", dest="batch_size", type=int, default=4,
                   help="rows decoded together (with --scheduler continuous: the most sequences in flight)")
    g.add_argument("--num-draft-tokens", "-k", type=int, default=5)
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
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
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
                       chat_template=not args.no_chat_template)


def load_models(args: argparse.Namespace, need_draft: bool) -> ModelPair:
    return load_pair(model_config(args), need_draft=need_draft)


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
