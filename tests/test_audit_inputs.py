"""`batchspec.forensics.audit_inputs`: any program's output file is read line by line, and nothing
in it (bad JSON, bad bytes, missing fields, duplicates) stops the audit or silently drops a row."""

from __future__ import annotations

import json
from pathlib import Path

from batchspec.forensics.audit_inputs import AuditItem, pair_items, read_outputs
from batchspec.prompts import PromptRecord


def test_read_outputs_turns_every_bad_line_into_an_error_item(tmp_path: Path) -> None:
    lines = [
        json.dumps({"id": "a", "token_ids": [3, 4]}).encode(),
        b'{"id": "b", "text": "caf\xe9"}',  # Latin-1, not UTF-8
        b"",
        b"{not json",
        json.dumps([1, 2]).encode(),
        json.dumps({"token_ids": [3]}).encode(),
        json.dumps({"id": "c", "token_ids": [3, "x"]}).encode(),
        json.dumps({"id": "d", "error": "prompt too long"}).encode(),
        json.dumps({"id": "e", "text": "caf\u00e9 \u2028 ok", "prompt_token_ids": [5, 6]}, ensure_ascii=False).encode(),
    ]
    path = tmp_path / "out.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    items = {i.id: i for i in read_outputs(path)}
    assert items["a"].token_ids == [3, 4] and items["a"].error is None
    assert items["line 2"].error == "line 2 is not valid UTF-8 (byte 0xe9 at column 25)"
    assert "invalid JSON on line 4" in items["line 4"].error
    assert "not a JSON object" in items["line 5"].error and "no `id`" in items["line 6"].error
    assert "neither" in items["c"].error and "prompt too long" in items["d"].error
    # a raw U+2028 inside a JSON string is not a line break
    assert items["e"].text == "caf\u00e9 \u2028 ok" and items["e"].prompt_ids == [5, 6]
    assert len(items) == 8


def test_read_outputs_accepts_a_utf8_byte_order_mark(tmp_path: Path) -> None:
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps({"id": "a", "token_ids": [3]}).encode() + b"\r\n")
    assert read_outputs(path) == [AuditItem("a", token_ids=[3])]


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


def test_read_outputs_survives_deep_nesting_and_lone_surrogates(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    path.write_bytes(b"[" * 100_000 + b"\n" + b'{"id": "s", "text": "\\ud800"}\n')
    items = {i.id: i for i in read_outputs(path)}
    assert items["line 1"].error == "invalid JSON on line 1: nested too deeply"
    assert "lone surrogate" in items["s"].error and items["s"].text is None
