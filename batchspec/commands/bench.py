"""`batchspec bench`: methods side by side on the same prompts and models, in one process.

Prints speed (end-to-end and decode-only tokens/s, prefill and decode time, where the time went),
speculation (accepted length, acceptance rate), latency percentiles and exactness against plain
greedy decoding, per method and per task group; optionally JSON, CSV and PNG plots.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from dataclasses import replace
from pathlib import Path

from ..bench.exactness import AuditClassifier
from ..bench.methods import (
    DEFAULT_METHODS,
    SYNTAX_HELP,
    MethodSpec,
    parse_batch_sizes,
    parse_methods,
    parse_prefill_chunks,
)
from ..bench.paired import paired_speedups, render_paired
from ..bench.plots import write_plots
from ..bench.report import NOISE_NOTE, build_report, machine_info, render_costs, render_tables, write_csv
from ..bench.runner import ALL, MethodResult, fastest_of, run_method, warm_up
from ..bench.specbench import SPECBENCH_FILE, BenchPrompt, encode_prompts, group_order, select
from ..config import NGRAM, QUANTIZATIONS, BatchspecError, SamplingParams, SpecConfig
from ..costs import measured_costs
from ..forensics.oracle import Oracle
from ..kernels import linear_kernel, main_kernel
from ..kv import context_limit
from ..memory import peak_rss_bytes, reset_peak_rss
from ..methods import METHODS
from ..models import ModelPair, draft_dtype, eos_token_ids, weights_report
from ..trace import StepTrace
from .common import (
    add_config_arguments,
    add_model_arguments,
    add_prompt_format_argument,
    add_sampling_arguments,
    check_writable,
    config_from_args,
    load_models,
    model_config,
    params_for,
    prompt_encoder,
)

DEFAULT_NUM_PROMPTS = 12  # two per SpecBench task group: a quick look, not the protocol
SHARED_SPEC_FIELDS = ("num_draft_tokens", "window_size", "sort_by_length", "max_kv_slots", "ngram_min", "ngram_max")


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("prompts")
    g.add_argument("--prompts", help=f"JSONL (`prompt` or SpecBench `turns`, optional `category`) or text file "
                   f"(default: SpecBench, {DEFAULT_NUM_PROMPTS} prompts spread over its 6 task groups)")
    add_prompt_format_argument(g)
    g.add_argument("--suite", choices=["specbench"], help="SpecBench protocol: all 480 prompts (or the stratified "
                   "subset chosen by --num-prompts/--per-category), each task group measured as its own run")
    g.add_argument("--num-prompts", type=int, help="this many prompts, spread evenly across task groups")
    g.add_argument("--per-category", type=int, help="this many prompts from every task group")
    g.add_argument("--max-prompt-tokens", type=int, help="skip prompts longer than this many tokens (before selecting)")
    g = p.add_argument_group("methods")
    g.add_argument("--methods", default=DEFAULT_METHODS, help=SYNTAX_HELP)
    g.add_argument("--batch-sizes", default="4", help="comma-separated batch sizes for methods given without @batch")
    g.add_argument("--repeats", type=int, default=1, help="run every method this many times, task group by task group "
                   "with every method in turn, in alternating order (forward, backward, ...), and report each "
                   "method's fastest run per task group: noise on a shared machine only adds time (default 1)")
    g.add_argument("--prefill-chunks", help="comma-separated max prefill tokens per step for methods on "
                   "the continuous scheduler, each run once per value (0 = whole prompts); e.g. 0,64 compares "
                   "chunked prefill with none in one run (default: the engine's default budget only)")
    # what every method shares; method, batch size and scheduler come from --methods
    add_config_arguments(p, SpecConfig, "speculation (all methods)", only=SHARED_SPEC_FIELDS)
    add_sampling_arguments(p)
    g = p.add_argument_group("cost model (adaptive speculation)")
    g.add_argument("--costs", action="store_true", help="print the measured cost model (forward times by rows and "
                   "tokens, and the acceptance each K needs to beat plain decoding), measuring it first if needed")
    g.add_argument("--recalibrate", action="store_true", help="measure the cost model anew instead of using the "
                   "cached one (run on a quiet machine: adaptive speculation decides on it)")
    g = p.add_argument_group("output")
    g.add_argument("--json", help="write every figure and the machine description here")
    g.add_argument("--trace", help="write one JSON line per piece of every engine step here (prefill chunks, drafter "
                   "catch-ups, rounds, with wall times; records name method, part and repeat; docs/cli.md)")
    g.add_argument("--csv", help="write one line per method (and per method and task group) here")
    g.add_argument("--plots", help="write PNG plots into this folder")
    add_model_arguments(p)
    quantization = next(a for a in p._actions if "--quantization" in a.option_strings)
    quantization.type, quantization.choices = _quantizations, None
    quantization.help += ("; comma-separated (e.g. none,int8,int4): the whole bench once per target quantization "
                          "in one run, each against plain decoding of its own target (--json/--csv/--plots get "
                          "the quantization appended to their names)")


def _quantizations(text: str) -> list[str]:
    """--quantization in the bench: one or more of QUANTIZATIONS, comma-separated."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    wrong = [name for name in names if name not in QUANTIZATIONS]
    if not names or wrong:
        raise argparse.ArgumentTypeError(f"choose from {', '.join(QUANTIZATIONS)}, comma-separated, got {text!r}")
    return list(dict.fromkeys(names))


def _suffixed(path: str | None, quantization: str) -> str | None:
    """report.json -> report.int4.json, plots -> plots.int4: one set of outputs per swept quantization."""
    if path is None:
        return None
    p = Path(path)
    return str(p.with_name(f"{p.stem}.{quantization}{p.suffix}"))


def _choose_prompts(args: argparse.Namespace, models: ModelPair) -> tuple[list[BenchPrompt], dict]:
    if args.suite and args.prompts:
        raise BatchspecError("--suite specbench uses SpecBench's own file; drop --prompts")
    path = Path(args.prompts) if args.prompts else SPECBENCH_FILE
    count = args.num_prompts
    if count is None and args.per_category is None and not args.suite and not args.prompts:
        count = DEFAULT_NUM_PROMPTS
    # prompts that could not be decoded to the full budget within the context are skipped for
    # every method alike, so all methods always see the same prompts
    limits = [context_limit(m) for m in (models.target, models.draft) if m is not None]
    limits = [x - args.max_new_tokens for x in limits if x is not None]
    if args.max_prompt_tokens is not None:
        limits.append(args.max_prompt_tokens)
    candidates, skipped = encode_prompts(
        path, prompt_encoder(args, models), min(limits) if limits else None, fmt=args.format
    )
    chosen = select(candidates, count, args.per_category)
    if not chosen:
        raise BatchspecError(f"no usable prompts in {path} (skipped: {skipped or 'none'})")
    groups = {str(g): sum(1 for p in chosen if p.group == g) for g in group_order(chosen)}
    lengths = [len(p.token_ids) for p in chosen]
    info = {
        # as the user named it, or the bundled file by its place in the package (not this machine's path)
        "file": args.prompts or "batchspec/data/spec_bench/question.jsonl (bundled)",
        "count": len(chosen), "available": len(candidates), "skipped": skipped,
        "groups": groups if group_order(chosen) != [None] else None,
        "prompt_tokens": {"mean": round(sum(lengths) / len(lengths), 1), "max": max(lengths)},
        "chat_template": args.chat_template,
        "allow_special_tokens": args.allow_special_tokens,
    }
    return chosen, info


# What the printed peak RSS covers when it could not be reset for each format of a sweep.
RSS_SCOPE = "so far in this process"


def run(args: argparse.Namespace) -> int:
    """The bench once per target quantization asked for (models loaded one format at a time)."""
    formats = args.quantization if isinstance(args.quantization, list) else [args.quantization]
    if len(formats) == 1:
        return _run_one(argparse.Namespace(**{**vars(args), "quantization": formats[0]}))
    status = 0
    for quantization in formats:
        print(f"\n=== --quantization {quantization} ===", flush=True)
        outputs = {name: _suffixed(getattr(args, name), quantization) for name in ("json", "csv", "plots", "trace")}
        # each format's own peak, not the largest so far (float32 peaks at 3x an int4 pair)
        scope = f"since --quantization {quantization} began loading" if reset_peak_rss() else RSS_SCOPE
        # float linears have no prompt path: --prefill-kernel int8 applies to the quantized formats
        prefill = args.prefill_kernel if quantization != "none" else "weights"
        status = max(status, _run_one(argparse.Namespace(**{**vars(args), "quantization": quantization,
                                                             "prefill_kernel": prefill, "rss_scope": scope,
                                                             **outputs})))
    return status


def _run_one(args: argparse.Namespace) -> int:
    if args.repeats < 1:
        raise BatchspecError(f"--repeats must be >= 1, got {args.repeats}")
    specs = parse_methods(args.methods, parse_batch_sizes(args.batch_sizes), parse_prefill_chunks(args.prefill_chunks))
    if args.trace:
        check_writable(args.trace, "--trace")
    if args.temperature > 0 and args.seed is None:
        raise BatchspecError("bench checks every output against plain decoding: with --temperature > 0 give --seed "
                             "(for rejection-sampling acceptance, use `batchspec generate`)")
    # validated before the (slow) model loading
    speculative = any(s.speculative for s in specs)
    template = config_from_args(SpecConfig, args, method="ragged" if speculative else "ar")
    config_from_args(SamplingParams, args)
    if args.draft == NGRAM:  # no drafter model: every speculative method drafts by prompt lookup
        specs = [replace(s, drafter=NGRAM) if s.speculative and s.drafter == "model" else s for s in specs]
    models = load_models(args, need_draft=any(s.needs_draft_model for s in specs))
    prompts, prompt_info = _choose_prompts(args, models)
    prompts = [replace(p, params=sp) for p, sp in zip(prompts, params_for(args, len(prompts)))]
    stop_ids = eos_token_ids(models.target, models.tokenizer)
    by_group = bool(args.suite) and prompt_info["groups"] is not None
    parts = (
        {str(g): [i for i, p in enumerate(prompts) if p.group == g] for g in group_order(prompts)}
        if by_group else {ALL: list(range(len(prompts)))}
    )

    warm_up(models, prompts[0].token_ids)
    costs_text, calibration_s = None, 0.0
    if args.costs or args.recalibrate or any(s.speculation == "adaptive" for s in specs):
        # once, for the largest round any method runs, so no method pays for a calibration
        rows = max(s.batch_size for s in specs)
        most = max(s.num_draft_tokens or template.num_draft_tokens for s in specs)
        started = time.perf_counter()
        costs = measured_costs(models.target, models.draft, rows, most, fresh=args.recalibrate)
        calibration_s = time.perf_counter() - started  # in no run's time: reported apart
        costs_text = render_costs(costs, sorted({1, *(s.batch_size for s in specs)}), most)
        if args.costs:
            print(costs_text + "\n", flush=True)  # before the (long) runs: why adaptive methods choose their K
    oracle = Oracle(models.target, prompts[0].params, stop_ids)
    oracle.precompute([p.token_ids for p in prompts], [p.params for p in prompts], desc="oracle (plain decoding, batch 1)")
    classify = AuditClassifier(models, oracle, [p.token_ids for p in prompts], [p.params for p in prompts])
    runs: dict[MethodSpec, list[MethodResult]] = {s: [] for s in specs}
    # Part by part (a task group, or all prompts), every method in turn, in alternating order: the
    # machine's speed drifts over minutes, so the runs compared with each other are run close together
    # and no method always runs when the machine is slowest.
    with contextlib.ExitStack() as stack:
        trace = stack.enter_context(StepTrace(args.trace)) if args.trace else None
        for repeat in range(args.repeats):
            for label, indices in parts.items():
                for s in specs if repeat % 2 == 0 else specs[::-1]:
                    if trace is not None:
                        trace.context["repeat"] = repeat
                    runs[s].append(run_method(models, s, prompts, {label: indices}, template, stop_ids, oracle,
                                              classify, trace))
    results = [fastest_of(runs[s], parts) for s in specs]
    paired = paired_speedups(runs, list(parts), args.repeats) if args.repeats > 1 else []

    entries = build_report(results, prompts)
    machine = machine_info(args.dtype, draft_dtype(model_config(args)), args.device)
    title = (f"{len(prompts)} prompts, max_new_tokens {args.max_new_tokens}, K {args.num_draft_tokens}, "
             f"{args.dtype} target, {machine['draft_dtype']} drafter on {machine['device']}, "
             f"{main_kernel(models.target)} linears "
             f"({machine['cpu']}, {machine['torch_threads']} threads)")
    groups = ", ".join(f"{g} {n}" for g, n in (prompt_info["groups"] or {}).items())
    print(f"batchspec bench: {title}")
    repeats = f"; the fastest of {args.repeats} runs each, in alternating order" if args.repeats > 1 else ""
    print(f"prompts: {prompt_info['file']}{f' ({groups})' if groups else ''}; "
          f"mean {prompt_info['prompt_tokens']['mean']} tokens; "
          f"{'one run per task group' if by_group else 'all prompts in one run'}{repeats}")
    print(f"torch {machine['torch']}, transformers {machine['transformers']}")
    weights = weights_report(model_config(args), models)
    print(f"weights: {'; '.join(f'{role} {text}' for role, text in weights.items())}; peak RSS "
          f"{peak_rss_bytes() / 2**30:.2f} GiB {getattr(args, 'rss_scope', RSS_SCOPE)} (outputs are exact against "
          "plain decoding of this target)\n")
    print(render_tables(entries))
    if paired:
        print(f"\n{render_paired(paired)}")
    print(f"\n{NOISE_NOTE}")

    if args.json:
        report = {
            "machine": machine,
            "settings": {
                "target": args.target or "bundled", "draft": args.draft or "bundled",
                "linear_kernel": linear_kernel(models.target),
                "weights": weights, "peak_rss_bytes": peak_rss_bytes(),
                "max_new_tokens": args.max_new_tokens, "num_draft_tokens": args.num_draft_tokens,
                "speculation_default": {n: m.default_speculation for n, m in METHODS.items() if m.speculative},
                "methods": [s.name for s in specs], "suite": args.suite,
                "runs": "per task group" if by_group else "all prompts at once",
                "repeats": args.repeats,
                "timing": "fastest run per method and part" if args.repeats > 1 else "one run",
                **{name: getattr(template, name) for name in SHARED_SPEC_FIELDS},
                "seed": args.seed, "temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
                "hf_assisted": "constant schedule of num_draft_tokens drafts per round, no confidence cut-off",
            },
            "prompts": prompt_info,
            "costs": costs_text,
            "calibration_s": round(calibration_s, 3),
            "auditor": classify.describe(),
            "note": NOISE_NOTE,
            "methods": entries,
            "paired": paired,
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    if args.csv:
        write_csv(args.csv, entries)
    if args.plots:
        write_plots(args.plots, entries, f"batchspec bench: {title}")
    return 0
