"""`batchspec bench-serve`: benchmark a running server with the official openai client (streaming)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import asdict
from pathlib import Path

from ..bench.specbench import SPECBENCH_FILE, BenchPrompt, select, task_group
from ..errors import BatchspecError
from ..prompts import load_prompts
from .common import add_prompt_format_argument, finite_float, positive_int

WORKLOADS = ("prompts", "shared-prefix", "multi-turn")
FOLLOW_UP = "Now shorten your answer to its three most important sentences."


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the server's OpenAI API root")
    p.add_argument("--api-key", help="bearer token, if the server was started with --api-key")
    p.add_argument("--model", help="model name to request (default: the first the server lists)")
    p.add_argument("--endpoint", choices=("chat", "completions"), default="chat",
                   help="chat: each prompt is one user message (chat template applied by the server); "
                   "completions: raw prompt text")
    p.add_argument("--prompts", help="JSONL or text prompts (default: SpecBench's 480, a stratified subset)")
    add_prompt_format_argument(p)
    p.add_argument("--num-prompts", type=positive_int, default=24,
                   help="how many prompts, spread evenly over the task groups")
    p.add_argument("--max-tokens", type=positive_int, default=64, help="max_tokens of every request")
    p.add_argument("--temperature", type=finite_float, default=0.0, help="0 = greedy")
    p.add_argument("--seed", type=int, help="seeded sampling: request i gets seed + i")
    p.add_argument("--concurrency", type=positive_int, default=4, help="requests in flight at most")
    p.add_argument("--request-rate", type=finite_float,
                   help="Poisson arrivals per second (default: every request at once, within --concurrency)")
    p.add_argument("--workload", choices=WORKLOADS, default="prompts",
                   help="prompts: each prompt alone; shared-prefix: every request starts with one system prompt of "
                   "--system-words words (from the prompts themselves); multi-turn: after each answer, a second turn "
                   "(--follow-up) resends the conversation; compare a server's prefix cache (--prefix-cache-gb) on "
                   "and off")
    p.add_argument("--system-words", type=positive_int, default=750,
                   help="shared-prefix: words of the shared system prompt (750: about 1,000 tokens)")
    p.add_argument("--follow-up", default=FOLLOW_UP, help="multi-turn: the second user turn")
    p.add_argument("--json", help="also write the figures (and these settings) to this JSON file")


def shared_system_prompt(texts: list[str], words: int) -> str:
    """A system prompt of `words` words: an instruction, then the prompts' own text as reference
    material (cycled if they are shorter), so its tokens are ordinary text for the model."""
    pool = " ".join(texts).split() or ["text"]
    body = [pool[i % len(pool)] for i in range(words)]
    return "Answer using the reference material below where it helps.\n\n" + " ".join(body)


def run(args: argparse.Namespace) -> int:
    from ..serve.bench import BenchSettings, format_report, run_bench

    if args.json and not Path(args.json).resolve().parent.is_dir():
        raise BatchspecError(f"--json {args.json}: its folder does not exist")
    if args.request_rate is not None and args.request_rate <= 0:
        raise BatchspecError(f"--request-rate must be > 0, got {args.request_rate}")
    records = [r for r in load_prompts(args.prompts or SPECBENCH_FILE, args.format) if r.error is None]
    if not records:
        raise BatchspecError(f"no readable prompt in {args.prompts}")
    pool = [BenchPrompt(r.id, r.text, r.category, task_group(r.category), ()) for r in records]
    prompts = [p.text for p in select(pool, num_prompts=args.num_prompts)]
    system = shared_system_prompt([r.text for r in records], args.system_words) \
        if args.workload == "shared-prefix" else None
    follow_up = args.follow_up if args.workload == "multi-turn" else None
    settings = BenchSettings(args.base_url, args.api_key, args.model, args.endpoint, args.max_tokens,
                             args.temperature, args.seed, args.concurrency, args.request_rate, system, follow_up)
    report = asyncio.run(run_bench(settings, prompts))
    print(format_report(report))
    if args.json:
        Path(args.json).write_text(json.dumps({**report, "settings": asdict(settings)}, indent=2) + "\n")
    if not report["completed"]:
        print(f"batchspec bench-serve: every request failed (first error: {report['first_error']})", file=sys.stderr)
        return 1
    return 0
