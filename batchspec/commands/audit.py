"""`batchspec audit`: compare a run's outputs (ours or another program's) with plain greedy decoding.

Writes a JSON report (`--report`), prints a Markdown summary (also to `--markdown`), and exits 0
whenever the audit itself ran, whatever it found: the report is the verdict.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..config import BatchspecError, SamplingParams
from ..forensics.audit import Auditor
from ..forensics.audit_inputs import pair_items, read_outputs
from ..forensics.report import markdown_summary
from ..prompts import load_prompts
from .common import (
    add_model_arguments,
    add_sampling_arguments,
    config_from_args,
    add_prompt_format_argument,
    check_writable,
    finite_float,
    load_models,
    positive_int,
    prompt_encoder,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompts", required=True, help="the prompts file the run decoded (JSONL or text, as for generate)")
    add_prompt_format_argument(p)
    p.add_argument("--outputs", required=True, help="JSONL with `id` and `token_ids` or `text` (any program's)")
    p.add_argument("--report", required=True, help="write the JSON report here")
    p.add_argument("--markdown", help="also write the Markdown summary here")
    p.add_argument("--oracle-cache", help="JSON file to load plain-decoding outputs from and save them to")
    p.add_argument("--limit", type=positive_int, help="only the first N prompts (as generate --limit)")
    p.add_argument("--margin", type=finite_float, help="fp-tie margin in logits (default: calibrated on the model)")
    p.add_argument("--calibration-rows", type=int, default=8, help="prefixes measured to calibrate the margin")
    add_model_arguments(p, with_draft=False)
    add_sampling_arguments(p, only=("max_new_tokens",))  # the run's budget: greedy runs are audited
    p.epilog = (
        "Pass the run's own --target, --dtype, --quantization, --prefill-kernel, --max-new-tokens, --no-chat-template "
        "and --allow-special-tokens: "
        "the oracle must decode exactly what the run decoded."
    )


def run(args: argparse.Namespace) -> int:
    config_from_args(SamplingParams, args)  # the budget, validated before the (slow) model loading
    if args.calibration_rows < 1:
        raise BatchspecError(f"--calibration-rows must be >= 1, got {args.calibration_rows}")
    if args.margin is not None and args.margin < 0:
        raise BatchspecError(f"--margin must be >= 0, got {args.margin}")
    inputs = [args.prompts, args.outputs]
    report = check_writable(args.report, "--report", inputs)  # before the audit: its result must not be lost
    markdown = check_writable(args.markdown, "--markdown", inputs) if args.markdown else None
    every = load_prompts(args.prompts, args.format)
    records = every[: args.limit]
    beyond_limit = {r.id for r in every[len(records) :]}  # left out on purpose, not missing prompts
    outputs = [o for o in read_outputs(args.outputs) if o.id not in beyond_limit]
    models = load_models(args, need_draft=False)
    items = pair_items(records, outputs, prompt_encoder(args, models))
    auditor = Auditor(
        models.target,
        models.tokenizer,
        args.max_new_tokens,
        oracle_cache=Path(args.oracle_cache) if args.oracle_cache else None,
        margin=args.margin,
        calibration_rows=args.calibration_rows,
    )
    result = auditor.audit(items)
    result["config"].update(
        prompts=str(args.prompts),
        outputs=str(args.outputs),
        target=args.target or "bundled",
        chat_template=args.chat_template,
        allow_special_tokens=args.allow_special_tokens,
    )
    summary = markdown_summary(result)
    print(summary, end="")  # first: should writing fail after all, the verdict is still on screen
    _write(report, json.dumps(result, indent=2, ensure_ascii=False) + "\n")
    if markdown is not None:
        _write(markdown, summary)
    return 0


def _write(path: Path, text: str) -> None:
    try:
        path.write_text(text, encoding="utf-8", errors="backslashreplace")
    except OSError as err:
        raise BatchspecError(f"cannot write {path}: {err.strerror}") from None
