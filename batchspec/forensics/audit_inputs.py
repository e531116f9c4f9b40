"""Reading the outputs to audit and pairing them with their prompts.

Outputs may come from any program, so nothing in them is trusted: a line that is not JSON, not
UTF-8 or lacks the fields the audit needs becomes an item with an `error`, and the audit reports it
instead of stopping. Rows need an `id` plus `token_ids` (a list of ints) or only `text`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..errors import BatchspecError
from ..prompts import PromptRecord, decode_line, parse_json_line, read_lines, unicode_problem


@dataclass
class AuditItem:
    """One prompt and the output to audit, or why it cannot be audited (`error`)."""

    id: str
    prompt_ids: list[int] | None = None
    token_ids: list[int] | None = None  # the audited output as ids ...
    text: str | None = None  # ... or, from programs that write only text, as text
    error: str | None = None


def _int_list(value: Any) -> list[int] | None:
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return list(value)
    return None


def _output_item(obj: Any, line_no: int) -> AuditItem:
    if not isinstance(obj, dict):
        return AuditItem(f"line {line_no}", error="output line is not a JSON object")
    if obj.get("id") is None:
        return AuditItem(f"line {line_no}", error="output row has no `id`")
    item = AuditItem(str(obj["id"]), prompt_ids=_int_list(obj.get("prompt_token_ids")) or None)
    if obj.get("error"):
        item.error = f"the run reported an error: {obj['error']}"
    elif _int_list(obj.get("token_ids")) is not None:
        item.token_ids = _int_list(obj["token_ids"])
    elif isinstance(obj.get("text"), str) and unicode_problem(obj["text"]):
        item.error = f"output `text`: {unicode_problem(obj['text'])}"
    elif isinstance(obj.get("text"), str):
        item.text = obj["text"]
    else:
        item.error = "output row has neither `token_ids` (a list of ints) nor `text`"
    return item


def read_outputs(path: str | Path) -> list[AuditItem]:
    """Output rows of any program, one JSON object a line; unreadable lines become error items.

    Lines are split as bytes and decoded one at a time, so one line that is not UTF-8 (or too long,
    or nested too deeply to parse) costs that line only; a UTF-8 byte-order mark (Windows editors write one) is dropped.
    """
    items = []
    for i, raw in enumerate(read_lines(Path(path), "outputs"), start=1):
        line, error = decode_line(raw, i)
        if line is None:
            items.append(AuditItem(f"line {i}", error=error))
            continue
        if not line.strip():
            continue
        obj, error = parse_json_line(line, i)
        items.append(AuditItem(f"line {i}", error=error) if error else _output_item(obj, i))
    return items


def pair_items(
    prompts: list[PromptRecord], outputs: list[AuditItem], encode: Callable[[str], list[int]]
) -> list[AuditItem]:
    """Match outputs to prompts by id, in prompt order, then outputs without a prompt.

    Nothing is dropped: a prompt without output, an output without prompt, duplicates and
    unencodable prompts all come back as items with an error. An output's own `prompt_token_ids`
    win over re-encoding the prompt text (they are what the run actually decoded).
    """
    by_id: dict[str, AuditItem] = {}
    items: list[AuditItem] = []
    for out in outputs:
        if out.id in by_id:
            items.append(AuditItem(out.id, error="duplicate output id (only the first is audited)"))
        else:
            by_id[out.id] = out
    paired: list[AuditItem] = []
    seen: set[str] = set()
    for record in prompts:
        if record.id in seen:
            paired.append(AuditItem(record.id, error="duplicate prompt id (only the first is audited)"))
            continue
        seen.add(record.id)
        item = by_id.pop(record.id, None)
        if item is None:
            paired.append(AuditItem(record.id, error="no output for this prompt"))
            continue
        if item.error is None and not item.prompt_ids:
            if record.error is not None:
                item = replace(item, error=f"prompt unreadable: {record.error}")
            else:
                try:
                    item = replace(item, prompt_ids=encode(record.text))
                except BatchspecError as err:
                    item = replace(item, error=f"prompt: {err}")
        paired.append(item)
    # An unreadable line has no real id; its own error says more than "no prompt".
    paired.extend(AuditItem(item.id, error=item.error or "no prompt with this id") for item in by_id.values())
    return paired + items
