"""`generate`'s JSONL output, written so that a finished prompt is never lost.

Each record is appended to `<output>.partial` as soon as its prompt finishes (completion order,
flushed line by line); only when every prompt is done is the final file written, in input order,
and the `.partial` removed. Ctrl-C, a crash or a full disk leave the `.partial` behind, and a rerun
with `--resume` takes its records (and those of an earlier final file) instead of decoding those
prompts again. An exclusive lock on `<output>.lock` stops two runs from writing one output.
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
from pathlib import Path
from types import TracebackType
from typing import TextIO

from ..config import BatchspecError


def _sibling(path: Path, suffix: str) -> Path:
    return path.with_name(path.name + suffix)


def read_records(path: Path) -> dict[str, dict]:
    """Records of an earlier run's output or .partial, by id; lines that are not whole records (the
    torn last line of a killed run) are skipped, so those prompts are decoded again."""
    records: dict[str, dict] = {}
    for raw in path.read_bytes().splitlines():
        try:
            row = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue
        if isinstance(row, dict) and isinstance(row.get("id"), str):
            records[row["id"]] = row
    return records


class ResumableOutput:
    """The output file of one `generate` run; use as a context manager, call `write` for each
    finished record and `finish` once every prompt has one.

    Opening it checks the path, takes the lock and (with `resume`) reads the earlier records into
    `previous`, all before any model is loaded, so a bad path costs nothing.
    """

    def __init__(self, path: str | Path, resume: bool) -> None:
        self.path = Path(path)
        self.partial = _sibling(self.path, ".partial")
        self.lock_path = _sibling(self.path, ".lock")
        self.written = 0
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
