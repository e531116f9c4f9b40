"""`scripts/trace_summary.py`: where the rows waited, from a step trace."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

from tinyworld import VOCAB_SIZE, random_prompts, tiny_model

from batchspec.build import build_engine
from batchspec.config import SamplingParams, SpecConfig
from batchspec.trace import StepTrace

SCRIPT = Path(__file__).parent.parent / "scripts" / "trace_summary.py"
SUMMARY = runpy.run_path(str(SCRIPT))
summarise, plain_rounds = SUMMARY["summarise"], SUMMARY["plain_rounds"]


def test_a_step_is_its_prefill_pieces_plus_the_rest():
    """Per method over its repeats: the longest step split into prefill and the rest, the longest rest
    of any step against the slowest round."""
    records = [
        {"method": "m", "repeat": 0, "step": 0, "piece": "prefill", "s": 0.5},
        {"method": "m", "repeat": 0, "step": 0, "piece": "prefill", "s": 0.25},
        {"method": "m", "repeat": 0, "step": 0, "piece": "round", "s": 0.125},
        {"method": "m", "repeat": 0, "step": 1, "piece": "catch_up", "s": 0.5, "tokens": [40], "shared": False},
        {"method": "m", "repeat": 1, "step": 0, "piece": "catch_up", "s": 0.25, "tokens": [3, 5], "shared": True},
        {"method": "m", "repeat": 0, "step": 1, "piece": "round", "s": 0.25},
        {"method": "m", "repeat": 1, "step": 0, "piece": "round", "s": 0.375},
        {"method": "n", "repeat": 0, "step": 0, "piece": "round", "s": 0.0625},
    ]
    rows = summarise([json.dumps(r) for r in records] + [""])
    assert rows == [
        {"method": "m", "steps": 3, "longest_step_s": 0.875, "its_prefill_s": 0.75, "its_rest_s": 0.125,
         "longest_rest_s": 0.75, "slowest_round_s": 0.375, "most_prefill_pieces": 2,
         "catch_up_tokens": 48, "catch_up_s": 0.75, "own_catch_up_ms_per_token": 12.5},
        {"method": "n", "steps": 1, "longest_step_s": 0.0625, "its_prefill_s": 0.0, "its_rest_s": 0.0625,
         "longest_rest_s": 0.0625, "slowest_round_s": 0.0625, "most_prefill_pieces": 0,
         "catch_up_tokens": 0, "catch_up_s": 0.0, "own_catch_up_ms_per_token": None},
    ]


def test_plain_rounds_are_priced_by_their_row_count():
    """Only rounds that verified no draft count, grouped per method by how many rows they ran."""
    records = [
        {"method": "m", "step": 0, "piece": "round", "s": 0.1, "requests": [0, 1], "verify_width": 0},
        {"method": "m", "step": 1, "piece": "round", "s": 0.3, "requests": [0, 1], "verify_width": 0},
        {"method": "m", "step": 2, "piece": "round", "s": 0.9, "requests": [0, 1], "verify_width": 3},
        {"method": "m", "step": 3, "piece": "round", "s": 0.05, "requests": [1], "verify_width": 0},
        {"method": "m", "step": 3, "piece": "prefill", "s": 2.0, "requests": [2]},
        {"method": "n", "step": 0, "piece": "round", "s": 0.2, "requests": [0, 1], "verify_width": 0},
    ]
    rows = plain_rounds([json.dumps(r) for r in records])
    assert [(r["method"], r["rows"], r["rounds"]) for r in rows] == [("m", 1, 1), ("m", 2, 2), ("n", 2, 1)]
    assert [round(r["mean_ms"], 6) for r in rows] == [50.0, 200.0, 200.0]


def test_it_reads_what_the_engine_writes(tmp_path):
    """A real trace: short prompts under a 16-token budget share a step's prefill (a forward each)."""
    path = tmp_path / "trace.jsonl"
    spec = SpecConfig(method="ar", scheduler="continuous", batch_size=3, max_prefill_tokens=16)
    with StepTrace(path) as trace:
        engine = build_engine(tiny_model("llama", vocab_size=VOCAB_SIZE, seed=0), spec, trace=trace)
        engine.generate(random_prompts(4, [5, 6, 20, 3], seed=2), SamplingParams(max_new_tokens=5))
    [row] = summarise(path.read_text().splitlines())
    assert row["method"] == "-" and row["steps"] == engine.steps
    assert row["most_prefill_pieces"] >= 2 and row["longest_rest_s"] >= row["slowest_round_s"] > 0
    plain = plain_rounds(path.read_text().splitlines())
    assert sum(r["rounds"] for r in plain) == engine.stats.rounds  # plain decoding verifies nothing
