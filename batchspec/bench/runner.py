"""Timing every method on the same encoded prompts, with the models loaded once.

Our engine is timed through `LLM` (its EngineStats split prefill / draft / verify); Hugging Face's
own `generate` is timed from outside, with a streamer recording when each row got its first token
and when it finished, so latency and time to first token mean the same thing for every method:
seconds since the run started (all requests arrive at once, as in an offline batch).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch
from tqdm import tqdm
from transformers import GenerationConfig
from transformers.generation.streamers import BaseStreamer

from ..config import BatchspecError, SpecConfig
from ..forensics.oracle import Oracle
from ..kv import forward_all_positions, prompt_first_forwards
from ..layouts.base import left_padded
from ..llm import LLM
from ..models import ModelPair
from ..trace import StepTrace
from .exactness import Classifier, Match, compare
from .methods import HF_ASSISTED, MethodSpec
from .specbench import BenchPrompt

ALL = "all"  # label of a run over every prompt at once


@dataclass
class RowResult:
    """One prompt's output under one method, with what it cost."""

    token_ids: list[int]
    ttft: float | None
    latency: float | None
    rounds: int = 0  # verification rounds this row took part in
    round_tokens: int = 0  # tokens those rounds produced for this row
    drafted: int = 0
    accepted: int = 0
    error: str | None = None
    gaps: list[float] = field(default_factory=list)  # seconds between the row's successive emissions
    chosen_k: list[int] = field(default_factory=list)  # drafts verified per round (0: speculation declined)
    proposed_k: list[int] = field(default_factory=list)  # drafts the drafter proposed per round


def emission_gaps(token_times: Sequence[float]) -> list[float]:
    """Inter-token latency as a reader sees it: the waits between successive emissions of one row.
    Tokens of one round arrive together (one emission), so a round that accepts several drafts
    is one gap, not several zero gaps."""
    emissions = sorted(set(token_times))
    return [b - a for a, b in zip(emissions, emissions[1:])]


@dataclass
class Timing:
    """Wall time of one run and where it went; draft/verify are None when nobody measured them.
    prefill_tokens: prompt tokens prefilled; prefill_fed: token positions the prefill computed
    (prompt tokens plus any padding)."""

    wall: float
    prefill: float
    draft: float | None = None
    verify: float | None = None
    grouping: tuple[int, int] | None = None  # exspec: (rounds on a same-length group, fallback rounds)
    prefill_tokens: int = 0
    prefill_fed: int = 0

    def __add__(self, other: Timing) -> Timing:
        def plus(a: float | None, b: float | None) -> float | None:
            return None if a is None or b is None else a + b

        grouping = None
        if self.grouping is not None and other.grouping is not None:
            grouping = (self.grouping[0] + other.grouping[0], self.grouping[1] + other.grouping[1])
        return Timing(
            self.wall + other.wall, self.prefill + other.prefill,
            plus(self.draft, other.draft), plus(self.verify, other.verify), grouping,
            self.prefill_tokens + other.prefill_tokens, self.prefill_fed + other.prefill_fed,
        )


@dataclass
class MethodResult:
    """A method over the bench prompts of some parts (all prompts, or task groups): rows in prompt
    order (None outside those parts), a timing per part, and each row's comparison with the oracle."""

    spec: MethodSpec
    rows: list[RowResult | None] = field(default_factory=list)
    timings: dict[str, Timing] = field(default_factory=dict)
    matches: list[Match | None] = field(default_factory=list)
    labels: list[str | None] = field(default_factory=list)
    error: str | None = None


def _bar(total: int, desc: str) -> tqdm:
    return tqdm(total=total, desc=desc, unit="prompt", file=sys.stderr, leave=False)


def warm_up(models: ModelPair, prompt: Sequence[int]) -> None:
    """One short forward per model before any timing, so lazy initialisation (kernels, allocator,
    thread pools) is not billed to whichever method happens to run first."""
    for model in (models.target, models.draft):
        if model is not None:
            forward_all_positions(model, list(prompt[:8]), keep=1)


# ---- our engine -------------------------------------------------------------------------------
def run_engine(
    models: ModelPair, spec: MethodSpec, prompts: list[BenchPrompt], template: SpecConfig, desc: str,
    trace: StepTrace | None = None,
) -> tuple[list[RowResult], Timing]:
    """`template` carries what every method shares (K, window, budgets); `spec` what this one is;
    `trace` records every step's pieces of work."""
    config = replace(template, method=spec.method, batch_size=spec.batch_size, scheduler=spec.scheduler,
                     max_prefill_tokens=spec.prefill_chunk, speculation=spec.speculation, drafter=spec.drafter,
                     num_draft_tokens=spec.num_draft_tokens or template.num_draft_tokens)
    llm = LLM(spec=config, models=models, trace=trace)  # prompts arrive encoded
    rows: dict[int, RowResult] = {}
    with _bar(len(prompts), desc) as bar:
        start = time.perf_counter()
        for out in llm.stream([list(p.token_ids) for p in prompts], [p.params for p in prompts]):
            n = len(out.token_ids)
            rows[out.index] = RowResult(
                out.token_ids, out.time_to_first_token, out.latency,
                rounds=out.rounds, round_tokens=max(n - 1, 0),  # the first token comes from prefill
                drafted=out.drafted, accepted=out.accepted, error=out.error, gaps=emission_gaps(out.token_times),
                chosen_k=out.chosen_k, proposed_k=out.proposed_k,
            )
            bar.update(1)
        wall = time.perf_counter() - start
    s = llm.stats
    wall -= s.calibration_s  # measuring costs is no method's time (the bench measures them before any run)
    grouping = None
    if "grouped_rounds" in s.extra:
        grouping = (int(s.extra["grouped_rounds"]), int(s.extra["fallback_rounds"]))
    timing = Timing(wall, s.prefill_time, s.draft_time, s.verify_time, grouping, s.prefill_tokens, s.prefill_fed)
    return [rows[i] for i in range(len(prompts))], timing


# ---- Hugging Face generate --------------------------------------------------------------------
class _Timeline(BaseStreamer):
    """Streamer that records, per row of one generate() call, when its first token arrived and
    when it finished (stop token or token budget), and how many times tokens were pushed (one
    push per decoding step; per assisted round at batch 1)."""

    def __init__(self, rows: int, stop_ids: frozenset[int], max_new_tokens: int, origin: float) -> None:
        self.rows, self.stop_ids, self.max_new_tokens, self.origin = rows, stop_ids, max_new_tokens, origin
        self.prompt_seen = False
        self.steps = 0
        self.first_step_at: float | None = None
        self.first: list[float | None] = [None] * rows
        self.finish: list[float | None] = [None] * rows
        self.emitted: list[list[float]] = [[] for _ in range(rows)]  # when each push reached each row
        self.count = [0] * rows

    def put(self, value: torch.Tensor) -> None:
        now = time.perf_counter() - self.origin
        if not self.prompt_seen:  # generate pushes the prompt first
            self.prompt_seen = True
            return
        self.steps += 1
        if self.first_step_at is None:
            self.first_step_at = now
        for b, tokens in enumerate(value.reshape(self.rows, -1).tolist()):
            if self.finish[b] is not None:
                continue  # finished rows are fed padding
            if self.first[b] is None:
                self.first[b] = now
            self.emitted[b].append(now)
            for token in tokens:
                self.count[b] += 1
                if token in self.stop_ids or self.count[b] >= self.max_new_tokens:
                    self.finish[b] = now
                    break

    def end(self) -> None:
        now = time.perf_counter() - self.origin
        self.finish = [now if f is None else f for f in self.finish]


class _CallCounter:
    """Forward pre-hook counting calls: every forward of the assistant drafts exactly one token."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, module: torch.nn.Module, args: tuple) -> None:
        self.calls += 1


@contextmanager
def _plain_generation_configs(models: ModelPair, num_draft_tokens: int) -> Iterator[None]:
    """Swap in transformers' default generation configs for the duration of a baseline.

    generate() fills every unset option from the model's own generation_config.json, which for
    instruct models carries a repetition penalty (applied even when greedy) and sampling knobs: the
    baseline would not be plain greedy. The assistant drafts exactly K tokens a round (constant
    schedule, no confidence cut-off), as our methods do, so acceptance is compared like for like.
    """
    saved = [(m, m.generation_config) for m in (models.target, models.draft) if m is not None]
    models.target.generation_config = GenerationConfig()
    if models.draft is not None:
        models.draft.generation_config = GenerationConfig(
            num_assistant_tokens=num_draft_tokens,
            num_assistant_tokens_schedule="constant",
            assistant_confidence_threshold=0.0,
        )
    try:
        yield
    finally:
        for model, config in saved:
            model.generation_config = config


def _until_stop(tokens: list[int], stop_ids: frozenset[int], limit: int) -> list[int]:
    """A generate() row up to and including its first stop token (the rest is padding)."""
    out: list[int] = []
    for token in tokens[:limit]:
        out.append(token)
        if token in stop_ids:
            break
    return out


def run_hf(
    models: ModelPair,
    spec: MethodSpec,
    prompts: list[BenchPrompt],
    template: SpecConfig,
    stop_ids: Sequence[int],
    desc: str,
) -> tuple[list[RowResult], Timing]:
    """`hf@B`: batched plain greedy generate (left padding); `hf-assisted@1`: generate with the
    drafter as assistant model. Same prompts, token budget and stop ids as our methods."""
    if not all(p.params.greedy for p in prompts):
        raise BatchspecError("the transformers baselines run greedy only (their sampling is not keyed by position)")
    budgets = {p.params.max_new_tokens for p in prompts}
    if len(budgets) != 1:
        raise BatchspecError("the transformers baselines need one max_new_tokens for every prompt")
    max_new_tokens = budgets.pop()
    target, tokenizer = models.target, models.tokenizer
    assistant = models.draft if spec.method == HF_ASSISTED else None
    stops = frozenset(stop_ids)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]
    device = next(target.parameters()).device
    drafts = _CallCounter()
    hook = assistant.register_forward_pre_hook(drafts) if assistant is not None else None
    rows: list[RowResult] = []
    prefill = 0.0
    prefill_tokens = prefill_fed = 0
    try:
        with (_plain_generation_configs(models, template.num_draft_tokens), prompt_first_forwards(target),
              _bar(len(prompts), desc) as bar):
            start = time.perf_counter()
            for lo in range(0, len(prompts), spec.batch_size):
                batch = prompts[lo: lo + spec.batch_size]
                ids, mask = left_padded([p.token_ids for p in batch], device, pad_id)
                timeline = _Timeline(len(batch), stops, max_new_tokens, start)
                drafted_before = drafts.calls
                batch_start = time.perf_counter() - start
                out = target.generate(
                    input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                    eos_token_id=list(stop_ids), pad_token_id=pad_id, streamer=timeline, assistant_model=assistant,
                )
                end = time.perf_counter() - start
                prefill += (timeline.first_step_at if timeline.first_step_at is not None else end) - batch_start
                prefill_tokens += int(mask.sum())
                prefill_fed += mask.numel()  # generate computes the left-padded rectangle
                for b, row in enumerate(out[:, ids.shape[1]:].tolist()):
                    tokens = _until_stop(row, stops, max_new_tokens)
                    if assistant is None:
                        rounds, round_tokens, drafted = len(tokens) - 1, len(tokens) - 1, 0
                    else:  # batch 1: every push is one draft-and-verify round, the first one included
                        rounds, round_tokens, drafted = timeline.steps, len(tokens), drafts.calls - drafted_before
                    rows.append(RowResult(
                        tokens, timeline.first[b], timeline.finish[b], rounds=rounds, round_tokens=round_tokens,
                        drafted=drafted, accepted=round_tokens - rounds if assistant is not None else 0,
                        gaps=emission_gaps(timeline.emitted[b]),
                    ))
                bar.update(len(batch))
            wall = time.perf_counter() - start
    finally:
        if hook is not None:
            hook.remove()
    return rows, Timing(wall, prefill, prefill_tokens=prefill_tokens, prefill_fed=prefill_fed)


# ---- the whole bench --------------------------------------------------------------------------
def run_method(
    models: ModelPair,
    spec: MethodSpec,
    prompts: list[BenchPrompt],
    parts: dict[str, list[int]],
    template: SpecConfig,
    stop_ids: Sequence[int],
    oracle: Oracle,
    classify: Classifier,
    trace: StepTrace | None = None,
) -> MethodResult:
    """Run `spec` over each part (all prompts, or one task group at a time) and compare every
    row of those parts with the oracle. Any failure becomes the method's error row: one method that
    cannot run (e.g. one still being built) must not cost the figures of the others. `trace`: every
    engine step's pieces, each record naming the method and part."""
    result = MethodResult(spec)
    rows: dict[int, RowResult] = {}
    try:
        for label, indices in parts.items():
            chosen = [prompts[i] for i in indices]
            desc = spec.name if label == ALL else f"{spec.name} {label}"
            if spec.is_baseline:
                part_rows, timing = run_hf(models, spec, chosen, template, stop_ids, desc)
            else:
                if trace is not None:
                    trace.context.update(method=spec.name, part=label)
                part_rows, timing = run_engine(models, spec, chosen, template, desc, trace)
            rows.update(zip(indices, part_rows))
            result.timings[label] = timing
    except Exception as err:  # noqa: BLE001 - reported as this method's error row
        result.error = f"{type(err).__name__}: {err}".splitlines()[0]
        result.timings.clear()
        return result
    result.rows = [rows.get(i) for i in range(len(prompts))]
    for prompt, row in zip(prompts, result.rows):
        if row is None or row.error is not None:
            result.matches.append(None)
            result.labels.append(None)
            continue
        reference = oracle(prompt.token_ids, prompt.params)
        match = compare(row.token_ids, reference)
        result.matches.append(match)
        label = None if match.exact else classify(prompt.token_ids, row.token_ids, reference, prompt.params)
        result.labels.append(label)
    return result


def fastest_of(repeats: list[MethodResult], parts: dict[str, list[int]]) -> MethodResult:
    """One method's runs as one result: per part (all prompts, or a task group), the run of that
    part with the least wall time, its timing and its rows (latencies belong to the timing they
    came with). Each run may cover some parts only. Noise on a shared machine only ever adds time,
    so the fastest run is the least disturbed one (as `timeit` reports). Exactness is never taken
    from the fast run alone: a row that diverged in any run is reported as diverging."""
    failed = next((r for r in repeats if r.error is not None), None)
    if failed is not None:
        return failed
    size = len(repeats[0].rows)
    merged = MethodResult(repeats[0].spec, rows=[None] * size, matches=[None] * size, labels=[None] * size)
    for label, indices in parts.items():
        best = min((r for r in repeats if label in r.timings), key=lambda r: r.timings[label].wall)
        merged.timings[label] = best.timings[label]
        for i in indices:
            merged.rows[i], merged.matches[i], merged.labels[i] = best.rows[i], best.matches[i], best.labels[i]
            wrong = next((r for r in repeats if r.matches[i] is not None and not r.matches[i].exact), None)
            if wrong is not None:
                merged.matches[i], merged.labels[i] = wrong.matches[i], wrong.labels[i]
    return merged
