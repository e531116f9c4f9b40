"""`batchspec generate` end to end on the tiny pair: outputs, per-prompt error records, clear errors."""

from __future__ import annotations

import json

import pytest

from batchspec.cli import main


def _prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    lines = [
        json.dumps({"id": "a", "prompt": "the water is long"}),
        json.dumps({"id": "empty", "prompt": "   "}),
        "{not json",
        json.dumps({"id": "b", "turns": ["call him now and then", "ignored second turn"]}),
        json.dumps({"id": "long", "prompt": "word " * 600}),
        json.dumps({"id": "c", "prompt": "write the number"}),
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("method", ["ragged", "eqspec", "exspec"])
def test_generate_writes_every_prompt_and_verifies(tmp_path, tiny_pair_dirs, capsys, method):
    target, draft = tiny_pair_dirs
    out = tmp_path / "out.jsonl"
    code = main(["generate", "--prompts", str(_prompts_file(tmp_path)), "--target", str(target), "--draft", str(draft),
                 "--method", method, "--batch-size", "2", "--max-new-tokens", "8", "--output", str(out), "--verify"])
    assert code == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["a", "empty", "2", "b", "long", "c"]
    by_id = {r["id"]: r for r in rows}
    assert by_id["empty"]["error"] == "empty prompt"
    assert "invalid JSON" in by_id["2"]["error"]
    assert "exceeds the model's context" in by_id["long"]["error"]
    for rid in ("a", "b", "c"):
        row = by_id[rid]
        assert row["error"] is None and 1 <= len(row["token_ids"]) <= 8
        assert {"prompt", "text", "rounds", "accepted", "drafted", "finish_reason"} <= row.keys()
    assert by_id["b"]["prompt"] == "call him now and then"
    summary = json.loads(capsys.readouterr().out)
    assert summary["exact_match"] == "3/3"
    assert summary["errors"] == 3 and summary["prompts"] == 6


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--num-draft-tokens", "0"], "num_draft_tokens must be >= 1"),
        (["--max-new-tokens", "0"], "max_new_tokens must be >= 1"),
        (["--batch-size", "0"], "batch_size must be >= 1"),
        (["--target", "/nonexistent/model"], "not found"),
    ],
)
def test_bad_input_is_one_clear_line(tmp_path, tiny_pair_dirs, capsys, extra, message):
    target, draft = tiny_pair_dirs
    args = ["generate", "--prompts", str(_prompts_file(tmp_path)), "--target", str(target), "--draft", str(draft)]
    code = main(args + extra)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("batchspec generate: error:") and message in err[0]


def test_missing_prompts_file(capsys):
    assert main(["generate", "--prompts", "/nonexistent.jsonl"]) == 2
    assert "prompts file not found" in capsys.readouterr().err
