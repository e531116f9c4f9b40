"""Reading prompt files: JSONL (`prompt`, or SpecBench's `turns`) or plain text, one prompt a line.

Files are read as bytes and decoded line by line, so one bad line (invalid JSON, invalid UTF-8, a
record without a prompt) becomes an error record for that line instead of costing the whole batch.
"""

from __future__ import annotations

import codecs
import json
from dataclasses import dataclass
from pathlib import Path

from .config import BatchspecError

FORMATS = ("auto", "jsonl", "text")
# JSON lines under any of its usual names, in any case (`.JSONL` read as text would decode the raw
# JSON of every line as the prompt)
JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")


@dataclass
class PromptRecord:
    """One prompt from a file. `error` is set when the line could not be read as a prompt, so the
    output still gets a record for it."""

    id: str
    text: str
    category: str | None = None
    error: str | None = None


def _from_json(obj: object, line_no: int) -> PromptRecord:
    if not isinstance(obj, dict):
        return PromptRecord(str(line_no), "", error="line is not a JSON object")
    rid = str(obj.get("id", obj.get("question_id", line_no)))
    category = obj.get("category")
    if isinstance(obj.get("prompt"), str):
        return PromptRecord(rid, obj["prompt"], category)
    turns = obj.get("turns")
    if isinstance(turns, list) and turns and isinstance(turns[0], str):
        return PromptRecord(rid, turns[0], category)
    return PromptRecord(rid, "", category, error="no `prompt` string or `turns` list in this record")


def detect_format(path: Path, lines: list[bytes]) -> str:
    """`jsonl` for a JSON-lines suffix (any case) or, whatever the name, when the first non-empty
    line opens a JSON object; `text` otherwise."""
    if path.suffix.lower() in JSONL_SUFFIXES:
        return "jsonl"
    first = next((line.strip() for line in lines if line.strip()), b"")
    return "jsonl" if first.startswith(b"{") else "text"


def read_lines(path: Path, what: str = "prompts") -> list[bytes]:
    """A JSONL or text file's lines as bytes, without a leading UTF-8 byte order mark (which would
    otherwise become part of the first line, or make its JSON invalid). `what` names the file in
    errors ("prompts", "outputs")."""
    if path.is_dir():
        raise BatchspecError(f"{what} path is a directory, not a file: {path}")
    if not path.exists():
        raise BatchspecError(f"{what} file not found: {path}")
    try:
        data = path.read_bytes()
    except OSError as err:
        raise BatchspecError(f"cannot read {what} file {path}: {err.strerror}") from None
    return data.removeprefix(codecs.BOM_UTF8).splitlines()


def decode_line(raw: bytes, number: int) -> tuple[str | None, str | None]:
    """(text, None), or (None, why) when line `number` (1-based) is not valid UTF-8: one bad line
    costs that line only."""
    try:
        return raw.decode("utf-8"), None
    except UnicodeDecodeError as err:
        where = f"byte 0x{raw[err.start]:02x} at column {err.start + 1}"
        return None, f"line {number} is not valid UTF-8 ({where})"


def load_prompts(path: str | Path, fmt: str = "auto") -> list[PromptRecord]:
    """All prompts of a file, in order: one record per non-empty line, with `error` set for a line
    that is not valid UTF-8 or (JSONL) not a JSON object with a prompt. `fmt` is `jsonl`, `text`
    or `auto` (see `detect_format`). A record's id is its `id` (or `question_id`) field, else its
    0-based line number."""
    if fmt not in FORMATS:
        raise BatchspecError(f"unknown prompts format {fmt!r}; choose one of {', '.join(FORMATS)}")
    path = Path(path)
    lines = read_lines(path)
    if fmt == "auto":
        fmt = detect_format(path, lines)
    records = []
    for i, raw in enumerate(lines):
        line, error = decode_line(raw, i + 1)
        if line is None:
            records.append(PromptRecord(str(i), "", error=error))
            continue
        if not line.strip():
            continue
        if fmt == "text":
            records.append(PromptRecord(str(i), line))
            continue
        try:
            records.append(_from_json(json.loads(line), i))
        except json.JSONDecodeError as err:
            records.append(PromptRecord(str(i), "", error=f"invalid JSON on line {i + 1}: {err.msg}"))
    if not records:
        raise BatchspecError(f"no prompts in {path}: it has no non-empty lines")
    return records
