"""What a round costs, measured: the time of one target forward by rows and tokens per row, and of
one drafter forward by rows and tokens per row (a drafting step feeds 1 or 2; catching a row up,
a deferred prefill of its prompt, feeds many), on this machine, these models, this dtype and device.

Adaptive speculation (`batchspec.speculation`) chooses how many drafts to verify by comparing the
tokens they are expected to add with the time they add, so the times must be this machine's: on a
2-core CPU a 6-token verify of a 1.5B model costs ~2.3x a 1-token one with torch's default linears
and ~1.15x with packed ones (`batchspec.kernels`), on a GPU about the same as one. A short
calibration runs the first time a model is used (a few forwards per shape, prefill excluded) and
is cached per model fingerprint and device in the user cache dir; during decoding the
engine's own phase timings rescale it (an exponential moving average of measured / predicted), so
load on the machine and growing contexts are followed. Tests inject a scripted model (`Costs`).
"""

from __future__ import annotations

import hashlib
import json
import math
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

import torch
from tqdm import tqdm

from .bundled import cache_dir
from .kernels import linear_kernel, native_bfloat16, weights_summary
from .kv import context_limit
from .methods import layout_for

SMOOTHING = 0.1  # weight of each new round in the online rescaling (load, drafter steps, overhead)
SHAPE_SMOOTHING = 0.01  # ... in a verify shape's own mean, once it has 100 rounds (before: their plain mean)
SCALE_BOUNDS = (0.2, 5.0)  # a single odd round (a GC pause, a page fault) may not move the model further
CONTEXT = 32  # committed tokens per row while measuring: decode-like, and cheap to prefill
REPEATS = 4  # timed repeats per shape after one warm-up; the fastest counts (noise only adds time)
MAX_GRID = 4  # measured points per axis; the rest is interpolated
# Drafter forwards timed: its steps (1 and 2 tokens) and catch-ups (a deferred prefill of a row's
# prompt, a shared forward after rounds without drafts), extrapolated linearly beyond the last. (A
# 512-token shape was tried: the bundled drafter's 512-token catch-up measured 698 ms against 662 ms
# extrapolated, a 5% correction that cost a minute more of calibration at batch 8.)
DRAFT_TOKENS = [1, 2, 16, 128]
# A cached table whose smallest shape takes this many times what it takes now was measured on a
# busy machine (a contended 2-core CPU can be several times slower): measured anew, not trusted.
STALE_FACTOR = 1.3
# How tables are measured: part of the cache key, so a change to `measure` retires tables measured
# the old way (version 2: shapes recorded as measured, not made monotone; four timed repeats;
# version 4: multi-token forwards read grouped K/V heads in place; version 5: every forward runs the
# batch-invariant `kv.use_exact_attention`; version 3 named a trial of a 512-token drafter shape,
# whose tables may still sit in a cache).
CALIBRATION_VERSION = 5


class Costs(Protocol):
    """Seconds of the parts of a round, as the speculation policy needs them."""

    def verify_time(self, rows: int, tokens: int) -> float:
        """One target forward of `tokens` tokens for each of `rows` rows."""

    def draft_time(self, rows: int, tokens: int) -> float:
        """One drafter forward feeding `tokens` tokens to each of `rows` rows (0 without a drafter model)."""

    def overhead(self) -> float:
        """Per round, outside the forwards (acceptance, commits, bookkeeping)."""

    def observe(self, rows: int, width: int, steps: int, draft_s: float, verify_s: float, other_s: float) -> None:
        """A round ran: `rows` rows verified `width` drafts each after `steps` drafter steps, taking
        these phase times."""


def wall_clock(model: torch.nn.Module) -> float:
    """Wall clock that waits for queued GPU work, so phase timings are honest on CUDA too."""
    if next(model.parameters()).is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter()


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_description() -> str:
    """The CPU's name with the vector instructions torch uses on it. The name alone does not tell
    machines apart whose costs differ several-fold: this project's "AMD EPYC" has been a CPU with
    AVX-512 and native bfloat16 (a Qwen2.5 1.5B step ~120 ms) and one with AVX2 only (~600 ms)."""
    bf16 = ", native bfloat16" if native_bfloat16() else ""
    return f"{cpu_model()} ({torch.backends.cpu.get_cpu_capability()}{bf16})"


def _interp(xs: list[int], ys: list[float], x: float) -> float:
    """Piecewise-linear through (xs, ys), extended linearly past both ends, never below 0."""
    if len(xs) == 1:
        return ys[0]
    i = 1
    while i < len(xs) - 1 and x > xs[i]:
        i += 1
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


@dataclass
class TimingTable:
    """Seconds of one forward measured at each (rows[i], tokens[j]): seconds[i][j]."""

    rows: list[int]
    tokens: list[int]
    seconds: list[list[float]]

    def __call__(self, rows: int, tokens: int) -> float:
        by_rows = [_interp(self.tokens, line, tokens) for line in self.seconds]
        return _interp(self.rows, by_rows, rows)

    def covers(self, rows: int, tokens: int) -> bool:
        return rows <= self.rows[-1] and tokens <= self.tokens[-1]


class MeasuredCosts:
    """A calibrated `TimingTable` per model, refreshed online by what rounds really take.

    Verify forwards are timed exactly (one forward per round), so each shape the engine runs keeps
    its own mean time, which takes over from the table as its rounds accumulate: a table point a
    noisy calibration got wrong, or one whose cost grows with context where the calibration's
    context was short, is corrected once rounds of that shape run (the policy's probes run the
    one-draft shape even when it never chooses it). A shape's mean is the time of its rounds at the
    load then: `verify_scale` follows the load, from how much slower or faster than its own mean
    each round of a known shape ran, and carries every shape's mean along, those that have not run
    lately included. (An earlier version kept plain means: at batch 4 a plain step measured while
    the machine was busy stayed rated 20% dearer than it had become while the verify shapes that
    ran were rated at their new cost, and rounds drafted at a loss.) A shape's mean moves slowly
    once known (SHAPE_SMOOTHING), so a change of load moves the scale rather than the one shape
    that happens to run. Drafter steps (a round's drafting time mixes catch-up and steps of two
    sizes) follow their table scaled by the running ratio of measured to predicted time.
    """

    def __init__(self, verify: TimingTable, draft: TimingTable | None, source: str = "") -> None:
        self.verify = verify
        self.draft = draft
        self.source = source  # where the tables came from, for reports
        self.verify_scale = 1.0
        self.draft_scale = 1.0
        # (rows, tokens) -> (mean seconds, rounds, verify_scale when the mean was last updated)
        self.seen: dict[tuple[int, int], tuple[float, int, float]] = {}
        self._overhead: float | None = None

    def verify_time(self, rows: int, tokens: int) -> float:
        table = self.verify(rows, tokens) * self.verify_scale
        mean, count, scale_then = self.seen.get((rows, tokens), (0.0, 0, 1.0))
        trust = _trust(count)
        return trust * mean * self.verify_scale / scale_then + (1 - trust) * table

    def draft_time(self, rows: int, tokens: int) -> float:
        return 0.0 if self.draft is None else self.draft(rows, tokens) * self.draft_scale

    def overhead(self) -> float:
        return self._overhead or 0.0

    def observe(self, rows: int, width: int, steps: int, draft_s: float, verify_s: float, other_s: float) -> None:
        shape = (rows, width + 1)
        mean, count, scale_then = self.seen.get(shape, (0.0, 0, 1.0))
        expected = self.verify_time(*shape)
        if expected > 0 and verify_s > 0:  # a round of a shape known well tells the load
            ratio = min(max(verify_s / expected, SCALE_BOUNDS[0]), SCALE_BOUNDS[1])
            self.verify_scale = min(max(self.verify_scale * (1 + SMOOTHING * _trust(count) * (ratio - 1)),
                                        SCALE_BOUNDS[0]), SCALE_BOUNDS[1])
        now = mean * self.verify_scale / scale_then  # the mean at today's load
        self.seen[shape] = (now + max(SHAPE_SMOOTHING, 1 / (count + 1)) * (verify_s - now), count + 1, self.verify_scale)
        if steps and self.draft is not None:
            predicted = self.draft(rows, 2) + (steps - 1) * self.draft(rows, 1)
            self.draft_scale = _rescaled(self.draft_scale, draft_s, predicted)
        self._overhead = other_s if self._overhead is None else (1 - SMOOTHING) * self._overhead + SMOOTHING * other_s


def _trust(rounds: int) -> float:
    """Weight of a shape's own mean against the table: 1/3 after one round, 0.8 after eight."""
    return rounds / (rounds + 2)


def _rescaled(scale: float, measured: float, predicted: float) -> float:
    if predicted <= 0 or measured <= 0:
        return scale
    ratio = min(max(measured / predicted, SCALE_BOUNDS[0]), SCALE_BOUNDS[1])
    return (1 - SMOOTHING) * scale + SMOOTHING * ratio


# ---- calibration ------------------------------------------------------------------------------------
def grid(top: int, base: tuple[int, ...] = ()) -> list[int]:
    """At most MAX_GRID points from 1 to `top`: powers of two (and `base`), spread evenly, ends kept."""
    points = sorted({1, top, *(2**i for i in range(top.bit_length()) if 2**i < top), *(b for b in base if b < top)})
    if len(points) <= MAX_GRID:
        return points
    step = (len(points) - 1) / (MAX_GRID - 1)
    return sorted({points[round(i * step)] for i in range(MAX_GRID)})


@torch.inference_mode()
def measure(model: torch.nn.Module, rows: list[int], tokens: list[int], all_logits: bool) -> TimingTable:
    """Time one forward of each shape through the layout the engine runs the model on (ragged, or
    stateful for a model with recurrent state), after CONTEXT committed tokens per row; `all_logits`
    as a verify forward (every position's logits) rather than a drafter step (the last position's
    only).

    Shapes are timed in interleaved passes (a warm-up, then REPEATS) and each keeps its fastest, so
    a burst of load on a shared machine hits every shape alike instead of one. A shape with more rows
    or tokens may well be the cheaper one, and is recorded so: oneDNN's packed float32 product of one
    or two rows was slower than that of three to six (a Qwen2.5 1.5B step here: 230-290 ms for 1 row x 1
    token or 2 x 1, ~180 ms for 4 x 1 or 1 x 4, before `batchspec.kernels` padded small products).
    Rating such a shape as dear as the smaller one (an earlier version did) made a 4-row plain step
    look as dear as a 4-row verify of two tokens, and adaptive speculation verified drafts at batch 4
    that did not pay."""
    limit = context_limit(model)
    context = CONTEXT if limit is None else min(CONTEXT, limit - max(tokens))
    device = next(model.parameters()).device
    vocab = int(model.get_input_embeddings().num_embeddings)
    ids = [(7 * i + 3) % vocab for i in range(context)]
    layout_class = layout_for(model)  # the layout the engine runs it on
    layouts = {}
    for r in rows:
        layouts[r] = layout_class(model, r, context + max(tokens))
        layouts[r].prefill([ids] * r)
    best = {(r, n): math.inf for r in rows for n in tokens}
    # on the bundled pair 9 s at batch 1, more for larger batches, once per machine (a bar in terminals only)
    with tqdm(total=(REPEATS + 1) * len(rows) * len(tokens), unit="forward", file=sys.stderr, leave=False,
              disable=None, desc=f"measuring {type(model).__name__} forward costs (once, cached)") as bar:
        for timed in [False] + [True] * REPEATS:
            for r in rows:
                layout = layouts[r]
                base = layout.lengths.clone()
                for n in tokens:
                    feed = torch.full((r, n), ids[-1], dtype=torch.long, device=device)
                    start = wall_clock(model)
                    layout.forward(feed, last_only=not all_logits)
                    elapsed = wall_clock(model) - start
                    layout.commit(base)
                    if timed:
                        best[r, n] = min(best[r, n], elapsed)
                    bar.update(1)
    return TimingTable(rows, tokens, [[best[r, n] for n in tokens] for r in rows])


def fingerprint(model: torch.nn.Module) -> dict:
    """What a measurement depends on: the model (architecture, config, size), its dtype and device,
    the hardware, the threads torch uses, and the kernels and weights of its linears (float packed,
    int8, int4 and its group size: an int4 step reads a quarter of float32's bytes)."""
    param = next(model.parameters())
    config = model.config.to_json_string(use_diff=True) if hasattr(model.config, "to_json_string") else repr(model.config)
    return {
        "model": type(model).__name__,
        "config": hashlib.sha256(config.encode()).hexdigest()[:16],
        "parameters": sum(p.numel() for p in model.parameters()),
        "dtype": str(param.dtype),
        "device": param.device.type,
        "hardware": torch.cuda.get_device_name(param.device) if param.is_cuda else cpu_description(),
        "threads": torch.get_num_threads(),
        "linear_kernel": linear_kernel(model),
        "weights": weights_summary(model),
        "torch": torch.__version__,
    }


def costs_dir() -> Path:
    return cache_dir() / "costs"


_MEMO: dict[str, TimingTable] = {}


def _cached_table(path: Path) -> TimingTable | None:
    try:
        return TimingTable(**json.loads(path.read_text(encoding="utf-8"))["table"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # missing or unreadable: measure again


def calibrated(model: torch.nn.Module, rows: int, tokens: list[int], all_logits: bool, fresh: bool = False,
               measure_fn: Callable[..., TimingTable] = measure) -> tuple[TimingTable, str]:
    """The model's timing table covering up to `rows` rows and the `tokens` grid: from this
    process, from the cache file, or measured now (and cached); `fresh` measures anew whatever is
    cached. Returns it and where it came from.

    A table read from the file is checked once per process against one quick forward of its
    smallest shape: a table measured while something else loaded the machine would have adaptive
    speculation decline drafts that pay, for good (a policy that never drafts never observes a
    drafter step to correct it by)."""
    parts = fingerprint(model) | {"all_logits": all_logits, "calibration": CALIBRATION_VERSION}
    key = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:20]
    path = costs_dir() / f"{key}.json"
    memo = None if fresh else _MEMO.get(key)
    if memo is not None and memo.covers(rows, max(tokens)):
        return memo, f"cached {path}"
    why = "measured"
    table = None if fresh or memo is not None else _cached_table(path)
    if table is not None and table.covers(rows, max(tokens)):
        was, now = table(1, tokens[0]), measure_fn(model, [1], tokens[:1], all_logits)(1, tokens[0])
        if was <= STALE_FACTOR * now:
            _MEMO[key] = table
            return table, f"cached {path}"
        why = f"re-measured (the cached table's {was * 1e3:.1f} ms took {now * 1e3:.1f} ms now)"
    table = measure_fn(model, grid(rows), tokens, all_logits)
    _MEMO[key] = table
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"fingerprint": parts, "table": asdict(table)}, indent=1) + "\n", encoding="utf-8")
        return table, f"{why}, cached in {path}"
    except OSError:
        return table, f"{why} (cache dir not writable)"


def measured_costs(target: torch.nn.Module, draft: torch.nn.Module | None, rows: int, max_drafts: int,
                   fresh: bool = False) -> MeasuredCosts:
    """Costs of rounds of up to `rows` rows and `max_drafts` drafts each (verify feeds max_drafts + 1)."""
    verify, where = calibrated(target, rows, grid(max_drafts + 1, (2,)), all_logits=True, fresh=fresh)
    draft_table = None
    if draft is not None:
        limit = context_limit(draft)  # a catch-up longer than the context can neither happen nor be measured
        tokens = [n for n in DRAFT_TOKENS if limit is None or n + CONTEXT <= limit]
        draft_table, draft_where = calibrated(draft, rows, tokens, all_logits=False, fresh=fresh)
        where = f"target {where}; drafter {draft_where}"
    return MeasuredCosts(verify, draft_table, where)


def round_time(costs: Costs, rows: int, width: int, steps: int) -> float:
    """Seconds of a round of `rows` rows verifying `width` drafts each after `steps` drafter steps
    (the first feeds two tokens per row, the rest one): the one formula the speculation policy and
    `break_even` price rounds by."""
    drafting = 0.0 if steps == 0 else costs.draft_time(rows, 2) + (steps - 1) * costs.draft_time(rows, 1)
    return drafting + costs.verify_time(rows, width + 1) + costs.overhead()


def break_even(costs: Costs, rows: int, k: int) -> float | None:
    """The per-draft acceptance rate at which k drafts per row are worth exactly as much as plain
    decoding at this batch size: (1 + a + ... + a^k) / T(k) = 1 / T(0). None: not even with every
    draft accepted."""
    needed = round_time(costs, rows, k, k) / round_time(costs, rows, 0, 0)
    if needed > k + 1:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        if sum(mid**i for i in range(k + 1)) < needed:
            lo = mid
        else:
            hi = mid
    return hi
