"""Reading prompt files: JSONL (`prompt`, or SpecBench's `turns`) or plain text, one prompt a line.

Files are read as bytes and decoded line by line, so one bad line (invalid JSON, invalid UTF-8, JSON
nested too deeply to parse, a prompt that is not valid Unicode, a line longer than any prompt could
be, a record without a prompt) becomes an error record for that line instead of costing the whole
batch. Ids follow one rule, checked before anything is decoded: every prompt has its own id, a
string or an integer, compared as text.
"""

from __future__ import annotations

import codecs
import json
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from .errors import BatchspecError

FORMATS = ("auto", "jsonl", "text")
# JSON lines under any of its usual names, in any case (`.JSONL` read as text would decode the raw
# JSON of every line as the prompt)
JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
# No prompt a model can take is anywhere near this long; a longer line is an error record, and its
# bytes are skipped, not kept (a file without newlines, such as /dev/zero through a pipe, would
# otherwise be read into memory until it ran out).
MAX_LINE_BYTES = 16 * 2**20
# A FIFO (`--prompts <(...)`) has no size to check up front: reading stops with an error here.
MAX_FILE_BYTES = 2**30
_CHUNK = 2**20


@dataclass
class PromptRecord:
    """One prompt from a file. `error` is set when the line could not be read as a prompt, so the
    output still gets a record for it."""

    id: str
    text: str
    category: str | None = None
    error: str | None = None
    line: int = 0  # 1-based line of the file, for messages that point at it


def unicode_problem(text: str) -> str | None:
    """Why `text` cannot be tokenized, or None. JSON may spell a lone surrogate (`"\\ud800"`), which
    no tokenizer accepts (the fast ones raise a TypeError) and no UTF-8 output can hold."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        return f"the text is not valid Unicode: a lone surrogate U+{ord(text[err.start]):04X} at character {err.start + 1}"
    return None


def _record_id(obj: dict[str, Any], line_no: int) -> str:
    """The record's id as text: its `id` (or `question_id`), else its 0-based line number. Only
    strings and integers are ids: null would become "None", and a float or a list has no single
    spelling another program would match."""
    key = "id" if "id" in obj else "question_id" if "question_id" in obj else None
    if key is None:
        return str(line_no)
    value = obj[key]
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise BatchspecError(f"line {line_no + 1}: `{key}` is {_json_kind(value)}, not a string or an integer "
                             f"(leave it out to use the line number)")
    if isinstance(value, str) and unicode_problem(value):
        raise BatchspecError(f"line {line_no + 1}: `{key}` is not valid Unicode (it spells a lone surrogate)")
    return str(value)


def _json_kind(value: object) -> str:
    kinds = {type(None): "null", bool: "true or false", float: "a fractional number", list: "a list", dict: "an object"}
    return kinds.get(type(value), type(value).__name__)


def _from_json(obj: object, line_no: int) -> PromptRecord:
    line = line_no + 1
    if not isinstance(obj, dict):
        return PromptRecord(str(line_no), "", error="line is not a JSON object", line=line)
    rid = _record_id(obj, line_no)
    category = obj.get("category") if isinstance(obj.get("category"), str) else None
    text = obj.get("prompt")
    if not isinstance(text, str):
        turns = obj.get("turns")
        text = turns[0] if isinstance(turns, list) and turns and isinstance(turns[0], str) else None
    if text is None:
        return PromptRecord(rid, "", category, error="no `prompt` string or `turns` list in this record", line=line)
    problem = unicode_problem(text)
    if problem is not None:
        return PromptRecord(rid, "", category, error=f"line {line}: {problem}", line=line)
    return PromptRecord(rid, text, category, line=line)


def check_ids(records: list[PromptRecord], path: str | Path) -> None:
    """Refuse two prompts with one id (compared as text, so 1 and "1" are the same id): outputs,
    `--resume` and audits match records to prompts by id, and a shared one makes that ambiguous."""
    first: dict[str, int] = {}
    for record in records:
        if record.id in first:
            raise BatchspecError(f"id {record.id!r} is on lines {first[record.id]} and {record.line} of {path} "
                                 f"(ids are compared as text: 1 and \"1\" are one id); give every prompt its own id")
        first[record.id] = record.line


def detect_format(path: Path, lines: list[bytes]) -> str:
    """`jsonl` for a JSON-lines suffix (any case) or, whatever the name, when the first non-empty
    line opens a JSON object; `text` otherwise."""
    if path.suffix.lower() in JSONL_SUFFIXES:
        return "jsonl"
    first = next((line.strip() for line in lines if line.strip()), b"")
    return "jsonl" if first.startswith(b"{") else "text"


# A line read by read_lines that was longer than MAX_LINE_BYTES: its bytes are not kept.
TOO_LONG = b"\0too long\0"


def read_lines(path: Path, what: str = "prompts") -> list[bytes]:
    """A JSONL or text file's lines as bytes, without a leading UTF-8 byte order mark (which would
    otherwise become part of the first line, or make its JSON invalid). A line over MAX_LINE_BYTES
    comes back as TOO_LONG (see `line_problem`). `what` names the file in errors ("prompts",
    "outputs"). Only regular files and pipes are read: a device such as /dev/zero never ends."""
    _check_readable(path, what)
    try:
        with open(path, "rb") as f:
            return list(_split_lines(f, path, what))
    except OSError as err:
        raise BatchspecError(f"cannot read {what} file {path}: {err.strerror}") from None


def _check_readable(path: Path, what: str) -> None:
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise BatchspecError(f"{what} file not found: {path}") from None
    except OSError as err:
        raise BatchspecError(f"cannot read {what} file {path}: {err.strerror}") from None
    if stat.S_ISDIR(mode):
        raise BatchspecError(f"{what} path is a directory, not a file: {path}")
    if not (stat.S_ISREG(mode) or stat.S_ISFIFO(mode)):
        raise BatchspecError(f"{what} path is not a regular file or a pipe: {path}")


def _split_lines(f: BinaryIO, path: Path, what: str) -> Iterator[bytes]:
    """The lines of a binary file as bytes.splitlines() gives them (\\n, \\r and \\r\\n end a line;
    a leading UTF-8 byte order mark dropped), read a chunk at a time so that neither a huge line nor
    an endless pipe is held in memory: a line over MAX_LINE_BYTES comes back as TOO_LONG."""
    pending, total, dropped, first = b"", 0, False, True
    while chunk := f.read(_CHUNK):
        total += len(chunk)
        if total > MAX_FILE_BYTES:
            raise BatchspecError(f"{what} file {path} is larger than {_size(MAX_FILE_BYTES)}")
        if first:
            chunk, first = chunk.removeprefix(codecs.BOM_UTF8), False
        lines = (pending + chunk).splitlines(keepends=True)
        # the last piece may go on in the next chunk (a \r too: it may be the first half of \r\n)
        pending = lines.pop() if lines and not lines[-1].endswith(b"\n") else b""
        for line in lines:
            yield TOO_LONG if dropped or len(line) > MAX_LINE_BYTES + 2 else line.rstrip(b"\r\n")
            dropped = False
        if len(pending) > MAX_LINE_BYTES + 1:
            pending, dropped = b"", True
    for line in pending.splitlines():
        yield TOO_LONG if dropped else line
        dropped = False
    if dropped:
        yield TOO_LONG


def _size(limit: int) -> str:
    return f"{limit // 2**20} MiB" if limit >= 2**20 else f"{limit} bytes"


def line_problem(raw: bytes, number: int) -> str | None:
    """Why line `number` (1-based) was not kept (too long), or None."""
    if raw is TOO_LONG:
        return f"line {number} is longer than {_size(MAX_LINE_BYTES)}: no prompt a model takes is that long"
    return None


def decode_line(raw: bytes, number: int) -> tuple[str | None, str | None]:
    """(text, None), or (None, why) when line `number` (1-based) is too long or not valid UTF-8:
    one bad line costs that line only."""
    problem = line_problem(raw, number)
    if problem is not None:
        return None, problem
    try:
        return raw.decode("utf-8"), None
    except UnicodeDecodeError as err:
        where = f"byte 0x{raw[err.start]:02x} at column {err.start + 1}"
        return None, f"line {number} is not valid UTF-8 ({where})"


def parse_json_line(line: str, number: int) -> tuple[Any, str | None]:
    """(value, None), or (None, why) when line `number` is not JSON Python can hold: invalid, or
    nested so deeply that the parser runs out of stack (RecursionError, not a JSONDecodeError)."""
    try:
        return json.loads(line), None
    except json.JSONDecodeError as err:
        return None, f"invalid JSON on line {number}: {err.msg}"
    except RecursionError:
        return None, f"invalid JSON on line {number}: nested too deeply"


def load_prompts(path: str | Path, fmt: str = "auto") -> list[PromptRecord]:
    """All prompts of a file, in order: one record per non-empty line, with `error` set for a line
    that cannot be a prompt (too long, not UTF-8, not JSON, not an object with a prompt, not valid
    Unicode). `fmt` is `jsonl`, `text` or `auto` (see `detect_format`). A record's id is its `id`
    (or `question_id`) field, else its 0-based line number; ids that are not strings or integers, and
    two records with one id, are refused (`check_ids`)."""
    if fmt not in FORMATS:
        raise BatchspecError(f"unknown prompts format {fmt!r}; choose one of {', '.join(FORMATS)}")
    path = Path(path)
    lines = read_lines(path)
    if fmt == "auto":
        fmt = detect_format(path, lines)
    records = []
    for i, raw in enumerate(lines):
        line, error = decode_line(raw, i + 1)
        if line is not None and not line.strip():
            continue
        if line is not None and fmt == "jsonl":
            obj, error = parse_json_line(line, i + 1)
            if error is None:
                try:
                    records.append(_from_json(obj, i))
                except BatchspecError as err:
                    raise BatchspecError(f"{path}, {err}") from None
                continue
        records.append(PromptRecord(str(i), line if error is None else "", error=error, line=i + 1))
    if not records:
        raise BatchspecError(f"no prompts in {path}: it has no non-empty lines")
    check_ids(records, path)
    return records
