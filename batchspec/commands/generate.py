"""`batchspec generate`: decode a prompts file, write one JSON line per prompt, print a summary."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from tqdm import tqdm

from ..config import BatchspecError
from ..llm import RequestOutput
from ..prompts import load_prompts
from ..reference import reference_decode
from .common import (
    add_decoding_arguments,
    add_model_arguments,
    add_ray_arguments,
    add_sampling_arguments,
    load_models,
    make_llm,
    make_ray_llm,
    params_for,
    spec_from_args,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompts", required=True, help="JSONL (`prompt` or SpecBench `turns`) or text, one per line")
    p.add_argument("--output", "-o", help="write outputs as JSONL here (default: stdout summary only)")
    p.add_argument("--limit", type=int, help="only the first N prompts")
    p.add_argument("--verify", action="store_true", help="also decode each prompt alone, plainly, and count exact matches")
    add_model_arguments(p)
    add_decoding_arguments(p)
    add_sampling_arguments(p)
    add_ray_arguments(p)


def summarize(outputs: list[RequestOutput], wall: float) -> dict:
    """Throughput and acceptance over the successful requests."""
    ok = [o for o in outputs if o.error is None]
    generated = sum(len(o.token_ids) for o in ok)
    rounds = sum(o.rounds for o in ok)
    drafted = sum(o.drafted for o in ok)
    accepted = sum(o.accepted for o in ok)
    return {
        "prompts": len(outputs),
        "errors": len(outputs) - len(ok),
        "generated_tokens": generated,
        "wall_seconds": round(wall, 3),
        "tokens_per_second": round(generated / wall, 3) if wall > 0 else None,
        # tokens each row gains per verification round (the first token comes from prefill)
        "mean_accepted_length": round((generated - len(ok)) / rounds, 3) if rounds else None,
        "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
    }


def run(args: argparse.Namespace) -> int:
    records = load_prompts(args.prompts)[: args.limit]
    if args.verify and args.temperature > 0 and args.seed is None:
        raise BatchspecError("--verify with --temperature > 0 needs --seed: unseeded sampling has no single "
                             "right answer (use `batchspec verify-distribution` for its distribution)")
    spec = spec_from_args(args)
    params = params_for(args, len(records))  # validated before the (slow) model loading
    if args.ray:
        if args.verify:
            raise BatchspecError("--verify decodes every prompt again on this machine; with --ray, run "
                                 "`batchspec audit` on the output instead")
        llm = make_ray_llm(args, spec)
    else:
        models = load_models(args, need_draft=spec.speculative)
        llm = make_llm(args, models, spec)
    readable = [i for i, r in enumerate(records) if r.error is None]
    outputs: dict[int, RequestOutput] = {
        i: RequestOutput(i, r.text, [], error=r.error) for i, r in enumerate(records) if r.error is not None
    }
    start = time.perf_counter()
    with tqdm(total=len(readable), desc=f"{spec.method} b{spec.batch_size}", unit="prompt", file=sys.stderr) as bar:
        for out in llm.stream([records[i].text for i in readable], [params[i] for i in readable]):
            out.index = readable[out.index]
            outputs[out.index] = out
            bar.update(1)
    wall = time.perf_counter() - start
    ordered = [outputs[i] for i in range(len(records))]
    summary = summarize(ordered, wall)
    stats = llm.stats
    summary["time_seconds"] = {  # where the time went: model forwards vs everything else
        "prefill": round(stats.prefill_time, 3),
        "draft_forwards": round(stats.draft_time, 3),
        "target_forwards": round(stats.verify_time, 3),
        "other": round(stats.other_time, 3),
    }
    summary["decode_tokens_per_second"] = (
        round(stats.generated / stats.decode_time, 3) if stats.decode_time > 0 else None
    )
    if args.verify:
        summary["exact_match"] = _verify(llm, ordered, params)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        with open(args.output, "w", encoding="utf-8") as f:
            for rec, out in zip(records, ordered):
                row = {"id": rec.id, **out.to_json()}
                row.pop("index")
                f.write(json.dumps(row) + "\n")
    print(json.dumps(summary, indent=2))
    return 0


def _verify(llm, outputs: list[RequestOutput], params) -> str:
    """Exact matches against plain decoding of each prompt alone."""
    ok = [o for o in outputs if o.error is None]
    matches = 0
    for o in tqdm(ok, desc="oracle", unit="prompt", file=sys.stderr):
        expected = reference_decode(llm.models.target, o.prompt_token_ids, params[o.index], llm.stop_ids)
        matches += expected == o.token_ids
    return f"{matches}/{len(ok)}"
