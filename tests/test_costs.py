"""The cost model: interpolation, calibration and its cache, online rescaling, break-even rates. No
assertion here depends on how fast anything ran."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest
import torch
from tinyworld import ScriptedCosts, tiny_model, tiny_stateful_model

from batchspec import costs as costs_module
from batchspec.bench.report import render_costs
from batchspec.costs import (
    PROMPT_TOKENS,
    SCALE_BOUNDS,
    STALE_FACTOR,
    MeasuredCosts,
    TimingTable,
    break_even,
    calibrated,
    fingerprint,
    grid,
    measure,
    measured_costs,
)
from batchspec.kernels import QuantizedLinear, apply_quantization, quantization_kernel_reason
from batchspec.layouts.ragged import RaggedLayout
from batchspec.roles import prompt_positions


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
    assert grid(6, (2,)) == [1, 2, 6]  # the one-draft verify the policy probes is measured, not interpolated
    assert grid(8) == [1, 4, 8]
    for top in (3, 8, 32, 100):
        points = grid(top)
        assert points[0] == 1 and points[-1] == top and len(points) <= costs_module.MAX_GRID
        assert points == sorted(set(points))


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
    monkeypatch.setattr(costs_module, "wall_clock", lambda device: now[0])
    table = measure(tiny_model("qwen2", vocab_size=50), [1, 2, 4], [1, 2, 4], all_logits=True)
    # a warm-up per layout, two passes, and a third timing of the one shape the burst hit
    assert len(forwards) == 3 + 9 + 9 + 1 and forwards[-1] == forwards[19]
    assert table.seconds == [[pytest.approx(seconds(r, t)) for t in [1, 2, 4]] for r in [1, 2, 4]]
    assert table(4, 1) < table(2, 1) and table(1, 4) < table(1, 2)
    assert table.doubts == [] and costs_module.monotone_faults(table) == []  # below MONOTONE_FROM: not judged


def scripted_clock(monkeypatch, durations: dict[tuple[int, int], list[float]]) -> list[tuple[int, int]]:
    """Each forward of a shape takes the next of its scripted durations (the last one repeats; 1 s
    unscripted); returns the shapes forwarded, in order."""
    now = [0.0]
    forwards: list[tuple[int, int]] = []
    original = RaggedLayout.forward

    def timed_forward(self, tokens, **kwargs):
        shape = tuple(tokens.shape)
        script = durations.get(shape, [1.0])
        now[0] += script[min(forwards.count(shape), len(script) - 1)]
        forwards.append(shape)
        return original(self, tokens, **kwargs)

    monkeypatch.setattr(RaggedLayout, "forward", timed_forward)
    monkeypatch.setattr(costs_module, "wall_clock", lambda device: now[0])
    return forwards


def test_each_shape_is_timed_until_two_timings_agree(monkeypatch):
    """Timings on a shared machine disagree: a shape is timed again until two of its timings agree
    within AGREEMENT, and counts the faster of them (a lone fast one is not its cost); one that never
    agrees within TRIES is named in the doubts."""
    forwards = scripted_clock(monkeypatch, {
        (1, 1): [9.0, 1.0, 1.05],  # the warm-up, then two timings that agree
        (1, 2): [3.0, 2.0, 2.1],  # a slow first timing: a third one agrees with the second
        (2, 1): [9.0, 1.0, 2.0, 3.0],  # the warm-up, then timings that never agree
        (2, 2): [0.7, 1.0, 1.02],  # a lone fast timing, then two that agree
    })
    table = measure(tiny_model("qwen2", vocab_size=50), [1, 2], [1, 2], all_logits=True)
    assert forwards.count((1, 1)) == 1 + 2 and forwards.count((2, 2)) == 3 and table(2, 2) == pytest.approx(1.0)
    assert forwards.count((1, 2)) == 3 and table(1, 2) == pytest.approx(2.0)
    assert forwards.count((2, 1)) == 1 + costs_module.TRIES and table(2, 1) == pytest.approx(1.0)
    assert len(table.doubts) == 1 and table.doubts[0].startswith("2x1's timings never agreed (1000.0, 2000.0")


def test_short_forwards_are_timed_as_runs_long_enough_to_agree(monkeypatch):
    """A forward of a few tens of milliseconds jitters by more than AGREEMENT from call to call: one
    forward per timing (20 vs 40 ms here) would never agree. A timing is the mean of forwards run back
    to back until MIN_TIMING_S has passed (6 here), at most MAX_REPEATS (a 1 ms forward: 8)."""
    forwards = scripted_clock(monkeypatch, {(1, 1): [0.02, 0.04] * 100, (1, 2): [0.001]})
    table = measure(tiny_model("qwen2", vocab_size=50), [1], [1, 2], all_logits=True)
    assert costs_module.MIN_TIMING_S == 0.15 and costs_module.MAX_REPEATS == 8
    assert forwards.count((1, 1)) == 6 * 3  # the warm-up, then two timings that agree
    assert table(1, 1) == pytest.approx(0.03) and table.doubts == []
    assert forwards.count((1, 2)) == 8 * 2 and table(1, 2) == pytest.approx(0.001)


def test_a_drafters_long_catch_up_is_timed_on_one_row_only(monkeypatch):
    """Catch-ups longer than SHARED_CATCH_UP run one row at a time: no forward of several rows that
    long is timed (the bundled drafter's 4 x 128 tokens would be the dearest shape of a calibration),
    and the table rates it as the shared catch-up plus each row's extra tokens."""
    long, shared = 128, costs_module.SHARED_CATCH_UP
    forwards = scripted_clock(monkeypatch, {(1, shared): [0.2], (1, long): [0.5], (2, shared): [0.3]})
    table = measure(tiny_model("qwen2", vocab_size=50), [1, 2], [1, shared, long], all_logits=False)
    assert (2, long) not in forwards and forwards.count((1, long)) == 2
    assert table(2, long) == pytest.approx(0.3 + 2 * (0.5 - 0.2))


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
    assert [c[0] for c in calls[2:]] == [[1, 4, 8], [1, 2], [1, 2], [1, 2], [1, 2]]
    assert [c[1] for c in calls[2:]] == [[1, 2, 6], [1, 3], [1, 2], [1, 2, 7], [1, 3]]
    assert fingerprint(llama) != fingerprint(gpt2)
    assert fingerprint(llama) == fingerprint(tiny_model("llama", vocab_size=50))


def linear_fake(calls: list | None = None, speed: float = 0.1):
    """A scripted `measure`: `speed` seconds per row-token, every shape agreed."""
    def fake(model, rows, tokens, all_logits):
        if calls is not None:
            calls.append((rows, tokens))
        return TimingTable(rows, tokens, [[speed * r * t for t in tokens] for r in rows])

    return fake


def test_a_table_that_does_not_check_out_is_used_but_not_cached(tmp_path, monkeypatch, capsys):
    """Timings that never agreed, or a shape with more work rated much cheaper than one with less
    (beyond MONOTONE_FROM row-tokens, where no kernel path explains it), come from a busy machine:
    the table serves this process and is measured anew by the next."""
    monkeypatch.setattr(costs_module, "costs_dir", lambda: tmp_path)
    monkeypatch.setattr(costs_module, "_MEMO", {})
    model = tiny_model("qwen2", vocab_size=50)

    def busy(model, rows, tokens, all_logits):  # 4 rows x 2 tokens rated half of 2 rows x 2 tokens
        return TimingTable(rows, tokens, [[0.1 * r * t * (0.25 if (r, t) == (4, 2) else 1) for t in tokens] for r in rows])

    table, where = calibrated(model, 4, [1, 2], True, measure_fn=busy)
    assert table(4, 2) == pytest.approx(0.2) and "not cached, used for this run only" in where
    assert "4x2 took 200.0 ms, less than 2x2's 400.0 ms" in where
    assert list(tmp_path.glob("*.json")) == []
    assert "not cached" in capsys.readouterr().err
    assert calibrated(model, 4, [1, 2], True, measure_fn=linear_fake())[0] is table  # this process keeps it
    monkeypatch.setattr(costs_module, "_MEMO", {})  # the next process measures anew

    def unsettled(model, rows, tokens, all_logits):
        return TimingTable(**(asdict(linear_fake()(model, rows, tokens, all_logits)) | {"doubts": ["1x2's timings never agreed"]}))

    assert "not cached" in calibrated(model, 4, [1, 2], True, measure_fn=unsettled)[1]
    assert list(tmp_path.glob("*.json")) == []
    monkeypatch.setattr(costs_module, "_MEMO", {})
    assert "cached in" in calibrated(model, 4, [1, 2], True, measure_fn=linear_fake())[1]
    assert len(list(tmp_path.glob("*.json"))) == 1


def test_monotonicity_is_judged_only_where_physics_demands_it():
    """A 1-row forward dearer than a 4-row one is a CPU kernel's small-product path (recorded as
    timed); 4 rows x 4 tokens cheaper than 4 x 2 beyond the slack is not physics."""
    table = TimingTable([1, 2, 4], [1, 2, 4], [[0.3, 0.25, 0.3], [0.3, 0.3, 0.4], [0.2, 0.35, 0.5]])
    assert costs_module.monotone_faults(table) == []
    table.seconds[2][2] = 0.34  # within the slack of 4x2's 0.35 s and 2x4's 0.4 s: noise, not a fault
    assert costs_module.monotone_faults(table) == []
    table.seconds[2][2] = 0.28
    assert costs_module.monotone_faults(table) == ["4x4 took 280.0 ms, less than 2x4's 400.0 ms",
                                                   "4x4 took 280.0 ms, less than 4x2's 350.0 ms"]


def test_calibration_says_what_it_times_and_how_long_it_took(tmp_path, monkeypatch, capfd):
    """One line when a calibration starts (which models, how many shapes), one when it ends
    (seconds, where cached), on stderr whether or not it is a terminal; nothing when cached."""
    monkeypatch.setattr(costs_module, "costs_dir", lambda: tmp_path)
    monkeypatch.setattr(costs_module, "_MEMO", {})
    target, draft = tiny_model("qwen2", vocab_size=50), tiny_model("llama", vocab_size=50)
    measured_costs(target, draft, 4, 5, measure_fn=linear_fake())
    lines = capfd.readouterr().err.strip().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("batchspec: timing forwards once") and "target Qwen2ForCausalLM: 9 shapes" in lines[0]
    assert "drafter LlamaForCausalLM: 10 shapes up to 4 rows x 128 tokens" in lines[0]
    assert f"at most {19 * costs_module.TRIES} timings" in lines[0]  # the bound, stated
    assert lines[1].startswith("batchspec: cost calibration took ") and f"cached in {tmp_path}" in lines[1]
    monkeypatch.setattr(costs_module, "_MEMO", {})
    costs = measured_costs(target, draft, 4, 5, measure_fn=linear_fake())
    assert capfd.readouterr().err == "" and costs.source.count("cached") == 2


@pytest.mark.skipif(quantization_kernel_reason("int4", torch.device("cpu"), prompt_int8=True) is not None,
                    reason="torch's quantized CPU kernels or _int_mm do not run here")
def test_a_drafters_prompt_path_is_timed_on_it_and_prices_its_deferred_prefills(tmp_path, monkeypatch, capfd):
    """A drafter with a prompt path gets a third table, one row on that path (`measure(prompt=True)`,
    cached under its own key), which `prompt_time` reads under the drafter's load; `measure` itself runs
    those forwards on the prompt path and no other. Without one, `prompt_time` is `draft_time`'s."""
    monkeypatch.setattr(costs_module, "costs_dir", lambda: tmp_path)
    monkeypatch.setattr(costs_module, "_MEMO", {})
    target, draft = tiny_model("qwen2", vocab_size=64), tiny_model("llama", vocab_size=64)
    apply_quantization(draft, "int4", prompt_int8=True)
    asked: list = []

    def fake(model, rows, tokens, all_logits, prompt=False):
        asked.append((rows, tokens, all_logits, prompt))
        return TimingTable(rows, tokens, [[(0.01 if prompt else 0.1) * r * t for t in tokens] for r in rows])

    costs = measured_costs(target, draft, 4, 5, measure_fn=fake)
    assert ([1], PROMPT_TOKENS, False, True) in asked and len(costs.files) == len(set(costs.files)) == 3
    assert "drafter prompt path LlamaForCausalLM: 3 shapes up to 1 rows x 128 tokens" in capfd.readouterr().err
    assert costs.prompt_time(100) == pytest.approx(1.0) and costs.draft_time(1, 100) == pytest.approx(10.0)
    costs.draft_scale = 2.0
    assert costs.prompt_time(100) == pytest.approx(2.0)
    plain = measured_costs(target, tiny_model("llama", vocab_size=64), 4, 5, measure_fn=linear_fake())
    assert plain.prompt is None and plain.prompt_time(100) == plain.draft_time(1, 100)
    seen: list = []
    first = next(m for m in draft.modules() if isinstance(m, QuantizedLinear))
    first.register_forward_pre_hook(lambda module, args: seen.append(prompt_positions()))
    measure(draft, [1], [40], all_logits=False, prompt=True)
    timed, seen[:] = list(seen), []
    measure(draft, [1], [40], all_logits=False)
    assert timed[-1] and not any(seen[1:])  # past the context's prefill (a prompt pass): the timed forwards


def test_rounds_far_from_the_table_mark_its_cache_stale(tmp_path, monkeypatch, capsys):
    """The user's table said 2.4 s for a step that took 0.47 s: rounds running more than DRIFT faster
    than the table's prediction over DRIFT_ROUNDS rounds mark its cache file stale (said once), and
    the next start measures anew; slower rounds (load, longer contexts than the table's) leave it."""
    monkeypatch.setattr(costs_module, "costs_dir", lambda: tmp_path)
    monkeypatch.setattr(costs_module, "_MEMO", {})
    target, draft = tiny_model("qwen2", vocab_size=50), tiny_model("llama", vocab_size=50)
    calls: list = []
    costs = measured_costs(target, draft, 2, 3, measure_fn=linear_fake(calls))
    assert len(costs.files) == 2 and all(f.exists() for f in costs.files)
    capsys.readouterr()
    for _ in range(3 * costs_module.DRIFT_ROUNDS):  # 20% or 2x slower: load or long contexts, not a wrong table
        costs.observe(2, 1, 1, draft_s=0.1, verify_s=1.2 * costs.verify(2, 2), other_s=0.0)
        costs.observe(2, 1, 1, draft_s=0.1, verify_s=2.0 * costs.verify(2, 2), other_s=0.0)
    assert not costs.drifted and capsys.readouterr().err == ""
    assert not any("stale" in json.loads(f.read_text()) for f in costs.files)
    for _ in range(costs_module.DRIFT_ROUNDS // 2 - 1):  # 5x faster: the table was measured on a busy machine
        costs.observe(2, 0, 0, draft_s=0.0, verify_s=0.2 * costs.verify(2, 1), other_s=0.0)
    assert not costs.drifted  # ... or a burst of odd rounds: the median of the last ones is still within DRIFT
    for _ in range(costs_module.DRIFT_ROUNDS):
        costs.observe(2, 0, 0, draft_s=0.0, verify_s=0.2 * costs.verify(2, 1), other_s=0.0)
    err = capsys.readouterr().err
    assert costs.drifted and err.count("\n") == 1 and "cost table is off (verify forwards ran 0.70x its prediction over 20 rounds)" in err
    assert all(json.loads(f.read_text())["stale"] for f in costs.files)
    repeat = MeasuredCosts(costs.verify, costs.draft, files=costs.files)  # another engine, same table
    for _ in range(costs_module.DRIFT_ROUNDS):
        repeat.observe(2, 0, 0, draft_s=0.0, verify_s=0.2 * costs.verify(2, 1), other_s=0.0)
    assert repeat.drifted and capsys.readouterr().err == ""  # said once per process
    monkeypatch.setattr(costs_module, "_MEMO", {})  # the next start
    calls.clear()
    again = measured_costs(target, draft, 2, 3, measure_fn=linear_fake(calls))
    assert [rows for rows, _ in calls] == [[1, 2], [1, 2]]  # both measured anew, no quick check
    assert again.source.count("marked stale") == 2 and not any("stale" in json.loads(f.read_text()) for f in again.files)


def test_a_stale_flag_or_a_cache_that_cannot_be_written_breaks_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(costs_module, "_MEMO", {})
    folder = tmp_path / "costs"
    monkeypatch.setattr(costs_module, "costs_dir", lambda: folder)
    model = tiny_model("qwen2", vocab_size=50)
    table, where = calibrated(model, 2, [1, 2], True, measure_fn=linear_fake())
    (path,) = folder.glob("*.json")
    empty = '{"table": {"rows": [], "tokens": [], "seconds": []}}'
    for text in ("[1, 2]", '{"table": {"rows": [1], "tokens": [1, 2], "seconds": [[0.1]]}}', empty, "{"):
        path.write_text(text)  # not a table this version wrote: measured anew, never a crash
        monkeypatch.setattr(costs_module, "_MEMO", {})
        assert calibrated(model, 2, [1, 2], True, measure_fn=linear_fake())[1].startswith("measured, cached")
    path.write_text("{")
    costs = MeasuredCosts(table, None, files=(path,))
    for _ in range(costs_module.DRIFT_ROUNDS):
        costs.observe(1, 0, 0, 0.0, 0.1 * table(1, 1), 0.0)
    assert costs.drifted and not path.exists()  # an unreadable file is removed instead
    folder.rmdir()
    folder.write_text("a file where the cache dir should be")  # not writable: used, not cached
    monkeypatch.setattr(costs_module, "_MEMO", {})
    table, where = calibrated(model, 2, [1, 2], True, measure_fn=linear_fake())
    assert where == "measured (cache dir not writable)"
    costs = MeasuredCosts(table, None, files=(folder / "x.json",))
    for _ in range(costs_module.DRIFT_ROUNDS):
        costs.observe(1, 0, 0, 0.0, 0.1 * table(1, 1), 0.0)
    assert costs.drifted and "it was not cached" in capsys.readouterr().err


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


# ---- kept out of the decoding figures ------------------------------------------------------------------
def test_calibration_seconds_are_reported_apart_and_counted_in_no_tokens_per_second(tiny_pair_dirs, monkeypatch):
    """A first calibration once counted in the run's wall time: its seconds are `calibration_s`, in
    no phase, and neither the end-to-end tokens/s nor a request's latency includes them."""
    import time

    from batchspec import build as build_module
    from batchspec.config import ModelConfig, SamplingParams, SpecConfig
    from batchspec.llm import LLM

    pause = 0.5

    def slow_calibration(target, draft, rows, max_drafts):
        time.sleep(pause)
        return ScriptedCosts()

    monkeypatch.setattr(build_module, "measured_costs", slow_calibration)
    target, draft = tiny_pair_dirs
    llm = LLM(ModelConfig(str(target), str(draft)),
              spec=SpecConfig(method="ragged", num_draft_tokens=3, batch_size=2, speculation="adaptive"))
    start = time.perf_counter()
    (out,) = llm.generate([[3, 4, 5]], SamplingParams(max_new_tokens=4))
    wall = time.perf_counter() - start
    stats = llm.stats
    assert pause <= stats.calibration_s < wall
    assert out.latency <= wall - stats.calibration_s  # timed from the end of the calibration
    assert stats.total_time <= wall - stats.calibration_s
    first = stats.calibration_s
    llm.generate([[3, 4, 5]], SamplingParams(max_new_tokens=4))  # the LLM keeps its costs: measured once
    assert llm.stats.calibration_s == first


def test_calibration_seconds_merge_and_leave_the_summary_throughput():
    from batchspec.commands.generate import summarize
    from batchspec.llm import RequestOutput
    from batchspec.stats import EngineStats

    total = EngineStats(calibration_s=2.0, verify_time=1.0)
    total.merge(EngineStats(calibration_s=3.0, verify_time=1.0))  # e.g. two Ray workers
    assert total.calibration_s == 5.0 and total.total_time == 2.0
    out = RequestOutput(0, "p", [1], token_ids=list(range(12)), rounds=4)
    summary = summarize([out], wall=10.0, calibration=4.0)
    assert summary["calibration_seconds"] == 4.0 and summary["tokens_per_second"] == 2.0
    assert summarize([out], wall=4.0, calibration=4.0)["tokens_per_second"] is None
