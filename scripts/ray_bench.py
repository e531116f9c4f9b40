"""Throughput of `batchspec.ray` with 1 and 2 actors, and what Ray costs per row, against one process.

    python scripts/ray_bench.py --tiny                        # the test suite's tiny pair (a minute)
    python scripts/ray_bench.py --rows 16 --max-new-tokens 32 --cpus-per-actor 1
                                                              # the bundled pair: ~9 GB RAM per actor

Runs, on the same prompts and engine settings: one process (`LLM.generate`, models already loaded),
then Ray with 1 actor on a quarter of the rows and on all of them, then Ray with 2 actors on all of
them. Ray's wall time includes starting the actors and loading their models; each batch's engine
time comes back through the stats sink, so the time outside the engine is what Ray (and actor
start-up) cost. Comparing the two 1-actor runs splits that into a fixed part and a part per row.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import ray
import ray.data
import torch

from batchspec.config import ModelConfig, SamplingParams, SpecConfig
from batchspec.llm import LLM
from batchspec.prompts import load_prompts
from batchspec.ray import StatsSink, generate_dataset

ROOT = Path(__file__).resolve().parents[1]


def prompts(args: argparse.Namespace) -> list[str]:
    if args.tiny:
        sys.path.insert(0, str(ROOT / "tests"))
        from tinyworld import WORDS

        rng = random.Random(0)
        return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 16))) for _ in range(args.rows)]
    texts = [r.text for r in load_prompts(args.prompts) if r.error is None]
    return [texts[i % len(texts)] for i in range(args.rows)]


def model_settings(args: argparse.Namespace, scratch: Path) -> dict:
    if args.tiny:
        sys.path.insert(0, str(ROOT / "tests"))
        from tinyworld import save_pair

        target, draft = save_pair(scratch)
        return {"target": str(target), "draft": str(draft)}
    return {"target": args.target, "draft": args.draft, "draft_dtype": args.draft_dtype}


def on_ray(texts: list[str], model: dict, spec: dict, sampling: dict, actors: int, args) -> dict:
    sink = StatsSink.remote()
    rows = [{"id": str(i), "prompt": t} for i, t in enumerate(texts)]
    ds = ray.data.from_items(rows, override_num_blocks=max(1, len(rows) // args.rows_per_call))
    start = time.perf_counter()
    out = generate_dataset(ds, model=model, spec=spec, sampling=sampling, concurrency=actors,
                           batch_size=args.rows_per_call, num_cpus=args.cpus_per_actor, stats_sink=sink).take_all()
    wall = time.perf_counter() - start
    engine = ray.get(sink.total.remote())
    ray.kill(sink)
    assert len(out) == len(rows) and not any(r["error"] for r in out)
    engine_s = engine["prefill_time"] + engine["draft_time"] + engine["verify_time"] + engine["other_time"]
    return {"rows": len(rows), "tokens": sum(len(r["token_ids"]) for r in out), "wall_s": wall,
            "engine_s": engine_s, "outside_engine_s": wall - engine_s / actors}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="the tests' tiny Llama pair instead of --target/--draft")
    p.add_argument("--target", help="HF folder or .gguf (default: the bundled pair)")
    p.add_argument("--draft")
    p.add_argument("--draft-dtype", help="e.g. bfloat16")
    p.add_argument("--prompts", default=str(ROOT / "examples" / "prompts.jsonl"))
    p.add_argument("--rows", type=int, default=48)
    p.add_argument("--rows-per-call", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=4, help="rows decoded together inside each engine")
    p.add_argument("--cpus-per-actor", type=float, default=1, help="the one-process run uses as many threads")
    p.add_argument("--address", help="an existing cluster (default: start a local one)")
    p.add_argument("--json", help="also write the figures here")
    args = p.parse_args()

    spec = {"method": "ragged", "num_draft_tokens": 3 if args.tiny else 5, "batch_size": args.batch_size}
    sampling = {"max_new_tokens": args.max_new_tokens}
    with tempfile.TemporaryDirectory() as scratch:
        model = model_settings(args, Path(scratch))
        texts = prompts(args)

        torch.set_num_threads(max(1, int(args.cpus_per_actor)))
        start = time.perf_counter()
        llm = LLM(ModelConfig(**model), spec=SpecConfig(**spec))
        load_s = time.perf_counter() - start
        start = time.perf_counter()
        local = llm.generate(texts, SamplingParams(**sampling))
        local_s = time.perf_counter() - start
        tokens = sum(len(o.token_ids) for o in local)
        local_engine_s = llm.stats.total_time
        del llm

        ray.init(address=args.address, num_cpus=None if args.address else 2, include_dashboard=False,
                 logging_level="WARNING", log_to_driver=False)
        ray.data.DataContext.get_current().enable_progress_bars = False
        quarter = on_ray(texts[: len(texts) // 4], model, spec, sampling, 1, args)
        one = on_ray(texts, model, spec, sampling, 1, args)
        two = on_ray(texts, model, spec, sampling, 2, args)
        ray.shutdown()

    per_row = (one["outside_engine_s"] - quarter["outside_engine_s"]) / (one["rows"] - quarter["rows"])
    figures = {
        "rows": len(texts), "max_new_tokens": args.max_new_tokens, "rows_per_call": args.rows_per_call,
        "one_process": {"load_s": load_s, "wall_s": local_s, "engine_s": local_engine_s, "tokens": tokens},
        "ray_1_actor_quarter": quarter, "ray_1_actor": one, "ray_2_actors": two,
        "ray_overhead_per_row_s": per_row,
        "ray_fixed_overhead_s": quarter["outside_engine_s"] - per_row * quarter["rows"],
    }
    print(f"{'run':<22}{'wall s':>9}{'rows/s':>9}{'tok/s':>9}{'engine s':>10}{'outside s':>11}")
    print(f"{'one process':<22}{local_s:>9.2f}{len(texts) / local_s:>9.2f}{tokens / local_s:>9.1f}{local_engine_s:>10.2f}"
          f"{local_s - local_engine_s:>11.2f}  (+{load_s:.2f} s model load)")
    for name, run in (("ray 1 actor (1/4)", quarter), ("ray 1 actor", one), ("ray 2 actors", two)):
        print(f"{name:<22}{run['wall_s']:>9.2f}{run['rows'] / run['wall_s']:>9.2f}{run['tokens'] / run['wall_s']:>9.1f}"
              f"{run['engine_s']:>10.2f}{run['outside_engine_s']:>11.2f}")
    print(f"Ray per row: {per_row * 1000:.1f} ms; fixed (actor start, imports, model load): "
          f"{figures['ray_fixed_overhead_s']:.2f} s")
    print(f"2 actors vs 1: {one['wall_s'] / two['wall_s']:.2f}x wall, "
          f"{(two['rows'] / two['engine_s']) / (one['rows'] / one['engine_s']):.2f}x rows per engine-second per actor")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
