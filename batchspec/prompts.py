"""Reading prompt files: JSONL (`prompt`, or SpecBench's `turns`) or plain text, one prompt a line."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .config import BatchspecError


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


def load_prompts(path: str | Path) -> list[PromptRecord]:
    """All prompts of a file, in order. `.jsonl`/`.json` files are read as JSON lines; anything else
    as plain text with one prompt per non-empty line."""
    path = Path(path)
    if not path.is_file():
        raise BatchspecError(f"prompts file not found: {path}")
    lines = path.read_text(encoding="utf-8").splitlines()
    if path.suffix not in (".jsonl", ".json"):
        return [PromptRecord(str(i), line) for i, line in enumerate(lines) if line.strip()]
    records = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            records.append(_from_json(json.loads(line), i))
        except json.JSONDecodeError as err:
            records.append(PromptRecord(str(i), "", error=f"invalid JSON on line {i + 1}: {err.msg}"))
    if not records:
        raise BatchspecError(f"no prompts in {path}")
    return records
