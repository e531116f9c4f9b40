"""Prompt lookup: vLLM's ngram semantics against a plain scan, incremental indexing, the drafters,
and `--draft ngram` loading no second model."""

from __future__ import annotations

import json

from hypothesis import given, settings, strategies as st

from batchspec.cli import main as cli_main
from batchspec.config import ModelConfig, SamplingParams, SpecConfig
from batchspec.drafters import NgramDrafter, NgramIndex
from batchspec.llm import LLM
from batchspec.models import load_pair
from batchspec.sequence import Sequence


def scan(tokens: list[int], min_n: int, max_n: int, k: int) -> tuple[int, list[int]]:
    """The definition, by brute force: the longest suffix of length min_n..max_n that occurs earlier
    (ending before the last token), its length, its first occurrence, and up to k tokens after it."""
    for n in range(min(max_n, len(tokens)), min_n - 1, -1):
        suffix = tokens[len(tokens) - n :]
        for start in range(len(tokens) - n):
            if tokens[start : start + n] == suffix:
                return n, tokens[start + n : start + n + k]
    return 0, []


def sequence(tokens: list[int], prompt_len: int) -> Sequence:
    seq = Sequence(0, tokens[:prompt_len], SamplingParams(max_new_tokens=1000), frozenset())
    seq.generated = tokens[prompt_len:]
    return seq


@settings(max_examples=200)
@given(
    tokens=st.lists(st.integers(0, 3), min_size=1, max_size=40),
    prompt_len=st.integers(1, 40),
    sizes=st.tuples(st.integers(1, 4), st.integers(0, 3)),
    k=st.integers(1, 6),
    steps=st.lists(st.integers(1, 5), max_size=8),
)
def test_lookup_matches_a_plain_scan_as_tokens_arrive(tokens, prompt_len, sizes, k, steps):
    """Index updates as tokens are committed (a few at a time, as rounds accept them) give exactly the
    scan's proposal at every point."""
    min_n, max_n = sizes[0], sizes[0] + sizes[1]
    prompt_len = min(prompt_len, len(tokens))
    index = NgramIndex(min_n, max_n)
    end = prompt_len
    for step in [0, *steps]:
        end = min(len(tokens), end + step)
        seq = sequence(tokens[:end], prompt_len)
        assert index.lookup(seq, k) == scan(tokens[:end], min_n, max_n, k)


def test_lookup_prefers_the_longest_suffix_then_the_first_occurrence():
    tokens = [1, 2, 9, 3, 1, 2, 8, 5, 7, 2, 8, 1, 2]
    assert scan(tokens, 1, 3, 4) == (2, [9, 3, 1, 2])  # "1 2" first occurs at the start
    assert NgramIndex(1, 3).lookup(sequence(tokens, 5), 4) == (2, [9, 3, 1, 2])
    assert NgramIndex(1, 3).lookup(sequence(tokens + [8], 5), 4) == (3, [5, 7, 2, 8])  # "1 2 8" beats "2 8"
    assert NgramIndex(3, 3).lookup(sequence([4, 5, 6, 4, 5], 5), 2) == (0, [])  # shorter than min_n: no match
    assert NgramIndex(1, 1).lookup(sequence([4, 5, 4], 3), 5) == (1, [5, 4])  # as far as the context goes


def test_drafter_proposes_per_row_and_forgets_finished_rows():
    drafter = NgramDrafter(1, 2)
    seqs = [sequence([1, 2, 3, 1, 2], 5), sequence([7, 8, 9], 3), sequence([4, 5, 4], 3)]
    draft = drafter.propose(seqs, 3)
    assert draft.width == 3 and draft.logits is None
    assert draft.row_lengths().tolist() == [3, 0, 2]  # the continuation runs up to the context's end
    assert draft.tokens[0].tolist() == [3, 1, 2] and draft.tokens[2, :2].tolist() == [5, 4]
    # confidence n / (n + 2) of the matched suffix's length n, the same for every slot of a row
    assert draft.confidence is not None and draft.confidence.tolist() == [[0.5] * 3, [0.0] * 3, [1 / 3] * 3]
    seqs[1].finish_reason = "stop"
    drafter.propose([seqs[0]], 3)
    assert {id(s) for s, _ in drafter.lookup.indexes.values()} == {id(seqs[0]), id(seqs[2])}
    none = drafter.propose([seqs[2]], 1)
    assert none.width == 1 and none.lengths is None  # every row proposes the same: no lengths needed


def test_draft_ngram_loads_no_second_model(tiny_pair_dirs, tmp_path, capsys):
    target, _ = tiny_pair_dirs
    config = ModelConfig(target=str(target), draft="ngram", chat_template=False)
    pair = load_pair(config)
    assert pair.draft is None
    llm = LLM(config, spec=SpecConfig(num_draft_tokens=3, batch_size=2, ngram_min=1, ngram_max=2), models=pair)
    assert llm.spec.drafter == "ngram"
    out = llm.generate(["the water is the water is the", "call him now"], SamplingParams(max_new_tokens=8))
    assert all(o.error is None and len(o.chosen_k) == o.rounds for o in out)
    prompts = tmp_path / "p.txt"
    prompts.write_text("the water is the water is the\nwrite a long word\n")
    result = tmp_path / "out.jsonl"
    assert cli_main(["generate", "--prompts", str(prompts), "--target", str(target), "--draft", "ngram",
                     "--no-chat-template", "--max-new-tokens", "8", "--ngram-min", "1", "--ngram-max", "3",
                     "--speculation", "adaptive", "--output", str(result), "--verify"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["exact_match"] == "2/2" and summary["chosen_k"]
    rows = [json.loads(line) for line in result.read_text().splitlines()]
    assert all(len(r["chosen_k"]) == len(r["proposed_k"]) == len(r["accepted_k"]) == r["rounds"] for r in rows)
    assert cli_main(["generate", "--prompts", str(prompts), "--target", str(target), "--draft", "ngram",
                     "--drafter", "hybrid"]) == 2
    assert "hybrid drafter needs a draft model" in capsys.readouterr().err


def test_ngram_drafts_are_point_masses_and_the_hybrid_forces_them():
    """A hybrid draft marks the n-gram slots as forced (rejection sampling treats their q as a point
    mass); when every row's continuation fills the round the model does not run."""
    from tinyworld import tiny_model

    from batchspec.drafters import HybridDrafter, ModelDrafter, NgramLookup
    from batchspec.layouts import RaggedLayout

    model = tiny_model("llama", vocab_size=40)
    seqs = [sequence([5, 6, 7, 5, 6], 5), sequence([9, 10, 11, 12], 4)]
    layout = RaggedLayout(model, 2, 32)
    layout.prefill([s.prompt_ids[:-1] for s in seqs])  # the drafter has seen all but the last token
    hybrid = HybridDrafter(NgramLookup(1, 2), ModelDrafter(layout))
    draft = hybrid.propose(seqs, 3)
    assert draft.forced is not None and draft.forced[0].tolist() == [True, True, True]
    assert draft.forced[1].tolist() == [False, False, False]
    assert draft.tokens[0].tolist() == [7, 5, 6]
    calls = []
    original = layout.forward
    layout.forward = lambda tokens, last_only=False: calls.append(tokens.shape) or original(tokens, last_only)
    both = [seqs[0], sequence([9, 10, 9, 10], 4)]
    full = hybrid.propose(both, 2)
    assert calls == [] and full.logits is None and full.tokens.tolist() == [[7, 5], [9, 10]]
    assert layout.lengths.tolist() == [4, 3]  # forgot its own drafts: committed tokens only
