"""Issue 29: no step stalls the rows in flight for long. Under the continuous scheduler a step feeds
at most its token budget besides its round (prompt chunks and drafter catch-ups together), a long
drafter catch-up is fed in pieces across steps and its row drafts only once it is complete, outputs
stay exactly plain decoding's, and the step trace records every piece of every step."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest
from test_engine import drafter, target
from tinyworld import ScriptedCosts, random_prompts

from batchspec.build import build_engine
from batchspec.config import DEFAULT_PREFILL_TOKENS, SamplingParams, SpecConfig
from batchspec.layouts import RaggedLayout
from batchspec.reference import greedy_decode
from batchspec.trace import StepTrace

FREE_CATCH_UP = ScriptedCosts(1.0, 0.01, 0.01, draft_token=0.0)  # drafting pays, catching up costs nothing


def assert_plain(arch: str, prompts: list[list[int]], outputs, budgets: list[int]) -> None:
    for prompt, budget, seq in zip(prompts, budgets, outputs):
        assert seq.generated == greedy_decode(target(arch), prompt, budget), f"prompt {seq.index} diverged"


def read_trace(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def run_traced(arch: str, spec: SpecConfig, prompts: list[list[int]], budgets: list[int], path, monkeypatch):
    """Decode with a step trace and, independently of it, count the tokens each step fed one row alone
    (prompt chunks into the staging row, a drafter's per-row catch-ups) by spying on the layout."""
    fed_alone: dict[int, int] = defaultdict(int)
    stage, feed_row = RaggedLayout.stage, RaggedLayout.feed_row

    def spied_stage(self, tokens):
        fed_alone[engine.steps - 1] += len(tokens)
        return stage(self, tokens)

    def spied_feed_row(self, row, tokens):
        fed_alone[engine.steps - 1] += len(tokens)
        return feed_row(self, row, tokens)

    monkeypatch.setattr(RaggedLayout, "stage", spied_stage)
    monkeypatch.setattr(RaggedLayout, "feed_row", spied_feed_row)
    with StepTrace(path) as trace:
        engine = build_engine(target(arch), spec, draft_model=drafter(arch), costs=FREE_CATCH_UP, trace=trace)
        outputs = engine.generate(prompts, [SamplingParams(max_new_tokens=b) for b in budgets])
    return engine, outputs, fed_alone


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("budget", [16, 40])
def test_long_catch_ups_are_fed_in_pieces_within_the_budget(arch, budget, tmp_path, monkeypatch):
    """Long prompts under adaptive speculation (a lazy drafter) with a budget smaller than them: the
    target's prefill and the drafter's catch-ups are fed in pieces, no step feeds more than the budget
    besides its round (counted from the layout's forwards and from the trace), a row whose catch-up is
    incomplete verifies no draft in that step, every long row drafts once caught up, all exact, K/V
    checked every round."""
    prompts = random_prompts(5, [70, 5, 90, 8, 55], seed=41)
    budgets = [40, 30, 40, 30, 35]
    spec = SpecConfig(method="ragged", num_draft_tokens=3, batch_size=3, speculation="adaptive",
                      max_prefill_tokens=budget, check_invariants=True)
    path = tmp_path / "trace.jsonl"
    engine, outputs, fed_alone = run_traced(arch, spec, prompts, budgets, path, monkeypatch)
    assert_plain(arch, prompts, outputs, budgets)
    assert max(fed_alone.values()) <= budget
    records = read_trace(path)
    per_step: dict[int, int] = defaultdict(int)
    for r in records:
        if r["piece"] in ("prefill", "catch_up"):
            per_step[r["step"]] += sum(r["tokens"])
    assert max(per_step.values()) <= budget
    pieces = [r for r in records if r["piece"] == "catch_up" and not r["complete"]]
    assert pieces and all(not r["shared"] and len(r["requests"]) == 1 for r in pieces)
    rounds = {r["step"]: r for r in records if r["piece"] == "round"}
    for piece in pieces:  # incomplete: that row verifies nothing in the step's round
        round_ = rounds[piece["step"]]
        assert round_["verified"][round_["requests"].index(piece["requests"][0])] == 0
    long_rows = [s for s in outputs if len(s.prompt_ids) > budget]
    assert all(any(s.chosen_k) for s in long_rows)  # caught up in the end, and drafted for
    assert engine.stats.extra["draft_catch_up_tokens"] >= sum(len(s.prompt_ids) - 1 for s in long_rows)


def test_the_default_budget_bounds_every_step(tmp_path, monkeypatch):
    """With no setting the continuous scheduler chunks at DEFAULT_PREFILL_TOKENS: prompts longer than
    it are prefilled in pieces while the other rows decode, and no step feeds more than it besides
    its round; outputs exact."""
    arch = "llama"
    long = DEFAULT_PREFILL_TOKENS + 60
    prompts = random_prompts(4, [6, long, 9, long + 20], seed=43)
    budgets = [20, 6, 20, 5]
    spec = SpecConfig(method="ragged", num_draft_tokens=3, batch_size=2)
    path = tmp_path / "trace.jsonl"
    engine, outputs, fed_alone = run_traced(arch, spec, prompts, budgets, path, monkeypatch)
    assert engine.prefill.budget == DEFAULT_PREFILL_TOKENS
    assert_plain(arch, prompts, outputs, budgets)
    assert max(fed_alone.values()) <= DEFAULT_PREFILL_TOKENS
    records = read_trace(path)
    chunks = [r for r in records if r["piece"] == "prefill" and r["requests"] == [1]]
    sizes = [r["tokens"][0] for r in chunks]
    assert sum(sizes) == long and len(sizes) >= 2 and [r["complete"] for r in chunks] == [False] * (len(sizes) - 1) + [True]
    assert all(any(r["piece"] == "round" and r["step"] == c["step"] for r in records) for c in chunks)  # others decoded


def test_whole_prompts_when_turned_off(tmp_path, monkeypatch):
    """max_prefill_tokens 0: each prompt in one forward, catch-ups whole, as before chunking was the default."""
    arch = "qwen2"
    prompts = random_prompts(3, [70, 5, 90], seed=47)
    budgets = [8, 20, 8]
    spec = SpecConfig(method="ragged", num_draft_tokens=3, batch_size=2, speculation="adaptive", max_prefill_tokens=0)
    path = tmp_path / "trace.jsonl"
    engine, outputs, _ = run_traced(arch, spec, prompts, budgets, path, monkeypatch)
    assert engine.prefill.budget is None
    assert_plain(arch, prompts, outputs, budgets)
    records = read_trace(path)
    prefills = [r for r in records if r["piece"] == "prefill"]
    assert sorted(t for r in prefills for t in r["tokens"]) == sorted(map(len, prompts))
    assert all(r["complete"] for r in records if r["piece"] in ("prefill", "catch_up"))


def test_trace_records_are_well_formed_and_cover_every_step(tmp_path):
    """One record per piece; every step from 0 to the last has one, its timestamp is common to its
    pieces and never goes back; a round names its rows, drafter steps and verify width."""
    arch = "llama"
    prompts = random_prompts(4, [30, 4, 50, 7], seed=53)
    budgets = [10, 14, 6, 14]
    path = tmp_path / "trace.jsonl"
    spec = SpecConfig(method="ragged", num_draft_tokens=3, batch_size=2, speculation="adaptive", max_prefill_tokens=16)
    with StepTrace(path) as trace:
        engine = build_engine(target(arch), spec, draft_model=drafter(arch), costs=FREE_CATCH_UP, trace=trace)
        outputs = engine.generate(prompts, [SamplingParams(max_new_tokens=b) for b in budgets])
    assert_plain(arch, prompts, outputs, budgets)
    records = read_trace(path)
    assert sorted({r["step"] for r in records}) == list(range(engine.steps))
    stamps: dict[int, float] = {}
    for r in records:
        assert {"step", "t", "piece", "s", "requests"} <= r.keys() and r["s"] >= 0
        assert stamps.setdefault(r["step"], r["t"]) == r["t"]
        if r["piece"] == "round":
            assert {"drafter_steps", "verify_width", "verified", "emitted", "probe"} <= r.keys()
            assert len(r["verified"]) == len(r["emitted"]) == len(r["requests"])
            assert max(r["verified"]) <= r["verify_width"] <= r["drafter_steps"] <= 3
        else:
            assert r["piece"] in ("prefill", "catch_up") and len(r["tokens"]) == len(r["requests"])
            assert isinstance(r["complete"], bool) and min(r["tokens"]) > 0
    assert list(stamps.values()) == sorted(stamps.values())
    assert sum(r["piece"] == "round" for r in records) == engine.stats.rounds
    emitted: dict[int, int] = defaultdict(int)
    for r in records:
        if r["piece"] == "round":
            for request, n in zip(r["requests"], r["emitted"]):
                emitted[request] += n
    assert all(emitted[s.index] == len(s.generated) - 1 for s in outputs)  # the first token comes from prefill
