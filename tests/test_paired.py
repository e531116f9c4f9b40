"""Paired speed ratios over repeated bench runs (`batchspec.bench.paired`): pairing by repeat, the
interval, the verdict and the choice of baseline. Scripted timings only: no model runs here."""

from __future__ import annotations

import math

import pytest
from scipy import stats

from batchspec.bench.methods import MethodSpec
from batchspec.bench.paired import paired_speedups, plain_baseline, ratio, render_paired
from batchspec.bench.runner import ALL, MethodResult, Timing


def test_ratio_is_the_geometric_mean_with_a_t_interval_on_logs() -> None:
    samples = [1.02, 0.97, 1.05, 0.99]
    r = ratio(samples)
    logs = [math.log(x) for x in samples]
    low, high = stats.t.interval(0.95, len(logs) - 1, loc=sum(logs) / len(logs), scale=stats.sem(logs))
    assert r.mean == pytest.approx(math.prod(samples) ** (1 / len(samples)))
    assert (r.low, r.high) == (pytest.approx(math.exp(low)), pytest.approx(math.exp(high)))
    assert r.verdict == "within noise"
    assert ratio([0.9, 0.91, 0.92]).verdict == "slower"
    assert ratio([1.2, 1.25, 1.22]).verdict == "faster"
    single = ratio([0.95])
    assert single.low is None and single.high is None and single.verdict == "one repeat"
    assert single.as_dict()["samples"] == [0.95]


def _run(spec: MethodSpec, walls: dict[str, float], prefill: float = 1.0) -> MethodResult:
    return MethodResult(spec, [], {part: Timing(w, prefill) for part, w in walls.items()}, [], [])


def test_pairs_each_repeat_with_the_plain_run_of_the_same_pass() -> None:
    """The machine's speed changes between repeats (by up to 1.5x); the method is 10% slower than
    plain decoding in every pass. Paired, that is 0.909x in every repeat, an interval of no width
    and "slower", whatever the pass's speed."""
    plain, spec, alone = MethodSpec("ar", 4, "continuous"), MethodSpec("ragged", 4), MethodSpec("ragged", 2)
    parts = ["qa", "math"]
    scale = [1.0, 1.5, 1.2]  # the machine's speed in each repeat
    runs: dict[MethodSpec, list[MethodResult]] = {plain: [], spec: [], alone: []}
    for s in scale:
        for part in parts:
            base = {"qa": 4.0, "math": 6.0}[part] * s
            runs[plain].append(_run(plain, {part: base}, prefill=1.0 * s))
            runs[spec].append(_run(spec, {part: 1.1 * base}, prefill=1.1 * s))
            runs[alone].append(_run(alone, {part: base}))
    entries = paired_speedups(runs, parts, repeats=len(scale))
    assert [e["method"] for e in entries] == ["ragged@4"]  # ragged@2 has no plain run at batch 2
    entry = entries[0]
    assert entry["baseline"] == "ar+continuous@4" and entry["repeats"] == 3
    assert set(entry["parts"]) == {ALL, "qa", "math"}
    for figures in entry["parts"].values():
        for key in ("end_to_end", "decode"):
            fig = figures[key]
            assert fig["samples"] == [pytest.approx(1 / 1.1, abs=1e-4)] * 3, key
            assert fig["low"] == pytest.approx(fig["high"]) == pytest.approx(1 / 1.1, abs=1e-4)
            assert fig["verdict"] == "slower"
    table = render_paired(entries)
    assert "Paired with plain decoding" in table and "ar+continuous@4" in table and "0.909x" in table
    assert render_paired([]) == ""


def test_whole_run_ratio_sums_the_parts_of_each_repeat() -> None:
    plain, spec = MethodSpec("ar", 1), MethodSpec("ragged", 1)
    parts = ["qa", "math"]
    runs = {plain: [_run(plain, {"qa": 2.0}, 0.0), _run(plain, {"math": 8.0}, 0.0),
                    _run(plain, {"qa": 2.0}, 0.0), _run(plain, {"math": 8.0}, 0.0)],
            spec: [_run(spec, {"qa": 1.0}, 0.0), _run(spec, {"math": 9.0}, 0.0),
                   _run(spec, {"qa": 2.0}, 0.0), _run(spec, {"math": 8.0}, 0.0)]}
    entry = paired_speedups(runs, parts, repeats=2)[0]
    assert entry["parts"]["qa"]["end_to_end"]["samples"] == [2.0, 1.0]
    assert entry["parts"]["math"]["end_to_end"]["samples"] == [pytest.approx(8 / 9, abs=1e-4), 1.0]
    assert entry["parts"][ALL]["end_to_end"]["samples"] == [1.0, 1.0]  # 10 s against 10 s in both passes


def test_a_failed_run_pairs_nothing_and_the_baseline_prefers_the_same_scheduler() -> None:
    static, continuous, spec = MethodSpec("ar", 4, "static"), MethodSpec("ar", 4, "continuous"), MethodSpec("ragged", 4)
    assert plain_baseline(spec, [static, continuous, spec]) == continuous
    assert plain_baseline(spec, [static, spec]) == static
    assert plain_baseline(MethodSpec("eqspec", 4), [static, continuous]) == static
    assert plain_baseline(spec, [MethodSpec("ar", 4, "continuous", prefill_chunk=8), spec]) is None
    runs = {continuous: [_run(continuous, {ALL: 5.0}), _run(continuous, {ALL: 5.0})],
            spec: [_run(spec, {ALL: 4.0}), MethodResult(spec, error="boom")]}
    assert paired_speedups(runs, [ALL], repeats=2) == []
