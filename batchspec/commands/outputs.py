"""`generate`'s JSONL output, written so that a finished prompt is never lost.

Each record is appended to `<output>.partial` as soon as its prompt finishes (completion order,
flushed line by line); only when every prompt is done is the final file written, in input order,
and the `.partial` removed. Ctrl-C, a crash or a full disk leave the `.partial` behind, and a rerun
with `--resume` takes its records (and those of an earlier final file) instead of decoding those
prompts again: records checked field by field and against this run's prompts, error records
decoded again unless `--keep-errors`. None of these files may be an input of the run. An exclusive lock on `<output>.lock` stops two runs from writing one output.
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
from pathlib import Path
from types import TracebackType
import warnings
from collections.abc import Callable
from typing import TextIO

from ..errors import BatchspecError
from ..prompts import PromptRecord


SIDE_SUFFIXES = (".partial", ".lock", ".tmp")  # the files a run writes next to its output


def _sibling(path: Path, suffix: str) -> Path:
    return path.with_name(path.name + suffix)


def _same_file(a: Path, b: Path) -> bool:
    """One file under two names: the same path once resolved (symlinks, `..`), or a hard link."""
    if a.resolve() == b.resolve():
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:  # either does not exist (yet)
        return False


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_ints(value: object) -> bool:
    return isinstance(value, list) and all(map(_is_int, value))


def _is_number(value: object) -> bool:
    return _is_int(value) or isinstance(value, float)


def _is_text(value: object) -> bool:
    return isinstance(value, str)


def _is_optional_text(value: object) -> bool:
    return value is None or isinstance(value, str)


# What a record of `generate` holds (RequestOutput.to_json plus `id`, less `index`), checked field by
# field when --resume would keep a record: a hand-edited or foreign line is decoded again instead.
RECORD_FIELDS: dict[str, Callable[[object], bool]] = {
    "id": _is_text, "prompt": _is_text, "prompt_token_ids": _is_ints, "text": _is_text, "token_ids": _is_ints,
    "finish_reason": _is_optional_text, "error": _is_optional_text, "rounds": _is_int, "drafted": _is_int,
    "accepted": _is_int, "proposed_k": _is_ints, "chosen_k": _is_ints, "accepted_k": _is_ints,
    "time_to_first_token": lambda v: v is None or _is_number(v), "latency": lambda v: v is None or _is_number(v),
    "token_times": lambda v: isinstance(v, list) and all(map(_is_number, v)),
    "logprobs": lambda v: v is None or isinstance(v, list),
    "prompt_logprobs": lambda v: v is None or isinstance(v, list),
}
# Fields newer than the records earlier versions wrote: a record without them is whole (it has none).
LATER_FIELDS = ("logprobs", "prompt_logprobs")


def record_problem(row: dict) -> str | None:
    """Why `row` is not a whole record of `generate`, or None."""
    for name, valid in RECORD_FIELDS.items():
        if name not in row:
            if name in LATER_FIELDS:
                continue
            return f"no `{name}`"
        if not valid(row[name]):
            return f"`{name}` has the wrong type"
    if row["error"] is None and not (row["token_ids"] and isinstance(row["finish_reason"], str)):
        return "neither an `error` nor generated `token_ids` with a `finish_reason`"
    if row["error"] is not None and row["token_ids"]:
        return "an `error` and `token_ids` both"
    return None


def read_records(path: Path) -> dict[str, dict]:
    """Records of an earlier run's output or .partial, by id; lines that are not whole records (the
    torn last line of a killed run, a line nested too deeply to parse) are skipped, so those prompts
    are decoded again."""
    records: dict[str, dict] = {}
    for raw in path.read_bytes().splitlines():
        try:
            row = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
            continue
        if isinstance(row, dict) and isinstance(row.get("id"), str):
            records[row["id"]] = row
    return records


class ResumableOutput:
    """The output file of one `generate` run; use as a context manager, call `write` for each
    finished record and `finish` once every prompt has one.

    Opening it checks the path (none of its files may be one of `inputs`: the run would delete or
    overwrite it), takes the lock and (with `resume`) reads the earlier records into `previous`, all
    before any model is loaded, so a bad path costs nothing. `kept` then says which of them belong
    to this run's prompts.
    """

    def __init__(self, path: str | Path, resume: bool, inputs: dict[str, str | Path] | None = None) -> None:
        self.path = Path(path)
        self.partial = _sibling(self.path, ".partial")
        self.lock_path = _sibling(self.path, ".lock")
        self.written = 0
        self._refuse_inputs(inputs or {})
        self._check_path()
        self._lock_fd = self._lock()
        try:
            self.previous = self._read_previous() if resume else {}
            if not resume and self.partial.is_file() and self.partial.stat().st_size:
                raise BatchspecError(f"{self.partial} holds records of an interrupted run: pass --resume to keep them "
                                     f"and decode only the rest, or delete it")
            self._file = self._open(self.partial, "a" if resume else "w")
        except BaseException:
            self._unlock()
            raise

    def _refuse_inputs(self, inputs: dict[str, str | Path]) -> None:
        """`--prompts o.lock -o o` would delete the prompts, `--prompts o.tmp` overwrite them, and
        `--prompts o.partial --resume` read them as finished records: refused before anything is touched."""
        own = {"the --output file": self.path, **{f"--output's {suffix} file": _sibling(self.path, suffix)
                                                  for suffix in SIDE_SUFFIXES}}
        for option, given in inputs.items():
            for what, path in own.items():
                if _same_file(Path(given), path):
                    raise BatchspecError(f"{option} {given} is {what} {path}: the run would destroy it; "
                                         f"choose another --output")

    def kept(self, records: list[PromptRecord], keep_errors: bool) -> dict[str, dict]:
        """The earlier records this run keeps, by id: whole records (`record_problem`; the others are
        decoded again, with a warning) of a prompt of `records` with the same text, and, unless
        `keep_errors`, without an error (a refusal may not recur: a prompt fixed since, a bug fixed).
        A record whose prompt text differs was written for another prompts file: refused."""
        by_id = {r.id: r for r in records}
        kept: dict[str, dict] = {}
        broken: list[str] = []
        for rid, row in self.previous.items():
            record = by_id.get(rid)
            if record is None:
                continue
            problem = record_problem(row)
            if problem is not None:
                broken.append(f"id {rid!r}: {problem}")
                continue
            if row["prompt"] != record.text:
                raise BatchspecError(f"--resume: the record of id {rid!r} in {self.path} or {self.partial} was written "
                                     f"for another prompt than line {record.line}'s: resume with the prompts file "
                                     f"of that run, or delete {self.path} and {self.partial} to start over")
            if row["error"] is None or keep_errors:
                kept[rid] = row
        if broken:
            warnings.warn(f"--resume: {len(broken)} earlier record(s) are not whole records of batchspec generate and "
                          f"are decoded again ({broken[0]})", stacklevel=2)
        return kept

    def _check_path(self) -> None:
        if self.path.is_dir():
            raise BatchspecError(f"--output is a directory, not a file: {self.path}")
        if self.path.exists() and not os.access(self.path, os.W_OK):
            raise BatchspecError(f"--output is not writable: {self.path}")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise BatchspecError(f"cannot create the folder of --output {self.path}: {err.strerror}") from None

    @staticmethod
    def _open(path: Path, mode: str) -> TextIO:
        try:
            return open(path, mode, encoding="utf-8")
        except OSError as err:
            raise BatchspecError(f"cannot write {path}: {err.strerror}") from None

    def _lock(self) -> int:
        """An exclusive lock on the lock file. The holder deletes the file before releasing it, so a
        run that locked a file which is no longer at that path (it raced with a release) retries."""
        while True:
            try:
                fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as err:
                raise BatchspecError(f"cannot write next to --output ({self.lock_path}): {err.strerror}") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise BatchspecError(f"another run is writing {self.path} (it holds {self.lock_path}); wait for it "
                                     f"or choose another --output") from None
            try:
                if os.stat(self.lock_path).st_ino == os.fstat(fd).st_ino:
                    return fd
            except FileNotFoundError:
                pass
            os.close(fd)

    def _unlock(self) -> None:
        self.lock_path.unlink(missing_ok=True)
        os.close(self._lock_fd)

    def _read_previous(self) -> dict[str, dict]:
        previous: dict[str, dict] = {}
        for path in (self.path, self.partial):  # the .partial is newer than the final file
            if path.is_file():
                try:
                    previous.update(read_records(path))
                except OSError as err:
                    raise BatchspecError(f"cannot read {path} to resume: {err.strerror}") from None
        return previous

    def write(self, record: dict) -> None:
        """Append one finished record to the .partial, flushed, so it survives Ctrl-C or a crash of this process."""
        try:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        except OSError as err:
            raise BatchspecError(f"cannot write {self.partial}: {err.strerror}; the {self.written} records "
                                 f"written so far are kept there: rerun with --resume") from None
        self.written += 1

    def finish(self, records: list[dict]) -> None:
        """Write the final file (all records, in input order) next to it, then move it into place
        and drop the .partial; on failure the .partial stays for --resume."""
        self._file.close()
        temporary = _sibling(self.path, ".tmp")
        try:
            with open(temporary, "w", encoding="utf-8") as f:
                for record in records:
                    f.write(json.dumps(record) + "\n")
            os.replace(temporary, self.path)
        except OSError as err:
            temporary.unlink(missing_ok=True)
            raise BatchspecError(f"cannot write {self.path}: {err.strerror}; the finished records are kept in "
                                 f"{self.partial}: rerun with --resume") from None
        self.partial.unlink()

    def __enter__(self) -> ResumableOutput:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self._file.close()
        if self.partial.is_file() and not self.partial.stat().st_size:
            self.partial.unlink()  # nothing finished: leave no .partial that asks for --resume
        elif kind is KeyboardInterrupt:
            print(f"batchspec generate: {self.partial} keeps the finished records: rerun with --resume to "
                  f"decode only the rest", file=sys.stderr)
        self._unlock()
