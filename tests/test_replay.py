"""The policy replay (`batchspec.bench.replay`): the real engine over scripted models decodes the
recorded outputs token for token, is billed exactly the cost table's prices of the forwards it ran,
and runs as many rounds as the arithmetic says."""

from __future__ import annotations

import math
import runpy
import sys
from collections.abc import Callable
from dataclasses import replace
from itertools import groupby
from pathlib import Path
from typing import Any

import pytest
from tinyworld import ScriptedCosts

from batchspec.bench.replay import Record, policies, replay
from batchspec.config import SpecConfig
from batchspec.draft import SHARED_CATCH_UP
from batchspec.trace import NullTrace

MAX_NEW = 24
STOP = 999
COSTS = ScriptedCosts(verify_base=1.0, verify_token=0.1, draft_step=0.2, draft_token=0.01)
ROOT = Path(__file__).parent.parent


def synthetic(right: Callable[[int, int], bool], lengths: tuple[int, ...] = (24, 13, 24, 17, 24, 9)) -> list[Record]:
    """Records with prompts of different lengths (none beginning another; the last longer than
    SHARED_CATCH_UP, so a lazy drafter catches it up alone) and outputs of `lengths` tokens; those
    shorter than MAX_NEW end at the stop token. right(i, t) says whether the drafter
    predicts output token t of record i (with confidence 0.9; a wrong guess has 0.3, or 0.8 every
    fifth position, so confidence alone does not tell)."""
    records = []
    for i, n in enumerate(lengths):
        prompt = [50 + i] + [7 + (i + j) % 5 for j in range(2 + 3 * i if i < 5 else SHARED_CATCH_UP + 8)]
        output = [100 + (11 * i + 3 * t) % 40 for t in range(n)]
        if n < MAX_NEW:
            output[-1] = STOP
        top = [tok if right(i, t) else tok + 500 for t, tok in enumerate(output)]
        p = [0.9 if right(i, t) else (0.8 if t % 5 == 0 else 0.3) for t in range(n)]
        records.append(Record("synthetic", prompt, output, top, p))
    return records


def mostly_right(i: int, t: int) -> bool:
    return (i + t) % 4 != 3


class MemoryTrace(NullTrace):
    """Keeps every piece the engine records, in order."""

    enabled = True

    def __init__(self) -> None:
        self.pieces: list[tuple[str, dict[str, Any]]] = []

    def record(self, piece: str, seconds: float, **fields: Any) -> None:
        self.pieces.append((piece, fields))


def configured(name: str, batch: int, chunk: int = 0, k: int = 3) -> SpecConfig:
    return replace(policies(k)[name], batch_size=batch, max_prefill_tokens=chunk)


@pytest.mark.parametrize("chunk", [0, 8])
@pytest.mark.parametrize("batch", [1, 2, 4])
@pytest.mark.parametrize("name", ["ar", "K=1", "K=3", "adaptive"])
def test_replay_decodes_the_recorded_outputs(name, batch, chunk):
    """Whatever the policy, batch and prefill chunking, the engine emits the recorded outputs; its
    drafts were both accepted and rejected, so acceptance was put to the test."""
    records = synthetic(mostly_right)
    run = replay(records, configured(name, batch, chunk), COSTS, MAX_NEW, costs=COSTS)
    assert run.outputs == [r.output for r in records]
    assert run.tokens == sum(len(r.output) - 1 for r in records)
    stats = run.engine.stats
    if name != "ar":
        assert 0 < stats.accepted < stats.drafted


def billed_by_trace(pieces: list[tuple[str, dict[str, Any]]], spec: SpecConfig) -> tuple[float, float, float]:
    """(all, drafter during rounds, verify) seconds at COSTS of the forwards the engine's own trace
    says it ran: the drafter's prefill at admission (fixed K: whole prompts in one forward per run of
    equal lengths, or a chunk at a time), each catch-up (shared by the round's rows, or one row's
    own), each round's drafting steps (the first feeding two tokens per row) and its verify. The
    target's prefill is not billed."""
    admission = spec.speculative and spec.speculation == "fixed"
    total = draft = verify = 0.0
    catch_ups: list[dict[str, Any]] = []
    for piece, fields in pieces:
        if piece == "prefill" and admission:
            if spec.max_prefill_tokens:
                total += COSTS.draft_time(1, fields["tokens"][0])
            else:
                total += sum(COSTS.draft_time(len(list(run)), n) for n, run in groupby(fields["tokens"]))
        elif piece == "catch_up":
            catch_ups.append(fields)
        elif piece == "round":
            rows, steps = len(fields["requests"]), fields["drafter_steps"]
            for c in catch_ups:
                draft += COSTS.draft_time(rows, max(c["tokens"])) if c["shared"] else COSTS.draft_time(1, c["tokens"][0])
            catch_ups = []
            if steps:
                draft += COSTS.draft_time(rows, 2) + (steps - 1) * COSTS.draft_time(rows, 1)
            verify += COSTS.verify_time(rows, fields["verify_width"] + 1)
    return total + draft + verify, draft, verify


@pytest.mark.parametrize("chunk", [0, 8])
@pytest.mark.parametrize("batch", [1, 2, 4])
@pytest.mark.parametrize("name", ["K=3", "adaptive"])
def test_replay_bills_the_forwards_the_engine_ran(name, batch, chunk):
    """The seconds billed are the cost table's prices of exactly the forwards the engine's trace
    records, and the engine's own phase timings (what the policy observes) saw those prices."""
    trace = MemoryTrace()
    spec = configured(name, batch, chunk)
    run = replay(synthetic(mostly_right), spec, COSTS, MAX_NEW, costs=COSTS, trace=trace)
    total, draft, verify = billed_by_trace(trace.pieces, spec)
    assert run.seconds == pytest.approx(total, rel=1e-12)
    assert run.engine.stats.verify_time == pytest.approx(verify, rel=1e-12)
    assert run.engine.stats.draft_time == pytest.approx(draft, rel=1e-12)
    if name == "adaptive":  # the lazy drafter catches prompts up: those forwards were billed too
        assert any(piece == "catch_up" for piece, _ in trace.pieces)


def rounds_and_seconds(records: list[Record], k: int) -> tuple[int, float]:
    """At batch 1 with whole prompts, a drafter that is always right and fixed K: each row's prompt
    is prefilled into the drafter in one forward, then every round drafts min(K, budget left - 1)
    tokens (the first step feeding two) and emits all of them plus the target's token, so a row of
    L output tokens (the first from the prefill) takes ceil((L - 1) / (K + 1)) rounds."""
    rounds, seconds = 0, 0.0
    for r in records:
        length = len(r.output)
        rounds += math.ceil((length - 1) / (k + 1))
        seconds += COSTS.draft_time(1, len(r.prompt))
        done = 1
        while done < length:
            steps = min(k, MAX_NEW - done - 1)
            if steps:
                seconds += COSTS.draft_time(1, 2) + (steps - 1) * COSTS.draft_time(1, 1)
            seconds += COSTS.verify_time(1, steps + 1)
            done += steps + 1
    return rounds, seconds


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_a_drafter_always_right_takes_the_rounds_the_arithmetic_says(k):
    records = synthetic(lambda i, t: True)
    run = replay(records, configured(f"K={k}", 1, k=k), COSTS, MAX_NEW, costs=COSTS)
    rounds, seconds = rounds_and_seconds(records, k)
    assert run.engine.stats.rounds == rounds
    assert run.seconds == pytest.approx(seconds, rel=1e-12)
    assert run.outputs == [r.output for r in records]


@pytest.mark.parametrize("k", [2, 3])
def test_rows_in_lockstep_share_every_round(k):
    """All rows admitted at once with outputs of the same length run their rounds together."""
    records = synthetic(lambda i, t: True, lengths=(MAX_NEW,) * 4)
    run = replay(records, configured(f"K={k}", 4, k=k), COSTS, MAX_NEW, costs=COSTS)
    assert run.engine.stats.rounds == math.ceil((MAX_NEW - 1) / (k + 1))


def test_a_drafter_always_wrong_emits_one_token_a_round():
    records = synthetic(lambda i, t: False)
    run = replay(records, configured("K=3", 1), COSTS, MAX_NEW, costs=COSTS)
    assert run.engine.stats.accepted == 0
    assert run.engine.stats.rounds == sum(len(r.output) - 1 for r in records)
    assert run.outputs == [r.output for r in records]


def test_prompts_that_cannot_be_told_apart_are_refused():
    records = synthetic(mostly_right)
    records[1].prompt = records[0].prompt + [3]
    with pytest.raises(ValueError, match="a prompt begins another"):
        replay(records, configured("K=3", 1), COSTS, MAX_NEW, costs=COSTS)


def test_the_script_reproduces_plain_and_fixed_k_of_the_recorded_specbench_rounds(monkeypatch, capsys):
    """The CLI on the recorded SpecBench rounds and a bench run's printed tables (no models loaded),
    admitting whole prompts: plain decoding and fixed K at batch 2 bill what the replay's earlier
    copy of the round billed for them (docs/results/spec_replay_xeon-amx_position_prior.txt)."""
    monkeypatch.setattr(sys, "argv", [
        "spec_replay.py", "--batch-sizes", "2", "-k", "2", "--max-prefill-tokens", "0",
        "--data", str(ROOT / "docs/results/replay_specbench12.json"),
        "--costs-from", str(ROOT / "docs/results/bench_xeon-amx_paired_b4-8.json")])
    runpy.run_path(str(ROOT / "scripts/spec_replay.py"), run_name="__main__")
    lines = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines() if line.strip()}
    assert lines["ar"][1:3] == ["7.21", "1.00x"]
    assert lines["K=1"][1:3] == ["9.37", "1.30x"]
    assert lines["K=2"][1:3] == ["10.23", "1.42x"]
    assert "adaptive" in lines
