"""The forensic audit: divergence classification, corruption flags, reports, other programs' outputs,
and the deliberately wrong methods it must catch."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from tinyworld import VOCAB_SIZE, WORDS, tiny_tokenizer

from batchspec.cli import main
from batchspec.config import ModelConfig, SamplingParams, SpecConfig
from batchspec.forensics import audit as audit_module
from batchspec.forensics.audit import (
    EXACT,
    FP_TIE,
    LENGTH,
    SYNC_ERROR,
    AuditItem,
    Auditor,
    classify_gap,
    compare_ids,
    compare_visible,
    pair_items,
    prefix_logits,
    read_outputs,
)
from batchspec.forensics.corruption import corruption_flags, find_loop
from batchspec.forensics.rouge import rouge_l
from batchspec.llm import LLM
from batchspec.models import encode_prompt, load_model, tiny_model
from batchspec.prompts import PromptRecord, load_prompts
from batchspec.reference import greedy_decode

MAX_NEW = 20
STOP = frozenset({1})


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> Path:
    """Six word prompts of 3..12 words: ragged lengths, two static batches of 4 and 2."""
    rng = random.Random(0)
    rows = [{"id": f"p{i}", "prompt": " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12)))} for i in range(6)]
    return write_jsonl(tmp_path_factory.mktemp("audit") / "prompts.jsonl", rows)


@pytest.fixture(scope="module")
def oracle_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("oracle") / "oracle.json"


# ---- pure pieces -----------------------------------------------------------------------------


def test_classify_gap_tie_is_fp_tie_and_far_token_is_sync_error() -> None:
    logits = torch.linspace(-5, 5, 50)
    logits[7] = logits[9] = 8.0  # an exact tie at the top
    assert classify_gap(logits, 7, 9, margin=1e-4) == (FP_TIE, 0.0, 0)
    logits[9] = 8.0 - 5e-5  # within the margin
    assert classify_gap(logits, 7, 9, margin=1e-4)[0] == FP_TIE
    kind, gap, rank = classify_gap(logits, 7, 0, margin=1e-4)  # the target's least likely token
    assert kind == SYNC_ERROR and gap == pytest.approx(13.0) and rank == 49
    assert classify_gap(logits, 7, 500, margin=1e-4)[0] == SYNC_ERROR  # not even in the vocabulary


def test_compare_ids_cases() -> None:
    oracle = [5, 6, 7, 1]  # ends with the stop token
    assert compare_ids(oracle, [5, 6, 7, 1], STOP).kind == EXACT
    assert compare_ids(oracle, [5, 6, 7], STOP).kind == EXACT  # stop token stripped by the writer
    c = compare_ids(oracle, [5, 9, 7, 1], STOP)
    assert (c.kind, c.position, c.oracle_token, c.audited_token, c.matched) == ("token", 1, 6, 9, 1)
    c = compare_ids(oracle, [5, 6, 7, 1, 8, 8], STOP)  # kept going after the stop token
    assert (c.kind, c.position, c.audited_token) == (SYNC_ERROR, 4, 8)
    assert compare_ids([5, 6, 7], [5, 6], STOP).kind == LENGTH  # shorter budget, nothing differs
    assert compare_ids([5, 6, 7], [5, 6, 7, 8], STOP).kind == LENGTH  # oracle hit its budget


def test_compare_visible_maps_positions_past_hidden_tokens() -> None:
    hidden = {0, 1, 2}
    oracle = [5, 2, 6, 7, 1]  # an <unk> at 1 and a stop at 4 never show in text
    assert compare_visible(oracle, [5, 6, 7], hidden).kind == EXACT
    c = compare_visible(oracle, [5, 6, 9], hidden)
    assert (c.kind, c.position, c.oracle_token, c.audited_token) == ("token", 3, 7, 9)
    c = compare_visible(oracle, [5, 6, 7, 8], hidden)  # the oracle stopped, the text goes on
    assert (c.kind, c.position, c.oracle_token, c.audited_token) == ("token", 4, 1, 8)
    assert compare_visible(oracle, [5, 6], hidden).kind == LENGTH


def test_corruption_flags_only_for_symptoms_the_oracle_lacks() -> None:
    assert find_loop([3, 4, 5, 5, 5, 5, 6]).repeats == 4
    assert find_loop([3, 4, 3, 4, 3, 4, 3, 4, 9]).size == 2
    assert find_loop([3, 4, 5, 3, 4, 5]) is None
    oracle = [3, 4, 5, 6, 1]
    flags = corruption_flags([3, 7, 7, 7, 7, 2, 2], "x \ufffd", oracle, "x", STOP, unk_id=2)
    assert flags == {"repetition_loop": True, "unknown_tokens": True, "empty": False, "beyond_eos": False}
    flags = corruption_flags([1, 8], "", oracle, "x", STOP, unk_id=2)
    assert flags["empty"] and flags["beyond_eos"]
    looping_oracle = [3, 3, 3, 3, 3, 3]
    assert not corruption_flags(looping_oracle, "", looping_oracle, "", STOP, 2)["repetition_loop"]


def test_rouge_l_barely_notices_a_swapped_word() -> None:
    reference = "the cat sat on the mat and then it slept in the warm sun all day"
    assert rouge_l(reference, reference) == 1.0
    assert rouge_l(reference.replace("slept", "not not"), reference) > 0.9
    assert rouge_l("", reference) == 0.0 and rouge_l("", "") == 1.0
    assert rouge_l("猫が寝た", "猫が寝る") == pytest.approx(2 * 0.75 * 0.75 / 1.5)


def test_pair_items_loses_nothing() -> None:
    prompts = [PromptRecord("a", "the a"), PromptRecord("b", "of to"), PromptRecord("c", "", error="bad line")]
    outputs = [
        AuditItem("a", token_ids=[3]),
        AuditItem("c", token_ids=[3]),
        AuditItem("z", token_ids=[3]),
        AuditItem("a", token_ids=[4]),
    ]
    items = pair_items(prompts, outputs, lambda text: [3, 4])
    assert [(i.id, i.prompt_ids, i.error) for i in items[:1]] == [("a", [3, 4], None)]
    errors = {i.id: i.error for i in items[1:4]}
    assert "no output" in errors["b"] and "unreadable" in errors["c"] and "no prompt" in errors["z"]
    assert len(items) == 5 and "duplicate output" in items[4].error


# ---- a model with a real tie -------------------------------------------------------------------


def test_divergence_at_a_real_tie_is_fp_tie_and_a_wrong_token_is_sync_error() -> None:
    """Duplicate one lm-head row: those two tokens then tie exactly at every position."""
    model, tok = tiny_model("llama", vocab_size=VOCAB_SIZE, seed=0), tiny_tokenizer()
    prompt = [5, 9, 14, 20]
    first = greedy_decode(model, prompt, MAX_NEW, STOP)
    t = first[3]
    u = next(x for x in range(3, VOCAB_SIZE) if x != t)
    with torch.no_grad():
        model.lm_head.weight[u] = model.lm_head.weight[t]
    oracle = greedy_decode(model, prompt, MAX_NEW, STOP)
    d = next(i for i, x in enumerate(oracle) if x in (t, u))
    tied = oracle[:d] + [u if oracle[d] == t else t] + oracle[d + 1 :]
    logits = prefix_logits(model, prompt + oracle[:d])
    wrong = oracle[:d] + [int(logits.argmin())] + oracle[d + 1 :]
    auditor = Auditor(model, tok, MAX_NEW, calibration_rows=2)
    items = [AuditItem("tie", prompt, tied), AuditItem("wrong", prompt, wrong), AuditItem("same", prompt, oracle)]
    report = auditor.audit(items)
    rows = {r["id"]: r for r in report["rows"]}
    assert rows["tie"]["classification"] == FP_TIE and rows["tie"]["divergence"]["logit_gap"] == 0.0
    assert rows["tie"]["first_divergence"] == d and rows["tie"]["partial_match"] == pytest.approx(d / len(oracle))
    assert rows["wrong"]["classification"] == SYNC_ERROR and rows["wrong"]["divergence"]["logit_gap"] > 1.0
    assert rows["same"]["exact_match"]
    t_ = report["totals"]
    assert (t_["exact_match"], t_["fp_ties"], t_["sync_errors"]) == (1, 1, 1)
    assert 0 < report["calibration"]["margin"] < 1e-2


# ---- our methods pass, the deliberately wrong ones are caught -----------------------------------


@pytest.fixture(scope="module")
def llm(tiny_pair_dirs) -> LLM:
    target, draft = tiny_pair_dirs
    return LLM(ModelConfig(str(target), str(draft)), spec=SpecConfig(num_draft_tokens=4))


@pytest.mark.parametrize("method", ["ragged", "eqspec", "naive-kv", "naive-positions", "naive-bonus"])
def test_audit_passes_our_methods_and_flags_naive_ones(llm, prompts_file, oracle_cache, tmp_path, method) -> None:
    records = load_prompts(prompts_file)
    llm.spec = SpecConfig(method=method, num_draft_tokens=4, batch_size=4)
    outs = llm.generate([r.text for r in records], SamplingParams(max_new_tokens=MAX_NEW))
    path = write_jsonl(tmp_path / "out.jsonl", [{"id": r.id, **o.to_json()} for r, o in zip(records, outs)])
    items = pair_items(records, read_outputs(path), lambda text: encode_prompt(llm.models.tokenizer, text))
    auditor = Auditor(llm.models.target, llm.models.tokenizer, MAX_NEW, oracle_cache=oracle_cache)
    totals = auditor.audit(items)["totals"]
    assert totals["audited"] == len(records)
    if method.startswith("naive-"):
        assert totals["exact_match"] <= 1 and totals["sync_errors"] >= len(records) - 1 and totals["fp_ties"] == 0
    else:
        assert totals["exact_match"] == len(records), totals


# ---- the CLI and other programs' outputs -------------------------------------------------------


def test_cli_writes_reports_reuses_the_oracle_cache_and_keeps_bad_rows(
    tiny_pair_dirs, prompts_file, tmp_path, monkeypatch
) -> None:
    target, draft = tiny_pair_dirs
    outputs = tmp_path / "out.jsonl"
    common = ["--target", str(target), "--max-new-tokens", str(MAX_NEW)]
    generate = ["generate", "--prompts", str(prompts_file), "-o", str(outputs), "--draft", str(draft), "-k", "3"]
    assert main([*generate, *common]) == 0
    rows = [json.loads(line) for line in outputs.read_text().splitlines()]
    rows = rows[1:] + [{"id": "ghost", "token_ids": [3, 4]}]  # p0 loses its output, an unknown id appears
    outputs.write_text("".join(json.dumps(r) + "\n" for r in rows) + "{not json\n")
    report, markdown, cache = tmp_path / "r.json", tmp_path / "r.md", tmp_path / "oracle.json"
    args = ["audit", "--prompts", str(prompts_file), "--outputs", str(outputs), "--report", str(report),
            "--markdown", str(markdown), "--oracle-cache", str(cache), *common]
    assert main(args) == 0
    data = json.loads(report.read_text())
    totals = data["totals"]
    for key in ("exact_match", "fp_ties", "sync_errors", "mean_partial_match", "mean_rouge_l", "corruption"):
        assert key in totals
    assert (totals["rows"], totals["audited"], totals["errors"], totals["exact_match"]) == (8, 5, 3, 5)
    assert data["calibration"]["source"] == "calibrated" and data["calibration"]["margin"] > 0
    row = next(r for r in data["rows"] if r["id"] == "p1")
    for key in ("exact_match", "partial_match", "first_divergence", "classification", "rouge_l", "flags"):
        assert key in row
    errors = {r["id"]: r["error"] for r in data["rows"] if r["error"]}
    assert "no output" in errors["p0"] and "no prompt" in errors["ghost"] and "invalid JSON" in errors["line 7"]
    assert "# batchspec audit" in markdown.read_text() and cache.is_file()

    def no_oracle(*args, **kwargs):
        raise AssertionError("the cached oracle should have been used")

    monkeypatch.setattr(audit_module, "greedy_decode", no_oracle)
    assert main([*args, "--margin", "1e-4"]) == 0
    assert json.loads(report.read_text())["totals"]["exact_match"] == 5


def test_audit_of_hf_generate_text_outputs(tiny_pair_dirs, prompts_file, tmp_path) -> None:
    """Another program's batched output (HF `generate`, left padding + attention mask), text only."""
    target, _ = tiny_pair_dirs
    model, tok = load_model(str(target))
    records = load_prompts(prompts_file)
    ids = [encode_prompt(tok, r.text) for r in records]
    width = max(len(p) for p in ids)
    input_ids = torch.tensor([[0] * (width - len(p)) + p for p in ids])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ids])
    out = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False,
                         pad_token_id=1, eos_token_id=1)
    texts = tok.batch_decode(out[:, width:], skip_special_tokens=True)
    outputs = write_jsonl(tmp_path / "hf.jsonl", [{"id": r.id, "text": t} for r, t in zip(records, texts)])
    items = pair_items(records, read_outputs(outputs), lambda text: encode_prompt(tok, text))
    assert all(i.token_ids is None and i.text is not None for i in items)
    report = Auditor(model, tok, MAX_NEW, margin=1e-4).audit(items)
    assert report["totals"]["exact_match"] == len(records), report["totals"]
    # A corrupted copy of one row is caught in text form too.
    first = texts[0].split()
    loop_word = "no" if first[2] != "no" else "water"
    items[0].text = " ".join(first[:2] + [loop_word] * 6)
    report = Auditor(model, tok, MAX_NEW, margin=1e-4).audit(items[:1])
    row = report["rows"][0]
    assert row["classification"] == SYNC_ERROR and row["flags"]["repetition_loop"] and row["first_divergence"] == 2
