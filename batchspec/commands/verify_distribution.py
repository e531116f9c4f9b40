"""`batchspec verify-distribution`: is speculative rejection sampling distributed like plain sampling?

Runs two checks and fails (exit 1) if either does:
1. exact: enumerate one speculative round on tiny random vocabularies and compare with the target's
   distribution (no models needed, well under a second);
2. statistical: for each prompt, sample the next M tokens many times plainly (method `ar`) and
   speculatively (the chosen method, through the real Engine), and run a two-sample chi-square test
   per position. The verdict is Bonferroni-corrected over all tests: reject if the smallest p-value
   is below alpha / number of tests.
Requests carry no seed, so every row uses the rejection rule; --generator-seed seeds the engines'
generators, so a run is repeatable.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from tqdm import tqdm

from ..config import BatchspecError, SamplingParams, SpecConfig, resolve_drafter
from ..distribution import compare_positions, exact_rejection_check
from ..engine import Engine
from ..build import build_engine
from ..prompts import load_prompts
from .common import (
    add_decoding_arguments,
    add_model_arguments,
    add_prompt_format_argument,
    finite_float,
    load_models,
    make_llm,
    model_config,
    positive_int,
    add_sampling_arguments,
    config_from_args,
)

DEFAULT_PROMPTS = (
    "Write a haiku about caches.",
    "The capital of France is",
    "def fibonacci(n):",
)
# (vocab, k, params) of the exact check: small enough to enumerate, covering the bonus slot and the
# filters (top-k/top-p zeros make supports differ between target and drafter).
EXACT_CASES = (
    (3, 1, SamplingParams(temperature=1.0)),
    (4, 2, SamplingParams(temperature=0.7, top_k=3)),
    (4, 3, SamplingParams(temperature=1.3, top_p=0.8)),
    (5, 2, SamplingParams(temperature=1.0, top_k=4, top_p=0.9)),
)
EXACT_TOLERANCE = 1e-9


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompts", help="prompts file (JSONL or text); default: three built-in prompts")
    add_prompt_format_argument(p)
    p.add_argument("--limit", type=positive_int, default=3, help="only the first N prompts")
    p.add_argument("--samples", type=int, default=1000, help="continuations drawn per prompt and method (>= 1)")
    p.add_argument("--positions", type=int, default=4, help="M: generated positions compared per prompt (>= 3)")
    p.add_argument("--alpha", type=finite_float, default=0.01, help="family-wise significance level, in (0, 1)")
    p.add_argument("--min-expected", type=finite_float, default=5.0,
                   help="merge tokens expected fewer times than this (> 0) into an 'other' bin")
    p.add_argument("--report", help="write the full results as JSON here")
    add_model_arguments(p)
    add_decoding_arguments(p, generator_seed=0)
    # requests stay unseeded (rejection sampling is what is tested): no --seed, no --max-new-tokens
    add_sampling_arguments(p, only=("temperature", "top_p", "top_k"), temperature=1.0)


def _exact_results() -> list[dict]:
    return [
        {"vocab": vocab, "k": k, "temperature": sp.temperature, "top_k": sp.top_k, "top_p": sp.top_p,
         "max_abs_diff": exact_rejection_check(vocab, k, sp, seed=i)}
        for i, (vocab, k, sp) in enumerate(EXACT_CASES)
    ]


def _sample(engine: Engine, prompt_ids: list[int], params: SamplingParams, count: int, desc: str) -> list[list[int]]:
    """`count` continuations of one prompt, decoded in batches by the engine."""
    samples = []
    with tqdm(total=count, desc=desc, unit="sample", file=sys.stderr) as bar:
        for seq in engine.stream([prompt_ids] * count, params):
            samples.append(seq.generated)
            bar.update(1)
    return samples


def run(args: argparse.Namespace) -> int:
    if args.method == "ar":
        raise BatchspecError("verify-distribution compares a speculative method with plain sampling: choose --method")
    if args.samples < 1:
        raise BatchspecError("--samples must be >= 1")
    if args.positions < 3:
        # position 0 comes from the prefill and a round drafts at most (budget left - 1) tokens, so
        # speculation only enters from the third position on
        raise BatchspecError("--positions must be >= 3: the first two positions never involve drafts")
    if not 0 < args.alpha < 1:
        raise BatchspecError(f"--alpha must be in (0, 1), got {args.alpha}")
    if args.min_expected <= 0:
        raise BatchspecError(f"--min-expected must be > 0, got {args.min_expected}")
    params = config_from_args(SamplingParams, args, max_new_tokens=args.positions)
    if params.greedy:
        raise BatchspecError("--temperature 0 is greedy: use `batchspec generate --verify` for exact matches")
    exact = _exact_results()
    spec = resolve_drafter(model_config(args), config_from_args(SpecConfig, args))
    plain_spec = config_from_args(SpecConfig, args, method="ar", scheduler="static")
    seed = args.generator_seed
    if args.prompts:
        texts = [r.text for r in load_prompts(args.prompts, args.format) if r.error is None]
    else:
        texts = list(DEFAULT_PROMPTS)
    texts = texts[: args.limit]
    if not texts:
        raise BatchspecError("no usable prompts")
    models = load_models(args, need_draft=spec.needs_draft_model)
    llm = make_llm(args, models, spec)
    rows, drafted, accepted = [], 0, 0
    for n, text in enumerate(texts):
        ids = llm.encode(text)
        plain = build_engine(models.target, replace(plain_spec, generator_seed=seed + 2 * n), llm.stop_ids)
        speculative = build_engine(models.target, replace(spec, generator_seed=seed + 2 * n + 1), llm.stop_ids,
                                   draft_model=models.draft)
        plain_samples = _sample(plain, ids, params, args.samples, f"prompt {n} plain")
        spec_samples = _sample(speculative, ids, params, args.samples, f"prompt {n} {spec.method}")
        drafted += speculative.stats.drafted
        accepted += speculative.stats.accepted
        for t, test in enumerate(compare_positions(plain_samples, spec_samples, args.positions, args.min_expected)):
            rows.append({"prompt": n, "position": t, **test.to_json()})
    tests = [r for r in rows if r["dof"] > 0]
    worst = min(tests, key=lambda r: r["p_value"], default=None)
    threshold = args.alpha / max(1, len(tests))
    exact_ok = all(e["max_abs_diff"] <= EXACT_TOLERANCE for e in exact)
    chi2_ok = worst is None or worst["p_value"] >= threshold
    report = {
        "config": {
            "method": spec.method, "num_draft_tokens": spec.num_draft_tokens, "batch_size": spec.batch_size,
            "speculation": spec.speculation, "drafter": spec.drafter,
            "samples": args.samples, "positions": args.positions, "temperature": args.temperature,
            "top_p": args.top_p, "top_k": args.top_k, "generator_seed": seed, "alpha": args.alpha,
            "prompts": texts,
        },
        "exact": {"cases": exact, "tolerance": EXACT_TOLERANCE, "passed": exact_ok},
        "chi_square": {
            "tests": rows, "worst": worst, "bonferroni_threshold": threshold, "passed": chi2_ok,
            "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
        },
        "passed": exact_ok and chi2_ok,
    }
    _print_table(report)
    if args.report:
        Path(args.report).parent.mkdir(parents=True, exist_ok=True)
        Path(args.report).write_text(json.dumps(report, indent=2), encoding="utf-8")
    return 0 if report["passed"] else 1


def _print_table(report: dict) -> None:
    exact = report["exact"]
    worst_exact = max(e["max_abs_diff"] for e in exact["cases"])
    print(f"exact check: max |P_spec - P_target| = {worst_exact:.2e} over {len(exact['cases'])} cases "
          f"({'ok' if exact['passed'] else 'FAILED'})")
    print(f"{'prompt':>6} {'pos':>4} {'bins':>5} {'chi2':>10} {'dof':>4} {'p-value':>9}")
    for r in report["chi_square"]["tests"]:
        print(f"{r['prompt']:>6} {r['position']:>4} {r['bins']:>5} {r['chi2']:>10.3f} {r['dof']:>4} {r['p_value']:>9.4f}")
    chi = report["chi_square"]
    worst = chi["worst"]
    where = f"prompt {worst['prompt']} position {worst['position']}, p = {worst['p_value']:.4g}" if worst else "nothing testable"
    print(f"worst: {where}; reject below {chi['bonferroni_threshold']:.3g} "
          f"({'ok' if chi['passed'] else 'REJECTED'}); acceptance rate {chi['acceptance_rate']}")
