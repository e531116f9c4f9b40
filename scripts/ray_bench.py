"""Throughput of `batchspec.ray` with 1 and 2 actors, and what Ray costs per row, against one process.

    python scripts/ray_bench.py --tiny                        # the test suite's tiny pair (a minute)
    python scripts/ray_bench.py --rows 16 --max-new-tokens 32 --cpus-per-actor 1
                                                              # the bundled pair: ~9 GB RAM per actor

Runs, on the same prompts and engine settings: one process (`LLM.generate`, models already loaded),
then Ray with 1 actor and with 2 actors. Ray's wall time includes starting the actors (process,
imports, model loading); each call's span in the actor and its engine time come back through the
stats sink, so the bench splits Ray's wall time into start-up, engine, and the rest: the overhead
per row that Ray (and the row/Arrow adapter) add once the actors run.
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


def on_ray(texts: list[str], model: dict, spec: dict, sampling: dict, actors: int, args,
           expected: list[list[int]]) -> dict:
    """One Ray Data run; the time around each actor call and inside its engine comes from the sink."""
    sink = StatsSink.remote()
    rows = [{"id": str(i), "prompt": t} for i, t in enumerate(texts)]
    ds = ray.data.from_items(rows, override_num_blocks=max(1, len(rows) // args.rows_per_call))
    start = time.time()
    out = generate_dataset(ds, model=model, spec=spec, sampling=sampling, concurrency=actors,
                           batch_size=args.rows_per_call, num_cpus=args.cpus_per_actor, stats_sink=sink).take_all()
    end = time.time()
    engine, spans = ray.get([sink.total.remote(), sink.batch_spans.remote()])
    ray.kill(sink)
    assert len(out) == len(rows) and not any(r["error"] for r in out)
    by_id = {r["id"]: list(r["token_ids"]) for r in out}
    identical = sum(by_id[str(i)] == ids for i, ids in enumerate(expected))
    in_calls = sum(b - a for a, b in spans)
    return {
        "actors": actors, "rows": len(rows), "identical_to_one_process": identical,
        "tokens": sum(len(r["token_ids"]) for r in out), "wall_s": end - start,
        "engine_s": sum(engine[k] for k in ("prefill_time", "draft_time", "verify_time", "other_time")),
        "startup_s": spans[0][0] - start,  # actor processes, imports, model loading, first dispatch
        "in_calls_s": in_calls,
        "between_calls_s": spans[-1][1] - spans[0][0] - in_calls,  # idle gaps (meaningful with 1 actor)
        "tail_s": end - spans[-1][1],  # last results to the driver
    }


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

        ray.init(address=args.address or "local", num_cpus=None if args.address else 2, include_dashboard=False,
                 logging_level="WARNING", log_to_driver=False)
        ray.data.DataContext.get_current().enable_progress_bars = False
        expected = [list(o.token_ids) for o in local]
        one = on_ray(texts, model, spec, sampling, 1, args, expected)
        two = on_ray(texts, model, spec, sampling, 2, args, expected)
        ray.shutdown()

    n = len(texts)
    figures = {
        "rows": n, "max_new_tokens": args.max_new_tokens, "rows_per_call": args.rows_per_call,
        "one_process": {"load_s": load_s, "wall_s": local_s, "engine_s": local_engine_s, "tokens": tokens},
        "ray_1_actor": one, "ray_2_actors": two,
        # with one actor everything but start-up and engine time is what Ray and the adapter add
        "ray_overhead_per_row_s": (one["wall_s"] - one["startup_s"] - one["engine_s"]) / n,
    }
    print(f"{'run':<16}{'wall s':>8}{'rows/s':>8}{'tok/s':>8}{'start-up s':>11}{'engine s':>10}{'identical':>11}")
    print(f"{'one process':<16}{local_s:>8.2f}{n / local_s:>8.2f}{tokens / local_s:>8.1f}{load_s:>11.2f}"
          f"{local_engine_s:>10.2f}   (start-up: model load, not in wall)")
    for name, run in (("ray 1 actor", one), ("ray 2 actors", two)):
        print(f"{name:<16}{run['wall_s']:>8.2f}{n / run['wall_s']:>8.2f}{run['tokens'] / run['wall_s']:>8.1f}"
              f"{run['startup_s']:>11.2f}{run['engine_s']:>10.2f}{run['identical_to_one_process']:>7}/{n}")
    steady = [r["wall_s"] - r["startup_s"] for r in (one, two)]
    print(f"Ray overhead per row (1 actor, after start-up): {figures['ray_overhead_per_row_s'] * 1000:.1f} ms = "
          f"{(one['in_calls_s'] - one['engine_s']) / n * 1000:.1f} ms in calls outside the engine + "
          f"{one['between_calls_s'] / n * 1000:.1f} ms between calls + {one['tail_s'] / n * 1000:.1f} ms tail")
    print(f"2 actors vs 1: {one['wall_s'] / two['wall_s']:.2f}x wall, {steady[0] / steady[1]:.2f}x after start-up; "
          f"engine seconds {one['engine_s']:.2f} -> {two['engine_s']:.2f} (contention for the cores)")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
