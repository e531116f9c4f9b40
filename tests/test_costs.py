"""The cost model: interpolation, calibration and its cache, online rescaling, break-even rates. No
assertion here depends on how fast anything ran."""

from __future__ import annotations

import pytest
from tinyworld import ScriptedCosts, tiny_model, tiny_stateful_model

from batchspec import costs as costs_module
from batchspec.bench.report import render_costs
from batchspec.costs import (
    SCALE_BOUNDS,
    STALE_FACTOR,
    MeasuredCosts,
    TimingTable,
    break_even,
    calibrated,
    fingerprint,
    grid,
    measure,
)
from batchspec.layouts.ragged import RaggedLayout


def test_timing_table_interpolates_and_extends_linearly():
    table = TimingTable([1, 4], [1, 3], [[1.0, 2.0], [4.0, 8.0]])
    assert table(1, 1) == 1.0 and table(4, 3) == 8.0
    assert table(1, 2) == pytest.approx(1.5)
    assert table(2, 1) == pytest.approx(2.0)
    assert table(8, 3) == pytest.approx(16.0)  # past the grid: the last segment extended
    assert TimingTable([1, 2], [1], [[5.0], [1.0]])(10, 1) == 0.0  # never negative
    assert table.covers(4, 3) and not table.covers(5, 3) and not table.covers(4, 4)


def test_grid_keeps_both_ends_and_few_points():
    assert grid(1) == [1]
    assert grid(4) == [1, 2, 4]
    assert grid(6, (2,)) == [1, 2, 4, 6]
    for top in (3, 8, 32, 100):
        points = grid(top)
        assert points[0] == 1 and points[-1] == top and len(points) <= 4 and points == sorted(set(points))


@pytest.mark.parametrize("arch", ["qwen2", "mamba2"])
def test_measure_times_every_shape_through_the_layout(arch):
    model = tiny_model(arch, vocab_size=50) if arch == "qwen2" else tiny_stateful_model(arch, vocab_size=50)
    table = measure(model, [1, 3], [1, 2, 4], all_logits=True)
    assert table.rows == [1, 3] and table.tokens == [1, 2, 4]
    assert all(len(line) == 3 and all(t > 0 for t in line) for line in table.seconds)


def test_measure_records_each_shape_as_timed_even_where_more_work_is_faster(monkeypatch):
    """oneDNN's packed float32 product of 1-2 rows is slower than that of 3-6: a table that rated
    a 4-row plain step as dear as a 2-row one made adaptive speculation draft where it did not pay.
    With a scripted clock: every shape keeps its own fastest time, however it compares with smaller ones."""
    now = [0.0]
    forwards: list[tuple[int, int]] = []

    def seconds(rows: int, tokens: int) -> float:
        work = rows * tokens
        return (2.0 if work < 3 else 1.0 + 0.1 * work) + (5.0 if len(forwards) == 20 else 0.0)  # one burst of load

    original = RaggedLayout.forward

    def timed_forward(self, tokens, **kwargs):
        forwards.append(tuple(tokens.shape))
        now[0] += seconds(*tokens.shape)
        return original(self, tokens, **kwargs)

    monkeypatch.setattr(RaggedLayout, "forward", timed_forward)
    monkeypatch.setattr(costs_module, "wall_clock", lambda model: now[0])
    table = measure(tiny_model("qwen2", vocab_size=50), [1, 2, 4], [1, 2, 4], all_logits=True)
    assert len(forwards) == 9 * (1 + costs_module.REPEATS)  # a warm-up pass, then the timed ones
    assert table.seconds == [[pytest.approx(seconds(r, t)) for t in [1, 2, 4]] for r in [1, 2, 4]]
    assert table(4, 1) < table(2, 1) and table(1, 4) < table(1, 2)


def test_calibration_is_cached_per_model_and_refreshed_when_it_does_not_cover(tmp_path, monkeypatch):
    monkeypatch.setattr(costs_module, "costs_dir", lambda: tmp_path)
    monkeypatch.setattr(costs_module, "_MEMO", {})
    calls: list[tuple[list[int], list[int]]] = []

    def fake(model, rows, tokens, all_logits):
        calls.append((rows, tokens))
        return TimingTable(rows, tokens, [[0.1 * r * t for t in tokens] for r in rows])

    llama, gpt2 = tiny_model("llama", vocab_size=50), tiny_model("gpt2", vocab_size=50)
    table, where = calibrated(llama, 4, [1, 2, 4, 6], True, measure_fn=fake)
    assert calls == [([1, 2, 4], [1, 2, 4, 6])] and "measured" in where
    assert len(list(tmp_path.glob("*.json"))) == 1
    monkeypatch.setattr(costs_module, "_MEMO", {})  # a new process: the file answers
    again, where = calibrated(llama, 2, [1, 2, 3], True, measure_fn=fake)
    assert again == table and "cached" in where
    assert calls[1:] == [([1], [1])]  # one quick forward checks the file's table
    calibrated(llama, 8, [1, 2, 6], True, measure_fn=fake)  # more rows than measured: measure again
    calibrated(gpt2, 2, [1, 3], True, measure_fn=fake)  # another model: its own entry
    calibrated(llama, 2, [1, 2], False, measure_fn=fake)  # drafter steps are timed apart from verifies
    calibrated(llama, 2, [1, 2, 7], True, measure_fn=fake)  # more tokens than measured: measure again
    calibrated(llama, 2, [1, 3], True, fresh=True, measure_fn=fake)
    assert [c[0] for c in calls[2:]] == [[1, 2, 4, 8], [1, 2], [1, 2], [1, 2], [1, 2]]
    assert [c[1] for c in calls[2:]] == [[1, 2, 6], [1, 3], [1, 2], [1, 2, 7], [1, 3]]
    assert fingerprint(llama) != fingerprint(gpt2)
    assert fingerprint(llama) == fingerprint(tiny_model("llama", vocab_size=50))


def test_cost_tables_are_kept_apart_per_instruction_set(monkeypatch):
    """Two CPUs sold under one name ("AMD EPYC": one with AVX-512 and native bfloat16, one with AVX2
    only, each this project's machine on some day) differ several-fold in cost: a table measured on
    one must not be read on the other."""
    import torch

    llama = tiny_model("llama")
    here = fingerprint(llama)
    isa, bf16 = torch.backends.cpu.get_cpu_capability(), costs_module.native_bfloat16()
    assert isa in costs_module.cpu_description()
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512" if isa != "AVX512" else "AVX2")
    other_isa = fingerprint(llama)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: isa)
    monkeypatch.setattr(costs_module, "native_bfloat16", lambda: not bf16)
    other_bf16 = fingerprint(llama)
    assert len({here["hardware"], other_isa["hardware"], other_bf16["hardware"]}) == 3


def test_a_cached_table_measured_on_a_busy_machine_is_measured_anew(tmp_path, monkeypatch):
    monkeypatch.setattr(costs_module, "costs_dir", lambda: tmp_path)
    monkeypatch.setattr(costs_module, "_MEMO", {})
    speed = {"ms": 0.3}  # seconds per row-token the fake machine takes now
    calls: list[list[int]] = []

    def fake(model, rows, tokens, all_logits):
        calls.append(rows)
        return TimingTable(rows, tokens, [[speed["ms"] * r * t for t in tokens] for r in rows])

    model = tiny_model("qwen2", vocab_size=50)
    calibrated(model, 2, [1, 2], True, measure_fn=fake)  # measured while the machine was busy
    speed["ms"] = 0.3 / (STALE_FACTOR - 0.05)  # quieter, but within the tolerance: kept
    monkeypatch.setattr(costs_module, "_MEMO", {})
    table, where = calibrated(model, 2, [1, 2], True, measure_fn=fake)
    assert table(1, 1) == pytest.approx(0.3) and where.startswith("cached")
    speed["ms"] = 0.1  # three times faster now: the busy table is replaced, in the file too
    monkeypatch.setattr(costs_module, "_MEMO", {})
    table, where = calibrated(model, 2, [1, 2], True, measure_fn=fake)
    assert table(1, 1) == pytest.approx(0.1) and where.startswith("re-measured (the cached table's 300.0 ms")
    assert calls == [[1, 2], [1], [1], [1, 2]]
    monkeypatch.setattr(costs_module, "_MEMO", {})
    assert calibrated(model, 2, [1, 2], True, measure_fn=fake)[0](1, 1) == pytest.approx(0.1)
    assert calls[4:] == [[1]]  # read from the file again: the new table, checked, trusted


def test_online_refresh_follows_the_load_and_each_shapes_own_cost():
    verify = TimingTable([1, 4], [1, 6], [[1.0, 2.0], [2.0, 4.0]])
    draft = TimingTable([1, 4], [1, 2], [[0.1, 0.15], [0.2, 0.3]])
    costs = MeasuredCosts(verify, draft)
    assert costs.verify_time(4, 1) == 2.0 and costs.draft_time(4, 2) == pytest.approx(0.3)
    # the table rates a 4-row verify of 2 tokens 2.4 s (interpolated); it takes 3.6: its rounds say so
    for _ in range(200):
        costs.observe(4, 0, 0, draft_s=0.0, verify_s=2.0, other_s=0.01)
        costs.observe(4, 1, 1, draft_s=2 * 0.3, verify_s=3.6, other_s=0.01)
    assert costs.verify_time(4, 1) == pytest.approx(2.0, rel=0.02)
    assert costs.verify_time(4, 2) == pytest.approx(3.6, rel=0.02)
    assert costs.draft_scale == pytest.approx(2.0, rel=1e-3) and costs.overhead() == pytest.approx(0.01)
    # the machine becomes twice as fast while only plain steps run: the verify shape follows the load
    # (kept at its own old mean, it would be rated twice what it costs now)
    for _ in range(100):
        costs.observe(4, 0, 0, draft_s=0.0, verify_s=1.0, other_s=0.0)
    assert costs.verify_time(4, 1) == pytest.approx(1.0, rel=0.02)
    assert costs.verify_time(4, 2) == pytest.approx(1.8, rel=0.1)
    for _ in range(300):  # one absurd round after another moves the load no further than the bound
        costs.observe(4, 0, 0, draft_s=0.0, verify_s=1e6, other_s=0.0)
    assert costs.verify_scale == pytest.approx(SCALE_BOUNDS[1], rel=1e-3)
    assert costs.draft_scale == pytest.approx(2.0, rel=1e-3)  # rounds without drafter steps leave it
    assert MeasuredCosts(verify, None).draft_time(4, 1) == 0.0  # no drafter model: drafting is free


def test_break_even_is_where_one_more_draft_neither_helps_nor_hurts():
    costs = ScriptedCosts(verify_base=1.0, verify_token=0.2, draft_step=0.3)
    for rows in (1, 4):
        for k in (1, 2, 4):
            rate = break_even(costs, rows, k)
            drafting = 0.3 * k
            plain = costs.verify_time(rows, 1)
            assert sum(rate**i for i in range(k + 1)) / (drafting + costs.verify_time(rows, k + 1)) == pytest.approx(
                1 / plain, rel=1e-6)
    assert break_even(ScriptedCosts(1.0, 0.0, 0.0), 1, 3) == pytest.approx(0.0, abs=1e-9)


def test_cost_report_names_times_and_break_even_rates():
    costs = MeasuredCosts(TimingTable([1, 4], [1, 6], [[0.39, 0.88], [0.6, 2.0]]),
                          TimingTable([1, 4], [1, 2, 16, 128], [[0.16, 0.2, 0.25, 0.5], [0.2, 0.25, 0.6, 2.0]]),
                          "measured here")
    text = render_costs(costs, [1, 4], 5)
    assert "measured here" in text and "390.0" in text and "160.0" in text
    assert "128 tok/row" in text and "500.0" in text  # what catching a row up (a deferred prefill) costs
    assert "Break-even acceptance" in text and "K=5" in text
