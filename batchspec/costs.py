"""What a round costs, measured: the time of one target forward by rows and tokens per row, and of
one drafter forward by rows and tokens per row (a drafting step feeds 1 or 2; catching a row up,
a deferred prefill of its prompt, feeds many), on this machine, these models, this dtype and device.

Adaptive speculation (`batchspec.speculation`) chooses how many drafts to verify by comparing the
tokens they are expected to add with the time they add, so the times must be this machine's: how a
verify of several tokens compares with a plain step differs several-fold between kernels and
devices (docs/quantization.md). A short calibration runs the first time a model is used and says
so on stderr (what it times, how long it took, where it is cached); it is cached per model
fingerprint and device in the user cache dir only if it checks out (each shape's repeats agree, the
table grows with the work where physics says it must), since a table measured on a busy machine
would steer every later run. During decoding the engine's own phase timings rescale it (an
exponential moving average of measured / predicted), so load and growing contexts are followed, and
rounds that keep running far from the table mark its cache file stale for the next start. Tests
inject a scripted model (`Costs`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import platform
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

import torch
from tqdm import tqdm

from .bundled import cache_dir
from .draft import SHARED_CATCH_UP
from .kernels import has_prompt_path, linear_kernel, native_bfloat16, weights_summary
from .kv import context_limit
from .methods import layout_for
from .roles import prompt_pass

SMOOTHING = 0.1  # weight of each new round in the online rescaling (load, drafter steps, overhead)
SHAPE_SMOOTHING = 0.01  # ... in a verify shape's own mean, once it has 100 rounds (before: their plain mean)
SCALE_BOUNDS = (0.2, 5.0)  # a single odd round (a GC pause, a page fault) may not move the model further
CONTEXT = 8  # committed tokens per row while measuring: decode-like; prefilling more only costs time
# Each shape is timed until two of its timings agree within AGREEMENT, at most TRIES times, after one
# warm-up forward per layout; the faster of the first agreeing pair counts. Noise only adds time, but a
# lone fast timing is no more the forward's cost than a lone slow one (clocks rise and fall with what
# the cores ran just before), so it has to be matched.
AGREEMENT = 0.10
TRIES = 3
# A timing is the mean of back-to-back forwards until MIN_TIMING_S has passed (at most MAX_REPEATS):
# a forward of a few tens of milliseconds moves by more than AGREEMENT from one call to the next on
# its own (timer, cache and clock jitter), so single short forwards rarely agree and their table
# could never be cached. A forward longer than MIN_TIMING_S is timed alone, as before.
MIN_TIMING_S = 0.15
MAX_REPEATS = 8
MAX_GRID = 3  # measured points per axis (rows; verify tokens); the rest is interpolated
# Drafter forwards timed: its steps (1 and 2 tokens), a catch-up shared by all rows (at most
# SHARED_CATCH_UP tokens) and a row's own catch-up (a deferred prefill of its prompt, or the tokens of
# a long run of plain steps), extrapolated linearly beyond the last. A catch-up longer than
# SHARED_CATCH_UP runs one row at a time (`drafters.model`), so it is timed on one row only.
DRAFT_TOKENS = [1, 2, SHARED_CATCH_UP, 128]
# A quantized drafter's prompt path (`drafters.model`: its deferred prefills) is timed on one row too,
# from one token (its fixed cost: an int8 copy of the weights read, rows padded to torch._int_mm's 17)
# to 128.
PROMPT_TOKENS = [1, SHARED_CATCH_UP, 128]
# The calibration's budget: a table has at most MAX_GRID x MAX_GRID shapes (the drafter's one more,
# its long catch-up on one row; its prompt path's table, if it has one, 3 on one row), each timed 2 to
# TRIES times, so a model pair costs at most (2 x (MAX_GRID**2 + 1) + 3) x TRIES = 69 timings of
# max(one forward, MIN_TIMING_S) each (~45 on a quiet machine, where most shapes agree at the second)
# plus a CONTEXT-token prefill and a warm-up per row count. For the bundled pair at batch 4, K 5 on a
# 2-core CPU (a 1.5B forward 0.1-0.6 s, a 0.5B one 0.05-0.2 s, its 128-token catch-up 0.3-0.7 s) that
# is ~10-20 s, at most ~30 s on a machine too busy to agree.
# A measured table is cached only if it is monotone where physics says it must be: among forwards of
# at least MONOTONE_FROM row-tokens, one with more rows or more tokens per row (the other count
# equal) may not be more than MONOTONE_SLACK cheaper (two timings, each trusted to AGREEMENT). Below
# that size CPU kernels take other paths (oneDNN's float32 product of 1-2 rows was slower than of 4,
# `kernels.PADDED_ROWS`; bfloat16's 1-row path is its fastest), so smaller shapes are recorded as
# timed and not checked.
MONOTONE_FROM = 4
MONOTONE_SLACK = 0.2
# A cached table whose smallest shape takes this many times what it takes now was measured on a
# busy machine (a contended 2-core CPU can be several times slower): measured anew, not trusted.
STALE_FACTOR = 1.3
# Rounds whose verify forwards ran more than DRIFT faster than the table predicts (the median ratio
# over the last DRIFT_ROUNDS rounds) mark the table's cache file stale: the next start re-times it.
# Only faster: the table is timed at a short context, so rounds at real contexts (longer attention)
# or on a machine busy now run slower without the table being wrong, while rounds much faster than
# it say it was timed while something else ran. This process goes on with its online rescaling;
# re-timing now would take the cores from the run.
DRIFT = 0.25
DRIFT_ROUNDS = 20
# How tables are measured: part of the cache key, so a change to `measure` retires tables measured
# the old way (docs/methods.md keeps the history).
CALIBRATION_VERSION = 8


class Costs(Protocol):
    """Seconds of the parts of a round, as the speculation policy needs them."""

    def verify_time(self, rows: int, tokens: int) -> float:
        """One target forward of `tokens` tokens for each of `rows` rows."""

    def draft_time(self, rows: int, tokens: int) -> float:
        """One drafter forward feeding `tokens` tokens to each of `rows` rows (0 without a drafter model)."""

    def prompt_time(self, tokens: int) -> float:
        """One drafter forward feeding one row `tokens` tokens on its prompt path (`draft_time`'s where
        it has none)."""

    def overhead(self) -> float:
        """Per round, outside the forwards (acceptance, commits, bookkeeping)."""

    def observe(self, rows: int, width: int, steps: int, draft_s: float, verify_s: float, other_s: float) -> None:
        """A round ran: `rows` rows verified `width` drafts each after `steps` drafter steps, taking
        these phase times."""


def wall_clock(device: torch.device) -> float:
    """Wall clock that waits for queued GPU work on `device`, so phase timings are honest on CUDA too."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
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
    AVX-512 and native bfloat16 and one with AVX2 only, a Qwen2.5 1.5B step ~5x slower."""
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
    # why the table may not be this machine's when quiet (shapes whose timings never agreed); a
    # table with doubts is used by the process that measured it, never cached
    doubts: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        # (rows, tokens) -> seconds already interpolated: the policy prices a few shapes dozens of
        # times a round, and a table is never changed once measured (not a field: never saved)
        self._known: dict[tuple[int, int], float] = {}

    def __call__(self, rows: int, tokens: int) -> float:
        seconds = self._known.get((rows, tokens))
        if seconds is None:
            by_rows = [_interp(self.tokens, line, tokens) for line in self.seconds]
            seconds = self._known[rows, tokens] = _interp(self.rows, by_rows, rows)
        return seconds

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
    lately included (with plain means, a shape measured while the machine was busy stays rated at
    that load while the shapes that run are rated at today's, and rounds draft at a loss). A shape's mean moves slowly
    once known (SHAPE_SMOOTHING), so a change of load moves the scale rather than the one shape
    that happens to run. Drafter steps (a round's drafting time mixes catch-up and steps of two
    sizes) follow their table scaled by the running ratio of measured to predicted time.

    The table itself is checked against the rounds too: when verify forwards keep running more than
    DRIFT away from what it predicts, its cache `files` are marked stale, once, for the next start.
    """

    def __init__(self, verify: TimingTable, draft: TimingTable | None, source: str = "",
                 files: tuple[Path, ...] = (), prompt: TimingTable | None = None) -> None:
        self.verify = verify
        self.draft = draft
        self.prompt = prompt  # the drafter's prompt path, one row (None: it has none)
        self.source = source  # where the tables came from, for reports
        self.files = files  # the cache files the tables were read from or written to
        self.drifted = False  # the table was found off and its files marked stale
        self._ratios: deque[float] = deque(maxlen=DRIFT_ROUNDS)  # measured / table, last rounds
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

    def prompt_time(self, tokens: int) -> float:
        """The drafter's load (`draft_scale`) carries its prompt path's table along."""
        return self.draft_time(1, tokens) if self.prompt is None else self.prompt(1, tokens) * self.draft_scale

    def overhead(self) -> float:
        return self._overhead or 0.0

    def observe(self, rows: int, width: int, steps: int, draft_s: float, verify_s: float, other_s: float) -> None:
        shape = (rows, width + 1)
        self._check_table(shape, verify_s)
        mean, count, scale_then = self.seen.get(shape, (0.0, 0, 1.0))
        expected = self.verify_time(*shape)
        if expected > 0 and verify_s > 0:  # a round of a shape known well tells the load
            ratio = min(max(verify_s / expected, SCALE_BOUNDS[0]), SCALE_BOUNDS[1])
            self.verify_scale = min(max(self.verify_scale * (1 + SMOOTHING * _trust(count) * (ratio - 1)),
                                        SCALE_BOUNDS[0]), SCALE_BOUNDS[1])
        now = mean * self.verify_scale / scale_then  # the mean at today's load
        self.seen[shape] = (now + max(SHAPE_SMOOTHING, 1 / (count + 1)) * (verify_s - now), count + 1, self.verify_scale)
        if steps and self.draft is not None:
            predicted = drafting_time(self.draft, rows, steps)  # the table's own, unscaled
            self.draft_scale = _rescaled(self.draft_scale, draft_s, predicted)
        self._overhead = other_s if self._overhead is None else (1 - SMOOTHING) * self._overhead + SMOOTHING * other_s

    def _check_table(self, shape: tuple[int, int], verify_s: float) -> None:
        """Compare a round's verify time with the table's own prediction (not the rescaled one, which
        follows the rounds): the median over DRIFT_ROUNDS rounds, so that a GC pause or a burst of
        load does not retire a good table; only rounds faster than it (DRIFT) retire it."""
        predicted = self.verify(*shape)
        if self.drifted or predicted <= 0 or verify_s <= 0:
            return
        self._ratios.append(verify_s / predicted)
        ratio = statistics.median(self._ratios)
        if len(self._ratios) == DRIFT_ROUNDS and ratio < 1 - DRIFT:
            self.drifted = True
            mark_stale(self.files, f"verify forwards ran {ratio:.2f}x its prediction over {DRIFT_ROUNDS} rounds")


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
    """At most MAX_GRID points from 1 to `top`: both ends and `base`, then powers of two between
    them, spread evenly."""
    kept = sorted({1, top, *(b for b in base if b < top)})
    between = [2**i for i in range(1, top.bit_length()) if 2**i < top and 2**i not in kept]
    room = min(max(MAX_GRID - len(kept), 0), len(between))
    picked = {between[round((i + 1) * (len(between) + 1) / (room + 1)) - 1] for i in range(room)}
    return sorted({*kept, *picked})


def shapes(rows: list[int], tokens: list[int], all_logits: bool) -> list[tuple[int, int]]:
    """The (rows, tokens) forwards `measure` times: every one of a verify table; a drafter's
    catch-ups longer than SHARED_CATCH_UP on one row only, as the drafter runs them."""
    return [(r, n) for r in rows for n in tokens if all_logits or r == 1 or n <= SHARED_CATCH_UP]


def settled(timings: list[float]) -> float | None:
    """A shape's time: the faster of its fastest two timings that agree within AGREEMENT (None
    while no two do)."""
    ordered = sorted(timings)
    return next((a for a, b in zip(ordered, ordered[1:]) if b <= a * (1 + AGREEMENT)), None)


def agreed(timings: list[float]) -> bool:
    return settled(timings) is not None


@torch.inference_mode()
def measure(model: torch.nn.Module, rows: list[int], tokens: list[int], all_logits: bool,
            prompt: bool = False) -> TimingTable:
    """Time one forward of each shape (`shapes`) through the layout the engine runs the model on
    (ragged, or stateful for a model with recurrent state), after CONTEXT committed tokens per row;
    `all_logits` as a verify forward (every position's logits) rather than a drafter step (the last
    position's only); `prompt`: on the model's prompt path (`roles.prompt_pass`). Shapes whose
    timings never agreed are named in the table's `doubts`.

    Shapes are timed in interleaved passes, each pass timing the shapes not yet agreed, so a burst
    of load on a shared machine hits every pending shape alike instead of one. A shape with more
    rows or tokens may well be the cheaper one, and is recorded so: oneDNN's packed float32 product
    of one or two rows was slower than that of three to six (`kernels.PADDED_ROWS`). Rating such a
    shape as dear as the smaller one made a 4-row plain step look as dear as a 4-row verify of two
    tokens, and adaptive speculation verified drafts at batch 4 that did not pay."""
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

    def seconds(r: int, n: int) -> float:
        """The mean time of forwards of r rows x n tokens (each from the same context) run back to
        back until MIN_TIMING_S has passed or MAX_REPEATS ran."""
        layout = layouts[r]
        base = layout.lengths.clone()
        feed = torch.full((r, n), ids[-1], dtype=torch.long, device=device)
        start = wall_clock(device)
        for repeats in range(1, MAX_REPEATS + 1):
            with prompt_pass() if prompt else contextlib.nullcontext():
                layout.forward(feed, last_only=not all_logits)
            layout.commit(base)
            elapsed = wall_clock(device) - start
            if elapsed >= MIN_TIMING_S:
                break
        return elapsed / repeats

    timed = shapes(rows, tokens, all_logits)
    timings: dict[tuple[int, int], list[float]] = {shape: [] for shape in timed}
    with tqdm(total=len(timed), unit="shape", file=sys.stderr, leave=False, disable=None,
              desc=f"timing {type(model).__name__} forwards") as bar:
        for r in rows:
            seconds(r, tokens[0])  # warm-up: lazy initialisation is no shape's cost
        for _ in range(TRIES):
            for shape in [s for s in timed if not agreed(timings[s])]:
                timings[shape].append(seconds(*shape))
                bar.update(int(agreed(timings[shape])))
    best = {shape: settled(t) or min(t) for shape, t in timings.items()}
    doubts = [f"{r}x{n}'s timings never agreed ({', '.join(f'{t * 1e3:.1f}' for t in sorted(timings[r, n]))} ms)"
              for r, n in timed if not agreed(timings[r, n])]
    seconds_by_shape = [[best[r, n] if (r, n) in best else _one_by_one(best, r, n) for n in tokens] for r in rows]
    return TimingTable(rows, tokens, seconds_by_shape, doubts)


def _one_by_one(best: dict[tuple[int, int], float], rows: int, tokens: int) -> float:
    """A drafter forward of `rows` rows x `tokens` tokens, longer than a shared catch-up: never run
    (such catch-ups run one row at a time) and not timed, but the table is rectangular. Rated as the
    longest shared one plus each row's extra tokens at one row's rate."""
    shared = max(fed for many, fed in best if many == rows)
    return best[rows, shared] + rows * max(0.0, best[1, tokens] - best[1, shared])


def monotone_faults(table: TimingTable) -> list[str]:
    """Neighbouring shapes of at least MONOTONE_FROM row-tokens where the one with more rows or more
    tokens per row took less time beyond noise (MONOTONE_SLACK): physics says it cannot, so the
    machine was busier for one than for the other."""
    faults = []
    for i, r in enumerate(table.rows):
        for j, n in enumerate(table.tokens):
            if r * n < MONOTONE_FROM:
                continue
            for bi, bj in ((i + 1, j), (i, j + 1)):
                if bi < len(table.rows) and bj < len(table.tokens):
                    more, less = table.seconds[bi][bj], table.seconds[i][j]
                    if more * (1 + MONOTONE_SLACK) < less:
                        faults.append(f"{table.rows[bi]}x{table.tokens[bj]} took {more * 1e3:.1f} ms, "
                                      f"less than {r}x{n}'s {less * 1e3:.1f} ms")
    return faults


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


def say(message: str) -> None:
    """One line on stderr, terminal or not (a log file, a notebook, a service's journal), above any
    progress bar drawn there; a process without a usable stderr decodes on without it."""
    if sys.stderr is not None:
        with contextlib.suppress(OSError, ValueError):  # a closed stream or a broken pipe
            tqdm.write(f"batchspec: {message}", file=sys.stderr)
            sys.stderr.flush()


_MEMO: dict[str, TimingTable] = {}


def _cached_table(path: Path) -> tuple[TimingTable | None, str | None]:
    """The table in a cache file, if it holds a well-formed one, and why it was marked stale, if it was."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("stale"):
            return None, str(data["stale"])
        table = TimingTable(**data["table"])
        sizes = [len(line) for line in table.seconds]
        if not (table.rows and table.tokens and sizes == [len(table.tokens)] * len(table.rows)
                and all(t >= 0 for line in table.seconds for t in line)):
            return None, None
        return table, None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None, None  # missing or unreadable: measure again


_FOUND_OFF: set[tuple[Path, ...]] = set()  # tables already found off in this process


def mark_stale(files: tuple[Path, ...], why: str) -> None:
    """Flag cache files so that the next `calibrated` measures anew, and say so, once per process
    (every engine of a bench reads the same table). A file that cannot be rewritten is removed; one
    that can be neither is left to the start-up check."""
    if files in _FOUND_OFF:
        return
    _FOUND_OFF.add(files)
    marked = 0
    for path in files:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            data["stale"] = why
            path.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
            marked += 1
        except (OSError, ValueError, TypeError):
            with contextlib.suppress(OSError):
                path.unlink()
                marked += 1
    done = "its cache marked stale: the next start re-times it" if marked else "it was not cached"
    say(f"the cost table is off ({why}); {done}")


@dataclass
class _Calibration:
    """One model's timing table as it is looked up and, if need be, measured."""

    model: torch.nn.Module
    rows: int
    tokens: list[int]
    all_logits: bool
    prompt: bool = False  # the model's prompt path (`measure`)
    table: TimingTable | None = None
    where: str = "measured"
    parts: dict = field(init=False)  # what the table depends on (`fingerprint`), its cache key's source
    path: Path = field(init=False)  # its cache file

    def __post_init__(self) -> None:
        self.parts = fingerprint(self.model) | {"all_logits": self.all_logits, "calibration": CALIBRATION_VERSION}
        if self.prompt:
            self.parts["prompt_path"] = True
        self.path = costs_dir() / f"{hashlib.sha256(json.dumps(self.parts, sort_keys=True).encode()).hexdigest()[:20]}.json"

    @property
    def role(self) -> str:
        return "target" if self.all_logits else "drafter prompt path" if self.prompt else "drafter"

    def measure(self, measure_fn: Callable[..., TimingTable], rows: list[int], tokens: list[int]) -> TimingTable:
        """`measure_fn` on this model, asked for the prompt path only where this table is of it."""
        extra = {"prompt": True} if self.prompt else {}
        return measure_fn(self.model, rows, tokens, self.all_logits, **extra)


def calibrated(model: torch.nn.Module, rows: int, tokens: list[int], all_logits: bool, fresh: bool = False,
               measure_fn: Callable[..., TimingTable] = measure) -> tuple[TimingTable, str]:
    """The model's timing table covering up to `rows` rows and the `tokens` grid: from this
    process, from the cache file, or measured now (and cached if it checks out); `fresh` measures
    anew whatever is cached. Returns it and where it came from."""
    found = _calibrate([_Calibration(model, rows, tokens, all_logits)], fresh, measure_fn)[0]
    assert found.table is not None  # _calibrate leaves none unmeasured
    return found.table, found.where


def _calibrate(wanted: list[_Calibration], fresh: bool, measure_fn: Callable[..., TimingTable]) -> list[_Calibration]:
    """Look each table up, then measure those missing, announced in one line and reported in one."""
    for c in wanted:
        _look_up(c, fresh, measure_fn)
    missing = [c for c in wanted if c.table is None]
    if not missing:
        return wanted
    started = time.perf_counter()
    counts = [len(shapes(grid(c.rows), c.tokens, c.all_logits)) for c in missing]
    plans = ", ".join(f"{c.role} {type(c.model).__name__}: {n} shapes up to {c.rows} rows x {max(c.tokens)} tokens"
                      for c, n in zip(missing, counts))
    say(f"timing forwards once for this machine ({plans}; each until two timings agree, at most "
        f"{TRIES * sum(counts)} timings: ~10-30 s for the bundled pair on a 2-core CPU, less on a GPU; "
        "left out of the decoding figures)")
    for c in missing:
        c.table = c.measure(measure_fn, grid(c.rows), c.tokens)
        c.where = _keep(c)
    ended = "; ".join(f"{c.role} {c.where}" for c in missing)
    say(f"cost calibration took {time.perf_counter() - started:.1f} s: {ended}")
    return wanted


def _look_up(c: _Calibration, fresh: bool, measure_fn: Callable[..., TimingTable]) -> None:
    """This process's table, or the cache file's if it covers the shapes and its smallest shape still
    takes what it took: a table measured while something else loaded the machine would have adaptive
    speculation decline drafts that pay, for good (a policy that never drafts never observes a
    drafter step to correct it by). Leaves `c.table` None, and `c.where` saying why, when measuring."""
    memo = None if fresh else _MEMO.get(c.path.stem)
    if memo is not None and memo.covers(c.rows, max(c.tokens)):
        c.table, c.where = memo, f"cached {c.path}" if not memo.doubts else "measured earlier in this process"
        return
    table, stale = (None, None) if fresh or memo is not None else _cached_table(c.path)
    if stale:
        c.where = f"re-measured (the cached table was marked stale: {stale})"
    if table is None or not table.covers(c.rows, max(c.tokens)):
        return
    was, now = table(1, c.tokens[0]), c.measure(measure_fn, [1], c.tokens[:1])(1, c.tokens[0])
    if was <= STALE_FACTOR * now:
        _MEMO[c.path.stem] = table
        c.table, c.where = table, f"cached {c.path}"
    else:
        c.where = f"re-measured (the cached table's {was * 1e3:.1f} ms took {now * 1e3:.1f} ms now)"


def _keep(c: _Calibration) -> str:
    """Keep a measured table for this process, and in the cache file if it checks out (timings that
    agreed, monotone where it must be). Returns where it went."""
    assert c.table is not None
    _MEMO[c.path.stem] = c.table
    faults = c.table.doubts + monotone_faults(c.table)
    if faults:
        more = f" and {len(faults) - 1} more" if len(faults) > 1 else ""
        return f"{c.where}, not cached, used for this run only ({faults[0]}{more}: was the machine busy?)"
    try:
        c.path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps({"fingerprint": c.parts, "table": asdict(c.table)}, indent=1) + "\n"
        c.path.write_text(text, encoding="utf-8")
        return f"{c.where}, cached in {c.path}"
    except OSError:
        return f"{c.where} (cache dir not writable)"


def measured_costs(target: torch.nn.Module, draft: torch.nn.Module | None, rows: int, max_drafts: int,
                   fresh: bool = False, measure_fn: Callable[..., TimingTable] = measure) -> MeasuredCosts:
    """Costs of rounds of up to `rows` rows and `max_drafts` drafts each (verify feeds max_drafts + 1)."""
    wanted = [_Calibration(target, rows, grid(max_drafts + 1, (2,)), all_logits=True)]
    if draft is not None:
        limit = context_limit(draft)  # a catch-up longer than the context can neither happen nor be measured

        def fitting(tokens: list[int]) -> list[int]:
            return [n for n in tokens if limit is None or n + CONTEXT <= limit]

        wanted.append(_Calibration(draft, rows, fitting(DRAFT_TOKENS), all_logits=False))
        if has_prompt_path(draft):
            wanted.append(_Calibration(draft, 1, fitting(PROMPT_TOKENS), all_logits=False, prompt=True))
    found = _calibrate(wanted, fresh, measure_fn)
    tables = [c.table for c in found]
    where = found[0].where if draft is None else "; ".join(f"{c.role} {c.where}" for c in found)
    return MeasuredCosts(tables[0], tables[1] if draft is not None else None, where,
                         files=tuple(c.path for c in found), prompt=tables[2] if len(tables) > 2 else None)


def drafting_time(draft_time: Callable[[int, int], float], rows: int, steps: int) -> float:
    """Seconds of `steps` drafter steps over `rows` rows, given a drafter forward's time by (rows,
    tokens per row): the first step feeds two tokens per row (the pending token and the one before
    it), the rest one."""
    return 0.0 if steps == 0 else draft_time(rows, 2) + (steps - 1) * draft_time(rows, 1)


def round_time(costs: Costs, rows: int, width: int, steps: int) -> float:
    """Seconds of a round of `rows` rows verifying `width` drafts each after `steps` drafter steps:
    the one formula the speculation policy and `break_even` price rounds by."""
    return drafting_time(costs.draft_time, rows, steps) + costs.verify_time(rows, width + 1) + costs.overhead()


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
