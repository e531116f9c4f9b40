"""Prompt files as users write them: byte order marks, stray bytes, suffixes in any case, empty files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from batchspec.config import BatchspecError
from batchspec.prompts import load_prompts

BOM = b"\xef\xbb\xbf"


def _jsonl(*prompts: str) -> bytes:
    return b"".join(json.dumps({"id": f"p{i}", "prompt": p}).encode() + b"\n" for i, p in enumerate(prompts))


@pytest.mark.parametrize("name, data", [("p.txt", b"first\nsecond\n"), ("p.jsonl", _jsonl("first", "second"))])
def test_a_utf8_byte_order_mark_costs_nothing(tmp_path: Path, name: str, data: bytes) -> None:
    path = tmp_path / name
    path.write_bytes(BOM + data)
    records = load_prompts(path)
    assert [(r.text, r.error) for r in records] == [("first", None), ("second", None)]


@pytest.mark.parametrize("name", ["p.txt", "p.jsonl"])
def test_an_invalid_utf8_line_is_an_error_record_not_a_lost_batch(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    good = _jsonl("before", "after").splitlines() if name.endswith(".jsonl") else [b"before", b"after"]
    path.write_bytes(b"\n".join([good[0], b"caf\xe9 au lait", good[1]]) + b"\n")
    records = load_prompts(path)
    assert [r.text for r in records] == ["before", "", "after"]
    assert records[1].id == "1" and records[1].error == "line 2 is not valid UTF-8 (byte 0xe9 at column 4)"
    assert records[0].error is None and records[2].error is None


@pytest.mark.parametrize("suffix", [".JSONL", ".Jsonl", ".ndjson", ".NDJSON", ".json", ".JSON"])
def test_jsonl_suffixes_in_any_case_are_read_as_json(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"prompts{suffix}"
    path.write_bytes(_jsonl("the water"))
    assert [(r.id, r.text) for r in load_prompts(path)] == [("p0", "the water")]


@pytest.mark.parametrize("name", ["prompts.txt", "prompts", "prompts.data"])
def test_json_lines_are_recognized_by_content(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    path.write_bytes(b"\n  \n" + _jsonl("the water"))
    assert [(r.id, r.text) for r in load_prompts(path)] == [("p0", "the water")]
    # --format text reads the very same lines as prompts, braces and all
    assert [r.text for r in load_prompts(path, "text")] == [json.dumps({"id": "p0", "prompt": "the water"})]


def test_format_jsonl_is_forced_on_any_file(tmp_path: Path) -> None:
    path = tmp_path / "prompts.txt"
    path.write_text("not json\n" + json.dumps({"prompt": "x"}) + "\n")
    assert [r.text for r in load_prompts(path)] == ["not json", json.dumps({"prompt": "x"})]
    records = load_prompts(path, "jsonl")
    assert "invalid JSON on line 1" in records[0].error and records[1].text == "x"
    with pytest.raises(BatchspecError, match="unknown prompts format 'yaml'"):
        load_prompts(path, "yaml")


def test_text_lines_end_at_crlf(tmp_path: Path) -> None:
    path = tmp_path / "p.txt"
    path.write_bytes(b"one\r\ntwo\r\n")
    assert [(r.id, r.text) for r in load_prompts(path)] == [("0", "one"), ("1", "two")]


@pytest.mark.parametrize("name", ["empty.txt", "empty.jsonl", "empty"])
@pytest.mark.parametrize("data", [b"", b"\n \n\t\n", BOM])
def test_files_without_prompts_are_refused_whatever_their_format(tmp_path: Path, name: str, data: bytes) -> None:
    path = tmp_path / name
    path.write_bytes(data)
    with pytest.raises(BatchspecError, match="no prompts in .*: it has no non-empty lines"):
        load_prompts(path)


def test_a_directory_or_a_missing_file_says_so(tmp_path: Path) -> None:
    with pytest.raises(BatchspecError, match="prompts path is a directory, not a file"):
        load_prompts(tmp_path)
    with pytest.raises(BatchspecError, match="prompts file not found"):
        load_prompts(tmp_path / "missing.jsonl")


def test_lines_that_cannot_be_prompts_are_error_records(tmp_path: Path, monkeypatch) -> None:
    import batchspec.prompts

    monkeypatch.setattr(batchspec.prompts, "MAX_LINE_BYTES", 150_000)
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'{"prompt": "\\ud800 x"}\n' + b"[" * 100_000 + b"\n" + b'{"prompt": "' + b"a" * 200_000 + b'"}\n'
                     + b'{"turns": ["\\udfff"]}\n{"prompt": "fine"}\n')
    records = load_prompts(path)
    assert [r.id for r in records] == ["0", "1", "2", "3", "4"]
    assert "lone surrogate U+D800 at character 1" in records[0].error
    assert records[1].error == "invalid JSON on line 2: nested too deeply"
    assert records[2].error.startswith("line 3 is longer than 150000 bytes")
    assert "lone surrogate U+DFFF" in records[3].error
    assert (records[4].text, records[4].error) == ("fine", None)


def test_lines_split_across_read_chunks_keep_their_numbers(tmp_path: Path, monkeypatch) -> None:
    """A \\r\\n split between two reads is one line break, not two (ids are line numbers)."""
    import batchspec.prompts

    monkeypatch.setattr(batchspec.prompts, "_CHUNK", 3)
    path = tmp_path / "p.txt"
    path.write_bytes(BOM + b"ab\r\ncd\r\rxyz\nlast")
    assert [(r.id, r.text) for r in load_prompts(path)] == [("0", "ab"), ("1", "cd"), ("3", "xyz"), ("4", "last")]


@pytest.mark.parametrize("lines, message", [
    (['{"id": 1, "prompt": "a"}', '{"id": "1", "prompt": "b"}'], "id '1' is on lines 1 and 2"),
    (['{"id": "3", "prompt": "a"}', "x", "y", "{broken"], "id '3' is on lines 1 and 4"),  # the line number's id
    (['{"question_id": null, "prompt": "a"}'], "line 1: `question_id` is null"),
    (['{"id": 1.5, "prompt": "a"}'], "line 1: `id` is a fractional number"),
    (['{"id": "\\ud800", "prompt": "a"}'], "line 1: `id` is not valid Unicode"),
])
def test_one_id_rule(tmp_path: Path, lines: list[str], message: str) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(BatchspecError, match=message.replace("\\", "\\\\")):
        load_prompts(path)


def test_devices_are_refused_and_pipes_are_read(tmp_path: Path) -> None:
    import os
    import threading

    with pytest.raises(BatchspecError, match="not a regular file or a pipe: /dev/zero"):
        load_prompts("/dev/zero")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_bytes(b"one\ntwo\n"), daemon=True)
    writer.start()
    assert [r.text for r in load_prompts(fifo)] == ["one", "two"]
