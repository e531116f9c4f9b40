"""The forensic audit end to end: real ties against sync errors on a tiny model, the deliberately
wrong methods it must catch (fp32 and bf16), bad ids, the CLI and other programs' outputs.
The pure pieces are tested in test_audit_compare.py, test_audit_inputs.py and test_corruption.py."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from tinyworld import VOCAB_SIZE, WORDS, tiny_model, tiny_tokenizer

from batchspec.cli import main
from batchspec.config import ModelConfig, SamplingParams, SpecConfig
from batchspec.forensics import oracle as oracle_module
from batchspec.forensics.audit import Auditor
from batchspec.forensics.audit_inputs import AuditItem, pair_items, read_outputs
from batchspec.forensics.calibration import prefix_logits
from batchspec.forensics.compare import EXACT, FP_TIE, SYNC_ERROR, UNKNOWN_TOKEN
from batchspec.llm import LLM
from batchspec.models import ModelPair, encode_prompt, load_model, load_pair
from batchspec.prompts import load_prompts
from batchspec.reference import greedy_decode

MAX_NEW = 20
STOP = frozenset({1})


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def word_prompts(count: int, seed: int = 0) -> list[str]:
    """Prompts of 3..12 words: ragged lengths, so batches mix short and long rows."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) for _ in range(count)]


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> Path:
    """Six prompts: two static batches of 4 and 2."""
    rows = [{"id": f"p{i}", "prompt": text} for i, text in enumerate(word_prompts(6))]
    return write_jsonl(tmp_path_factory.mktemp("audit") / "prompts.jsonl", rows)


# ---- a model with a real tie -------------------------------------------------------------------


def test_a_real_tie_is_an_fp_tie_and_a_tie_that_diverges_again_is_a_sync_error() -> None:
    """Duplicate one lm-head row: those two tokens then tie exactly at every position. Taking the other
    one and decoding on from there is a real fp tie (as ids and as text); taking it but then copying
    the oracle's own continuation is what a desynchronised batch does: a tie, then divergence."""
    model, tok = tiny_model("llama", vocab_size=VOCAB_SIZE, seed=0), tiny_tokenizer()
    prompt = [5, 9, 14, 20]
    first = greedy_decode(model, prompt, MAX_NEW, STOP)
    t = first[3]
    u = next(x for x in range(3, VOCAB_SIZE) if x != t)
    with torch.no_grad():
        model.lm_head.weight[u] = model.lm_head.weight[t]
    oracle = greedy_decode(model, prompt, MAX_NEW, STOP)
    d = next(i for i, x in enumerate(oracle) if x in (t, u))
    other = u if oracle[d] == t else t
    tie = oracle[:d] + [other] + greedy_decode(model, prompt + oracle[:d] + [other], MAX_NEW - d - 1, STOP)
    spliced = oracle[:d] + [other] + oracle[d + 1 :]
    assert tie[d + 1 :] != oracle[d + 1 :]  # the continuation after the other token really differs
    logits = prefix_logits(model, prompt + oracle[:d])
    wrong = oracle[:d] + [int(logits.argmin())] + oracle[d + 1 :]
    auditor = Auditor(model, tok, MAX_NEW, calibration_rows=2)
    items = [
        AuditItem("tie", prompt, tie),
        AuditItem("tie-text", prompt, text=tok.decode(tie, skip_special_tokens=True)),
        AuditItem("spliced", prompt, spliced),
        AuditItem("wrong", prompt, wrong),
        AuditItem("same", prompt, oracle),
    ]
    report = auditor.audit(items)
    rows = {r["id"]: r for r in report["rows"]}
    for name in ("tie", "tie-text"):
        row = rows[name]
        assert row["classification"] == FP_TIE and row["divergence"]["logit_gap"] == 0.0, row
        assert row["first_divergence"] == d and row["partial_match"] == pytest.approx(d / len(oracle))
        cont = row["divergence"]["continuation"]
        hidden_stop = name == "tie-text" and tie[-1] in STOP  # text cannot show the final stop token
        assert cont["diverged_at"] is None and cont["checked"] == len(tie) - d - 1 - hidden_stop
    spliced_row = rows["spliced"]
    assert spliced_row["classification"] == SYNC_ERROR and spliced_row["divergence"]["tie_then_diverged"]
    assert spliced_row["divergence"]["logit_gap"] == 0.0 and spliced_row["divergence"]["continuation"]["diverged_at"] > d
    assert rows["wrong"]["classification"] == SYNC_ERROR and rows["wrong"]["divergence"]["logit_gap"] > 1.0
    assert not rows["wrong"]["divergence"]["tie_then_diverged"] and rows["wrong"]["divergence"]["continuation"] is None
    assert rows["same"]["exact_match"]
    t_ = report["totals"]
    assert (t_["exact_match"], t_["fp_ties"], t_["sync_errors"], t_["tie_then_diverged"]) == (1, 2, 2, 1)
    assert 0 < report["calibration"]["margin"] < 1e-2


# ---- our methods pass, the deliberately wrong ones are caught ---------------------------------------
# (in float32: engines refuse half-precision targets, which are not batch-invariant)


@pytest.fixture(scope="module")
def audit_setup(tiny_pair_dirs) -> dict[torch.dtype, tuple[ModelPair, Auditor]]:
    """The tiny pair in each dtype, with one auditor each (its oracle is decoded once per dtype)."""
    setups = {}
    for dtype in (torch.float32,):
        models = load_pair(ModelConfig(str(tiny_pair_dirs[0]), str(tiny_pair_dirs[1]), dtype=str(dtype).split(".")[1]))
        setups[dtype] = (models, Auditor(models.target, models.tokenizer, MAX_NEW))
    return setups


@pytest.mark.parametrize("dtype", [torch.float32], ids=["fp32"])
@pytest.mark.parametrize("method", ["ragged", "eqspec", "naive-kv", "naive-positions", "naive-bonus"])
def test_audit_passes_our_methods_and_calls_every_naive_divergence_a_sync_error(audit_setup, dtype, method) -> None:
    """naive-bonus's first divergences (the drafter's token where the target nearly agreed) may fall
    inside the tie margin; the continuation check must still call them sync errors."""
    models, auditor = audit_setup[dtype]
    prompts = [encode_prompt(models.tokenizer, text) for text in word_prompts(12)]
    llm = LLM(spec=SpecConfig(method=method, num_draft_tokens=4, batch_size=4), models=models)
    outputs = llm.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW))
    report = auditor.audit([AuditItem(f"p{i}", p, o.token_ids) for i, (p, o) in enumerate(zip(prompts, outputs))])
    totals = report["totals"]
    assert totals["audited"] == len(prompts)
    classes = [r["classification"] for r in report["rows"]]
    if method.startswith("naive-"):
        divergent = [c for c in classes if c != EXACT]
        assert divergent and set(divergent) == {SYNC_ERROR}, totals
    else:
        assert set(classes) <= {EXACT, FP_TIE} and totals["sync_errors"] == 0, totals
        if dtype == torch.float32:
            assert totals["exact_match"] == len(prompts), totals


# ---- ids the model or the tokenizer do not know --------------------------------------------------


def test_bad_ids_are_per_row_errors_and_padded_head_ids_are_unknown_tokens() -> None:
    """A model scoring more ids than its tokenizer knows (a padded LM head, as Qwen's): such an id in an
    output is an unknown token, not a sync error; an id the model cannot take at all is the row's error."""
    width = VOCAB_SIZE + 27
    model, tok = tiny_model("llama", vocab_size=width, seed=0), tiny_tokenizer()
    with torch.no_grad():
        model.lm_head.weight[VOCAB_SIZE:] = 0  # padded rows never win, as in a trained model
    prompt = [5, 9, 14, 20]
    oracle = greedy_decode(model, prompt, MAX_NEW, STOP)
    assert all(t < VOCAB_SIZE for t in oracle)
    padded_id = VOCAB_SIZE + 3
    items = [
        AuditItem("padded-id", prompt, oracle[:2] + [padded_id] + oracle[3:]),
        AuditItem("negative", prompt, oracle[:2] + [-1]),
        AuditItem("too-large", prompt, oracle[:2] + [width]),
        AuditItem("negative-prompt", [5, -3, 14], oracle),
        AuditItem("too-large-prompt", [5, 2**40], oracle),
        AuditItem("fine", prompt, oracle),
    ]
    report = Auditor(model, tok, MAX_NEW, margin=1e-4).audit(items)
    rows = {r["id"]: r for r in report["rows"]}
    assert rows["padded-id"]["classification"] == UNKNOWN_TOKEN and rows["padded-id"]["flags"]["unknown_tokens"]
    assert rows["padded-id"]["divergence"]["audited_token"] == padded_id
    assert rows["padded-id"]["divergence"]["audited_piece"] is None
    assert "id -1" in rows["negative"]["error"] and "`token_ids`" in rows["negative"]["error"]
    assert f"id {width}" in rows["too-large"]["error"]
    assert "`prompt_token_ids` holds id -3" in rows["negative-prompt"]["error"]
    assert f"id {2**40}" in rows["too-large-prompt"]["error"]
    assert rows["fine"]["exact_match"]
    totals = report["totals"]
    assert (totals["errors"], totals["unknown_token_divergences"], totals["sync_errors"]) == (4, 1, 0)


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
    body = "".join(json.dumps(r) + "\n" for r in rows) + "{not json\n"
    # a byte-order mark up front and a line that is not UTF-8 at the end
    outputs.write_bytes(b"\xef\xbb\xbf" + body.encode() + b'{"id": "p9", "text": "\xff"}\n')
    report, markdown, cache = tmp_path / "r.json", tmp_path / "r.md", tmp_path / "oracle.json"
    args = ["audit", "--prompts", str(prompts_file), "--outputs", str(outputs), "--report", str(report),
            "--markdown", str(markdown), "--oracle-cache", str(cache), *common]
    assert main(args) == 0
    data = json.loads(report.read_text())
    totals = data["totals"]
    for key in ("exact_match", "fp_ties", "sync_errors", "mean_partial_match", "mean_rouge_l", "corruption"):
        assert key in totals
    assert (totals["rows"], totals["audited"], totals["errors"], totals["exact_match"]) == (9, 5, 4, 5)
    assert data["calibration"]["source"] == "calibrated" and data["calibration"]["margin"] > 0
    row = next(r for r in data["rows"] if r["id"] == "p1")
    for key in ("exact_match", "partial_match", "first_divergence", "classification", "rouge_l", "flags"):
        assert key in row
    errors = {r["id"]: r["error"] for r in data["rows"] if r["error"]}
    assert "no output" in errors["p0"] and "no prompt" in errors["ghost"] and "invalid JSON" in errors["line 7"]
    assert "is not valid UTF-8" in errors["line 8"]
    assert "# batchspec audit" in markdown.read_text() and cache.is_file()

    def no_oracle(*args, **kwargs):
        raise AssertionError("the cached oracle should have been used")

    monkeypatch.setattr(oracle_module, "reference_decode", no_oracle)
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
