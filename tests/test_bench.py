"""`batchspec bench` end to end on the tiny pair, and its pieces (SpecBench selection, method
specs, oracle comparison). Figures are only checked for presence and exactness, never for speed:
timings on a shared CPU prove nothing."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from tinyworld import WORDS

from batchspec.bench.exactness import Match, compare
from batchspec.bench.methods import MethodSpec, parse_batch_sizes, parse_methods
from batchspec.bench.runner import ALL, MethodResult, RowResult, Timing, fastest_of, run_method
from batchspec.bench.specbench import MT_BENCH_CATEGORIES, SPECBENCH_FILE, TASK_GROUPS, encode_prompts, select
from batchspec.cli import main
from batchspec.config import BatchspecError, ModelConfig, SamplingParams, SpecConfig
from batchspec.models import load_pair

METHODS = [
    "ar@1", "ar@2", "eqspec@2", "ragged+fixed@2", "ragged+chunk3+fixed@2", "ragged+chunk0+fixed@2", "ragged+static+fixed@2",
    "exspec@2", "hf@2", "hf-assisted@1", "naive-kv@2",
]


def _prompts_file(path: Path) -> Path:
    """Four prompts in three categories, made of the tiny tokenizer's words (no <unk>)."""
    lines = []
    for i, category in enumerate(["writing", "roleplay", "qa", "translation"]):
        words = [WORDS[(7 * i + 3 * j) % len(WORDS)] for j in range(4 + 2 * i)]
        lines.append(json.dumps({"id": f"p{i}", "category": category, "prompt": " ".join(words)}))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_bench_end_to_end(tiny_pair_dirs, tmp_path, capsys) -> None:
    target, draft = tiny_pair_dirs
    prompts = _prompts_file(tmp_path / "prompts.jsonl")
    report_path, csv_path, plots = tmp_path / "report.json", tmp_path / "report.csv", tmp_path / "plots"
    trace_path = tmp_path / "trace.jsonl"
    assert main([
        "bench", "--target", str(target), "--draft", str(draft), "--prompts", str(prompts),
        "--methods", ",".join(METHODS), "--max-new-tokens", "8", "-k", "3", "--trace", str(trace_path),
        "--json", str(report_path), "--csv", str(csv_path), "--plots", str(plots),
    ]) == 0
    traced = [json.loads(line) for line in trace_path.read_text().splitlines()]
    assert {r["method"] for r in traced} == {m for m in METHODS if not m.startswith("hf")}  # engines only
    assert all(r["piece"] in ("prefill", "catch_up", "round") and r["s"] >= 0 and r["repeat"] == 0 for r in traced)
    stdout = capsys.readouterr().out
    report = json.loads(report_path.read_text())
    assert {"cpu", "cores", "torch", "transformers", "dtype", "device"} <= report["machine"].keys()
    assert report["prompts"]["count"] == 4
    assert report["prompts"]["groups"] == {"mt_bench": 2, "qa": 1, "translation": 1}
    by_name = {m["method"]: m for m in report["methods"]}
    assert list(by_name) == METHODS
    for name, m in by_name.items():
        assert m["error"] is None, name
        assert m["prompts"] == 4 and m["errors"] == 0 and m["generated_tokens"] > 0
        for key in ("tokens_per_s", "decode_tokens_per_s", "prefill_s", "decode_s", "speedup", "mean_accepted_length"):
            assert m[key] is not None and m[key] > 0, (name, key)
        assert {"p50", "p90", "p99"} == m["latency_s"].keys() == m["ttft_s"].keys()
        assert m["latency_s"]["p99"] >= m["latency_s"]["p50"] > 0
        assert set(m["groups"]) == {"mt_bench", "qa", "translation"}
        # the audit calls every divergence of the deliberately wrong method a sync error, and none elsewhere
        assert m["sync_errors"] == (m["divergent"] if name.startswith("naive-") else 0), (name, m["divergences"])
        if name.startswith("hf"):
            assert m["time_share"] is None  # no engine, no phase breakdown
        else:
            assert m["time_share"].keys() == {"prefill", "draft", "verify", "other"}
            assert sum(m["time_share"].values()) == pytest.approx(1.0, abs=1e-3)
    pooled = by_name["exspec@2"]
    assert pooled["grouped_rounds"] + pooled["fallback_rounds"] > 0 and 0 <= pooled["grouping_rate"] <= 1
    assert "EXSPEC grouping" in stdout
    for name in ("ar@1", "ar@2", "eqspec@2", "ragged+fixed@2", "ragged+chunk3+fixed@2", "ragged+chunk0+fixed@2",
                 "ragged+static+fixed@2", "exspec@2"):
        assert by_name[name]["exact_match"] == 1.0, (name, by_name[name]["divergences"])
        assert by_name[name]["divergent"] == by_name[name]["sync_errors"] == 0
    # the deliberately wrong method: fast maybe, but the audit calls its divergences what they are
    wrong = by_name["naive-kv@2"]
    assert wrong["exact_match"] < 1 and wrong["sync_errors"] == wrong["divergent"] > 0 and wrong["fp_ties"] == 0
    assert {d["label"] for d in wrong["divergences"]} == {"sync-error"}
    assert report["auditor"]["name"] == "batchspec.forensics.audit" and report["auditor"]["calibration"]["margin"] >= 0
    for name in ("eqspec@2", "ragged+fixed@2", "hf-assisted@1"):
        assert 0 < by_name[name]["acceptance_rate"] <= 1
        assert by_name[name]["mean_accepted_length"] >= 1
    assert by_name["ar@1"]["speedup"] == 1.0
    # prefill at each prompt's own length: no padding computed, except by transformers' left padding
    lengths = {len(p) for p in (json.loads(line)["prompt"].split() for line in prompts.read_text().splitlines())}
    assert len(lengths) > 1
    for name, m in by_name.items():
        assert m["prefill_tokens_per_s"] > 0 and m["itl_s"]["p99"] >= m["itl_s"]["p50"] > 0, name
        assert (m["padding_share"] > 0) if name == "hf@2" else (m["padding_share"] == 0), name
    assert by_name["ar@2"]["acceptance_rate"] is None and by_name["ar@2"]["mean_accepted_length"] == 1.0

    rows = list(csv.DictReader(csv_path.open()))
    assert len(rows) == len(METHODS) * 4  # overall + three groups each
    assert {r["group"] for r in rows} == {ALL, "mt_bench", "qa", "translation"}
    for png in ("throughput_vs_batch.png", "fast_but_wrong.png", "time_breakdown.png"):
        assert (plots / png).stat().st_size > 1000
    for name in METHODS:
        assert name in stdout
    assert "side-by-side" in stdout


def test_failing_method_becomes_an_error_row(tiny_pair_dirs, monkeypatch) -> None:
    """A method the engine cannot run (exspec while it is being built) must not take the others down."""
    import batchspec.bench.runner as runner
    from batchspec.bench.specbench import BenchPrompt
    from batchspec.forensics.oracle import Oracle

    def refuse(*args, **kwargs):
        raise NotImplementedError("pool scheduler\nsecond line")

    monkeypatch.setattr(runner, "run_engine", refuse)
    models = load_pair(ModelConfig(str(tiny_pair_dirs[0]), str(tiny_pair_dirs[1])))
    params = SamplingParams(max_new_tokens=4)
    prompts = [BenchPrompt("0", "the a", None, None, (5, 6), params)]
    result = run_method(models, MethodSpec("exspec", 2), prompts, {ALL: [0]}, SpecConfig(num_draft_tokens=2), (1,),
                        Oracle(models.target, params, (1,)), lambda *row: "sync-error")
    assert result.error == "NotImplementedError: pool scheduler"
    assert result.rows == [] and result.timings == {}


def test_parse_methods() -> None:
    specs = parse_methods("ragged+static@4, eqspec, exspec@4, hf, hf-assisted", [2, 4])
    assert [s.name for s in specs] == [
        "ar@1", "ragged+static@4", "eqspec@2", "eqspec@4", "exspec@4", "hf@2", "hf@4", "hf-assisted@1",
    ]
    assert specs[1] == MethodSpec("ragged", 4, "static")
    assert [s.name for s in parse_methods("ar@1,ar@1,ragged@2", [4])] == ["ar@1", "ragged@2"]
    assert parse_batch_sizes("1, 2,2,8") == [1, 2, 8]
    for bad in ("hf-assisted@2", "eqspec+continuous@4", "nope@2", "ragged@x", "ragged@0", "hf+continuous@2", ""):
        with pytest.raises(BatchspecError):
            parse_methods(bad, [4])
    with pytest.raises(BatchspecError):
        parse_batch_sizes("1,zero")


def test_parse_method_options() -> None:
    specs = parse_methods("ragged+k3+fixed@1,ragged+adaptive@4,ragged+ngram+fixed@1,ragged+ngram+adaptive@1,"
                          "ragged+adaptive+hybrid+static+k2@8,ragged+chunk16+fixed@2,ragged+fixed+model@1", [4], [None, 8])
    assert [s.name for s in specs] == [
        "ar@1", "ragged+k3+fixed@1", "ragged+chunk8+k3+fixed@1", "ragged@4", "ragged+chunk8@4",
        "ragged+ngram+fixed@1", "ragged+chunk8+ngram+fixed@1", "ragged+ngram@1", "ragged+chunk8+ngram@1",
        "ragged+static+k2+hybrid@8", "ragged+chunk16+fixed@2", "ragged+fixed@1", "ragged+chunk8+fixed@1",
    ]
    assert specs[9] == MethodSpec("ragged", 8, "static", None, 2, "adaptive", "hybrid")
    assert not specs[5].needs_draft_model and specs[9].needs_draft_model
    for bad, message in (("ar+k3@1", "does not draft"), ("hf+adaptive@2", "takes no options"),
                         ("ragged+k0@1", "N >= 1"), ("ragged+static+continuous@1", "two scheduler"),
                         ("ragged+ngram+model@1", "two drafter"), ("ragged+fast@1", "unknown option 'fast'"),
                         ("eqspec+chunk4@2", "continuous scheduler")):
        with pytest.raises(BatchspecError, match=message):
            parse_methods(bad, [1])


def test_bench_compares_speculation_policies_and_drafters(tiny_pair_dirs, tmp_path, capsys) -> None:
    """K per method, adaptive speculation, prompt lookup and the hybrid drafter side by side: all exact,
    with the cost model printed and a chosen-K histogram per task group."""
    target, draft = tiny_pair_dirs
    report_path, csv_path = tmp_path / "report.json", tmp_path / "report.csv"
    methods = "ragged+k1+fixed@2,ragged@2,ragged+ngram+fixed@2,ragged+ngram@1,ragged+hybrid@1"
    assert main([
        "bench", "--target", str(target), "--draft", str(draft), "--prompts", str(_prompts_file(tmp_path / "p.jsonl")),
        "--suite", "specbench", "--methods", methods, "--max-new-tokens", "8", "-k", "3", "--costs",
        "--ngram-min", "1", "--ngram-max", "2", "--json", str(report_path), "--csv", str(csv_path),
    ]) == 2  # --suite reads SpecBench itself
    capsys.readouterr()
    assert main([
        "bench", "--target", str(target), "--draft", str(draft), "--prompts", str(_prompts_file(tmp_path / "p.jsonl")),
        "--methods", methods, "--max-new-tokens", "8", "-k", "3", "--costs", "--ngram-min", "1", "--ngram-max", "2",
        "--json", str(report_path), "--csv", str(csv_path), "--repeats", "2",
    ]) == 0
    stdout = capsys.readouterr().out
    assert "the fastest of 2 runs each" in stdout
    assert "Cost model" in stdout and "Break-even acceptance" in stdout and "Chosen K" in stdout
    assert stdout.index("Cost model") < stdout.index("Speed")  # printed before the runs
    report = json.loads(report_path.read_text())
    by_name = {m["method"]: m for m in report["methods"]}
    assert list(by_name) == ["ar@1", *methods.split(",")]
    assert "Break-even" in report["costs"] and report["settings"]["repeats"] == 2
    # paired with plain decoding at the same batch size: only batch 1 has a plain run here (ar@1)
    assert "Paired with plain decoding" in stdout
    paired = {e["method"]: e for e in report["paired"]}
    assert set(paired) == {"ragged+ngram@1", "ragged+hybrid@1"}
    for entry in paired.values():
        assert entry["baseline"] == "ar@1" and entry["repeats"] == 2
        assert len(entry["parts"]["all"]["end_to_end"]["samples"]) == 2
    for name in methods.split(","):
        entry = by_name[name]
        assert entry["error"] is None and entry["exact_match"] == 1.0, (name, entry["divergences"])
        assert sum(entry["chosen_k"].values()) > 0 and max(int(k) for k in entry["chosen_k"]) <= 3
        assert set(entry["groups"]) == {"mt_bench", "qa", "translation"}
        assert all("chosen_k" in fig for fig in entry["groups"].values())
    assert by_name["ragged+k1+fixed@2"]["chosen_k"].keys() <= {"0", "1"}
    assert by_name["ragged@2"]["speculation"] == "adaptive" and by_name["ragged+k1+fixed@2"]["speculation"] == "fixed"
    assert by_name["ragged+ngram+fixed@2"]["drafter"] == "ngram"
    rows = list(csv.DictReader(csv_path.open()))
    assert all(r["chosen_k"] for r in rows if r["method"] != "ar@1")


def test_fast_but_wrong_shows_every_method_readably_and_wrong_ones_apart() -> None:
    """Many exact methods at nearly the same speed: every method's name readable on its own, fastest
    on top, and the wrong ones coloured and labelled apart from the exact ones."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from batchspec.bench.plots import EXACT_COLOR, WRONG_COLOR, _fast_but_wrong

    names = ["ar@1", "ar@4", "ragged+k1@1", "ragged+k3@1", "ragged+k5@1", "ragged+adaptive@1", "ragged+ngram@1",
             "ragged+ngram+adaptive@1", "ragged+hybrid+adaptive@1", "eqspec@4", "exspec@4", "naive-kv@4",
             "naive-bonus@4"] + [f"ragged+k{k}@{b}" for k in (1, 3, 5) for b in (2, 4, 8)]
    entries = [{"method": n, "tokens_per_s": 2.0 + 0.01 * i, "exact_match": 0.0 if "naive" in n else 1.0}
               for i, n in enumerate(names)]
    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    _fast_but_wrong(ax, entries)
    renderer = fig.canvas.get_renderer()
    ticks = ax.get_yticklabels()
    assert [t.get_text() for t in ticks] == names  # ascending speed: the fastest is the top bar
    boxes = [t.get_window_extent(renderer) for t in ticks]
    assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1 :])
    frame = fig.bbox
    assert all(frame.contains(b.x0, b.y0) and frame.contains(b.x1, b.y1) for b in boxes)
    colors = {name: matplotlib.colors.to_hex(bar.get_facecolor()) for name, bar in zip(names, ax.patches)}
    wrong = {n for n in names if "naive" in n}
    assert {n for n, c in colors.items() if c == matplotlib.colors.to_hex(WRONG_COLOR)} == wrong
    assert {n for n, c in colors.items() if c == matplotlib.colors.to_hex(EXACT_COLOR)} == set(names) - wrong
    notes = [t.get_text() for t in ax.texts]
    assert notes.count("0% exact") == len(wrong) and notes.count("100% exact") == len(names) - len(wrong)
    plt.close(fig)


def test_repeated_runs_report_the_fastest_and_every_divergence() -> None:
    """Per part, the timing and rows of the fastest run; a row that diverged in any run stays diverged."""
    spec = MethodSpec("ragged", 2)
    exact, wrong = Match(True, 1.0, None), Match(False, 0.5, 1)

    def run(walls: dict[str, float], matches: list[Match], tag: int) -> MethodResult:
        rows = [RowResult([tag, i], 0.1, 0.2) for i in range(3)]
        return MethodResult(spec, rows, {k: Timing(w, 0.0) for k, w in walls.items()}, matches, [None] * 3)

    parts = {"qa": [0, 1], "math": [2]}
    first = run({"qa": 2.0, "math": 1.0}, [exact, wrong, exact], tag=1)  # diverged in the slower run
    second = run({"qa": 1.5, "math": 3.0}, [exact, exact, exact], tag=2)
    merged = fastest_of([first, second], parts)
    assert merged.timings["qa"].wall == 1.5 and merged.timings["math"].wall == 1.0
    assert [r.token_ids[0] for r in merged.rows] == [2, 2, 1]
    assert merged.matches == [exact, wrong, exact]
    assert fastest_of([first, MethodResult(spec, error="boom")], parts).error == "boom"
    # runs of one part each (the bench runs task group by task group): each part from its own runs
    only_qa = MethodResult(spec, [RowResult([3, 0], 0.1, 0.2), RowResult([3, 1], 0.1, 0.2), None],
                           {"qa": Timing(1.0, 0.0)}, [exact, exact, None], [None] * 3)
    only_math = MethodResult(spec, [None, None, RowResult([4, 2], 0.1, 0.2)], {"math": Timing(2.0, 0.0)},
                             [None, None, wrong], [None] * 3)
    merged = fastest_of([first, only_qa, only_math], parts)
    assert merged.timings["qa"].wall == 1.0 and merged.timings["math"].wall == 1.0
    assert [r.token_ids[0] for r in merged.rows] == [3, 3, 1]
    assert merged.matches == [exact, wrong, wrong]  # row 2 diverged in its other run


def test_compare_with_oracle() -> None:
    assert compare([1, 2, 3], [1, 2, 3]) == Match(True, 1.0, None)
    assert compare([1, 9, 3], [1, 2, 3, 4]) == Match(False, 0.25, 1)
    assert compare([1, 2], [1, 2, 3, 4]) == Match(False, 0.5, 2)  # stopped early


def test_specbench_stratification() -> None:
    prompts, skipped = encode_prompts(SPECBENCH_FILE, lambda text: text.split())
    assert len(prompts) == 480 and skipped == {}
    counts = {g: sum(p.group == g for p in prompts) for g in TASK_GROUPS}
    assert counts == dict.fromkeys(TASK_GROUPS, 80)

    everything = select(prompts)  # group by group, categories interleaved within a group
    assert sorted(everything, key=lambda p: p.id) == sorted(prompts, key=lambda p: p.id)
    assert [p.group for p in everything] == [g for g in TASK_GROUPS for _ in range(80)]
    assert [p.category for p in everything[:8]] == list(MT_BENCH_CATEGORIES)
    per = select(prompts, per_group=8)
    assert len(per) == 48
    assert {p.category for p in per if p.group == "mt_bench"} == set(MT_BENCH_CATEGORIES)  # round-robin
    spread = select(prompts, num_prompts=8)
    assert [sum(p.group == g for p in spread) for g in TASK_GROUPS] == [2, 2, 1, 1, 1, 1]
    assert select(prompts, num_prompts=10_000) == select(prompts)
    assert len(select(prompts, per_group=500)) == 480

    # a length cap applies before selection, so a group still fills its quota from short prompts
    short, skipped = encode_prompts(SPECBENCH_FILE, lambda text: text.split(), max_tokens=60)
    assert sum(skipped.values()) == 480 - len(short) > 0
    assert all(len(p.token_ids) <= 60 for p in select(short, per_group=5))
    with pytest.raises(BatchspecError):
        select(prompts, num_prompts=2, per_group=2)
    with pytest.raises(BatchspecError):
        select(prompts, num_prompts=0)
