"""Paired speed ratios over repeated bench runs: each speculative method against plain decoding at
its own batch size, repeat by repeat, with a confidence interval.

Why: "never slower than plain decoding" is a claim about a ratio near 1.00 on a machine whose speed
drifts 5-10% between minutes. The fastest run of each method (`runner.fastest_of`) is the least
disturbed figure, but one ratio of two fastest runs cannot say whether 0.98x is a loss or noise.
Within one repeat a method and its baseline run on the same part in the same pass, minutes apart,
so the ratio of their times in that repeat is a paired sample; over repeats the log ratios give a
Student-t interval for the geometric mean ratio (a t interval because repeats are few). An interval
whose upper end is below 1 says slower at that confidence; one that straddles 1 says the runs cannot
tell the method from plain decoding.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from scipy import stats

from .methods import MethodSpec
from .report import format_table
from .runner import ALL, MethodResult

CONFIDENCE = 0.95


@dataclass(frozen=True)
class Ratio:
    """Speedups (baseline time / method time) of one method over repeats: per repeat, their
    geometric mean, and its confidence interval (None with fewer than two repeats)."""

    samples: tuple[float, ...]
    mean: float
    low: float | None
    high: float | None

    @property
    def verdict(self) -> str:
        if self.low is None or self.high is None:
            return "one repeat"
        if self.high < 1.0:
            return "slower"
        if self.low > 1.0:
            return "faster"
        return "within noise"

    def as_dict(self) -> dict:
        return {"samples": [round(x, 4) for x in self.samples], "mean": round(self.mean, 4),
                "low": None if self.low is None else round(self.low, 4),
                "high": None if self.high is None else round(self.high, 4), "verdict": self.verdict}


def ratio(speedups: Sequence[float], confidence: float = CONFIDENCE) -> Ratio:
    """Geometric mean of per-repeat speedups and a Student-t interval on their logarithms."""
    logs = [math.log(x) for x in speedups]
    n = len(logs)
    mean = sum(logs) / n
    if n < 2:
        return Ratio(tuple(speedups), math.exp(mean), None, None)
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / (n - 1))
    half = float(stats.t.ppf(0.5 + confidence / 2, n - 1)) * sd / math.sqrt(n)
    return Ratio(tuple(speedups), math.exp(mean), math.exp(mean - half), math.exp(mean + half))


def plain_baseline(spec: MethodSpec, specs: Sequence[MethodSpec]) -> MethodSpec | None:
    """Plain decoding (`ar`) at `spec`'s batch size, on its scheduler if measured, else on any."""
    plain = [s for s in specs if s.method == "ar" and s.batch_size == spec.batch_size and s.prefill_chunk is None]
    same = [s for s in plain if s.scheduler == spec.scheduler]
    return (same or plain or [None])[0]


def _times(results: Sequence[MethodResult], parts: Sequence[str], repeats: int, label: str,
           decode: bool) -> list[float] | None:
    """Per repeat, seconds of `label` (a part, or ALL: every part summed) in one method's runs,
    which `bench` appends repeat by repeat, part by part."""
    if any(r.error is not None for r in results) or len(results) != repeats * len(parts):
        return None
    wanted = list(parts) if label == ALL else [label]
    out = []
    for r in range(repeats):
        timings = [results[r * len(parts) + parts.index(p)].timings[p] for p in wanted]
        out.append(sum(t.wall - (t.prefill if decode else 0.0) for t in timings))
    return out


def paired_speedups(runs: dict[MethodSpec, list[MethodResult]], parts: Sequence[str],
                    repeats: int) -> list[dict]:
    """For every speculative method with a plain baseline at its batch size: end-to-end and
    decode-only paired ratios, overall and per part (when there are several)."""
    specs = list(runs)
    labels = [ALL] if parts == [ALL] else [ALL, *parts]
    out = []
    for spec in specs:
        base = plain_baseline(spec, specs)
        if not spec.speculative or spec.is_baseline or base is None:
            continue
        entry: dict = {"method": spec.name, "baseline": base.name, "repeats": repeats, "parts": {}}
        for label in labels:
            figures = {}
            for key, decode in (("end_to_end", False), ("decode", True)):
                mine = _times(runs[spec], parts, repeats, label, decode)
                theirs = _times(runs[base], parts, repeats, label, decode)
                if mine is None or theirs is None or min(mine) <= 0 or min(theirs) <= 0:
                    break
                figures[key] = ratio([b / m for b, m in zip(theirs, mine)]).as_dict()
            if len(figures) == 2:
                entry["parts"][label] = figures
        if entry["parts"]:
            out.append(entry)
    return out


def _span(r: dict) -> str:
    return "-" if r["low"] is None else f"{r['low']:.3f}-{r['high']:.3f}"


def render_paired(entries: list[dict]) -> str:
    """A table: per method and part, the geometric mean speedup over plain decoding at the same batch
    size, its interval, and each repeat's ratio ("" when there is nothing to pair)."""
    rows = []
    for e in entries:
        for label, fig in e["parts"].items():
            whole, dec = fig["end_to_end"], fig["decode"]
            rows.append([e["method"], e["baseline"], label, f"{whole['mean']:.3f}x", _span(whole),
                         f"{dec['mean']:.3f}x", _span(dec), whole["verdict"],
                         " ".join(f"{x:.3f}" for x in whole["samples"])])
    if not rows:
        return ""
    title = ("Paired with plain decoding at the same batch size: per repeat, the plain run's time / the method's "
             f"(same part, same pass); geometric mean over repeats and its Student-t {CONFIDENCE:.0%} interval")
    return title + "\n" + format_table(
        ["method", "vs", "part", "end to end", "interval", "decode", "interval", "verdict", "per repeat"], rows)
