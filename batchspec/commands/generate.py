"""`batchspec generate`: decode a prompts file, write one JSON line per prompt, print a summary."""

from __future__ import annotations

import argparse
import contextlib
from collections import Counter
import json
import sys
import time
from dataclasses import dataclass, field

from tqdm import tqdm

from ..config import MAX_LOGPROBS, BatchspecError, SamplingParams, SpecConfig, resolve_drafter
from ..llm import LLM, RequestOutput
from ..models import weights_report
from ..prompts import PromptRecord, load_prompts
from ..reference import reference_decode
from ..stats import EngineStats
from ..trace import NullTrace, StepTrace
from .common import (
    check_writable,
    add_decoding_arguments,
    add_model_arguments,
    add_prompt_format_argument,
    add_ray_arguments,
    add_sampling_arguments,
    load_models,
    make_llm,
    make_ray_llm,
    model_config,
    params_for,
    positive_int,
    config_from_args,
)
from .outputs import ResumableOutput


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompts", required=True, help="JSONL (`prompt` or SpecBench `turns`) or text, one per line")
    add_prompt_format_argument(p)
    p.add_argument("--output", "-o", help="write one JSON line per prompt here, in input order (default: print the "
                   "summary only); records go to OUTPUT.partial as prompts finish, so an interrupted run keeps them")
    p.add_argument("--resume", action="store_true", help="continue an interrupted run: keep the records already in "
                   "--output or its .partial (each checked against its prompt) and decode only the prompts that have "
                   "none, or only an error record")
    p.add_argument("--keep-errors", action="store_true", help="with --resume: keep earlier error records too "
                   "instead of trying those prompts again")
    p.add_argument("--limit", type=positive_int, help="only the first N prompts")
    p.add_argument("--verify", action="store_true", help="also decode each prompt alone, plainly, and count exact matches")
    p.add_argument("--trace", help="write one JSON line per piece of every engine step here: prefill chunks, drafter "
                   "catch-ups, rounds, with their wall times (where a row waited, and why; fields in docs/cli.md)")
    add_model_arguments(p)
    add_decoding_arguments(p)
    add_sampling_arguments(p)
    p.add_argument("--logprobs", type=int, metavar="N", help="record each generated token's logprob and the N most "
                   f"likely tokens' at its position (0..{MAX_LOGPROBS}), equal bit for bit to plain decoding's: the "
                   "target's log-softmax, after temperature/top-k/top-p when sampling (field `logprobs`)")
    add_ray_arguments(p)


def summarize(outputs: list[RequestOutput], wall: float, calibration: float = 0.0) -> dict:
    """Throughput and acceptance over the successful requests; `calibration`: seconds of `wall` spent
    measuring the cost model (once per machine), which no tokens/s counts."""
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
        "calibration_seconds": round(calibration, 3),
        "tokens_per_second": round(generated / (wall - calibration), 3) if wall > calibration else None,
        # tokens each row gains per verification round (the first token comes from prefill)
        "mean_accepted_length": round((generated - len(ok)) / rounds, 3) if rounds else None,
        "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
        # row-rounds by drafts verified: K=0 is a plain decoding step for that row
        "chosen_k": {str(k): n for k, n in sorted(Counter(k for o in ok for k in o.chosen_k).items())},
    }


def run(args: argparse.Namespace) -> int:
    records = load_prompts(args.prompts, args.format)[: args.limit]
    if args.verify and args.temperature > 0 and args.seed is None:
        raise BatchspecError("--verify with --temperature > 0 needs --seed: unseeded sampling has no single "
                             "right answer (use `batchspec verify-distribution` for its distribution)")
    if args.resume and not args.output:
        raise BatchspecError("--resume continues an earlier run's --output: give --output")
    if args.keep_errors and not args.resume:
        raise BatchspecError("--keep-errors says which records --resume keeps: give --resume")
    spec = resolve_drafter(model_config(args), config_from_args(SpecConfig, args))
    params = params_for(args, len(records))  # validated before the (slow) model loading
    if args.ray and args.verify:
        raise BatchspecError("--verify decodes every prompt again on this machine; with --ray, run "
                             "`batchspec audit` on the output instead")
    if args.ray and args.logprobs is not None:
        raise BatchspecError("--logprobs is not carried back from Ray workers; run without --ray")
    if args.ray and args.trace:
        raise BatchspecError("--trace records the engine of this process; with --ray the engines run in the workers")
    if args.trace:
        check_writable(args.trace, "--trace", [args.prompts])
    # the output is opened (path checked, lock taken) before any decoding, so a bad path costs nothing
    opened = ResumableOutput(args.output, args.resume, {"--prompts": args.prompts}) if args.output else None
    with opened or contextlib.nullcontext() as output, StepTrace(args.trace) if args.trace else NullTrace() as trace:
        previous = output.kept(records, args.keep_errors) if output else {}
        previous = {key: row for key, row in previous.items() if _same_logprobs(row, args.logprobs)}
        todo = [i for i, r in enumerate(records) if r.id not in previous]
        decoded = _decode(args, spec, records, params, todo, output, trace)
        rows = [_row(r, decoded.outputs[i]) if i in decoded.outputs else previous[r.id] for i, r in enumerate(records)]
        if output:
            output.finish(rows)
    fresh = [decoded.outputs[i] for i in sorted(decoded.outputs)]
    summary = summarize(fresh, decoded.wall, decoded.calibration_s)
    if args.resume:
        summary["resumed"] = len(records) - len(todo)
    summary["weights"] = weights_report(model_config(args), getattr(decoded.llm, "models", None))
    if spec.speculative:  # what chose the K in chosen_k
        summary["speculation"] = {"policy": spec.speculation, "max_drafts": spec.num_draft_tokens,
                                  "drafter": spec.drafter}
    stats = decoded.stats
    summary["time_seconds"] = {  # where the time went: model forwards vs everything else
        "prefill": round(stats.prefill_time, 3),
        "draft_forwards": round(stats.draft_time, 3),
        "target_forwards": round(stats.verify_time, 3),
        "other": round(stats.other_time, 3),
    }
    # prompt tokens sent, and those computed (the rest came from the prefix cache, --prefix-cache-gb)
    summary["prompt_tokens"] = {"sent": stats.prefill_tokens, "computed": stats.prefill_fed,
                                "prefix_cache_hits": stats.prefix_cache_hits}
    summary["decode_tokens_per_second"] = (
        round(stats.generated / stats.decode_time, 3) if stats.decode_time > 0 else None
    )
    if args.verify:
        summary["exact_match"] = _verify(decoded.llm, fresh, params)
    print(json.dumps(summary, indent=2))
    if not any(row.get("error") is None for row in rows):
        print(f"batchspec generate: no prompt produced output (all {len(rows)} refused: see the `error` of each "
              f"{'record in ' + args.output if args.output else 'prompt (write them with --output)'})",
              file=sys.stderr)
        return 1
    return 0


@dataclass
class _Run:
    """What one generate run decoded: outputs by input index, and the LLM that did it (None when
    nothing was left to decode, so no model was loaded)."""

    outputs: dict[int, RequestOutput] = field(default_factory=dict)
    llm: LLM | None = None
    wall: float = 0.0

    @property
    def stats(self) -> EngineStats:
        return self.llm.stats if self.llm else EngineStats()

    @property
    def calibration_s(self) -> float:
        """Seconds of `wall` spent measuring the cost model. Ray workers measure side by side, each
        its own: about one worker's share of their sum."""
        return self.stats.calibration_s / getattr(self.llm, "workers", 1)


def _decode(
    args: argparse.Namespace,
    spec: SpecConfig,
    records: list[PromptRecord],
    params: list[SamplingParams],
    todo: list[int],
    output: ResumableOutput | None,
    trace: NullTrace,
) -> _Run:
    """Decode the prompts at input indices `todo`, handing each record to `output` as it finishes;
    `trace` records every engine step."""
    decoded = _Run()

    def finished(out: RequestOutput) -> None:
        decoded.outputs[out.index] = out
        if output:
            output.write(_row(records[out.index], out))

    for i in todo:
        if records[i].error is not None:
            finished(RequestOutput(i, records[i].text, [], error=records[i].error))
    readable = [i for i in todo if records[i].error is None]
    if not readable:
        return decoded
    if args.ray:
        decoded.llm = make_ray_llm(args, spec)
    else:
        decoded.llm = make_llm(args, load_models(args, need_draft=spec.needs_draft_model), spec)
        decoded.llm.trace = trace
    start = time.perf_counter()
    with tqdm(total=len(readable), desc=f"{spec.method} b{spec.batch_size}", unit="prompt", file=sys.stderr) as bar:
        # text in: the LLM encodes it (chat template, control tokens) and refuses what it cannot serve
        for out in decoded.llm.stream([records[i].text for i in readable], [params[i] for i in readable]):
            out.index = readable[out.index]
            finished(out)
            bar.update(1)
    decoded.wall = time.perf_counter() - start
    return decoded


def _same_logprobs(row: dict, logprobs: int | None) -> bool:
    """Whether an earlier record has the logprobs this run asks for (with N alternatives each): a
    resumed run must not mix records with and without them."""
    entries = row.get("logprobs")
    if row.get("error") is not None or (entries is None and logprobs is None):
        return True
    return entries is not None and logprobs is not None and all(
        isinstance(e, dict) and len(e.get("top", ())) == logprobs for e in entries)


def _row(record: PromptRecord, out: RequestOutput) -> dict:
    row = {"id": record.id, **out.to_json()}
    row.pop("index")
    return row


def _verify(llm: LLM | None, outputs: list[RequestOutput], params: list[SamplingParams]) -> str:
    """Exact matches against plain decoding of each prompt alone."""
    ok = [o for o in outputs if o.error is None]
    matches = 0
    for o in tqdm(ok, desc="oracle", unit="prompt", file=sys.stderr):
        expected = reference_decode(llm.models.target, o.prompt_token_ids, params[o.index], llm.stop_ids)
        matches += expected == o.token_ids
    return f"{matches}/{len(ok)}"
