"""The online engine loop: one background thread owns the Engine; the HTTP side talks to it only
through a command queue (add / abort) and per-request asyncio queues (new tokens).

An Engine is not thread-safe and a step can take a whole round of model forwards, so the server
never calls it from the event loop: the thread drains the command queue, runs `step()` while there
is work (and sleeps on the queue when there is none), and after each step hands every request its
new tokens with `loop.call_soon_threadsafe`. A round that accepts several tokens is one update.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ..config import BatchspecError, SamplingParams
from ..engine import Engine
from ..logprobs import TokenLogprob
from ..sequence import Sequence
from .metrics import Metrics

log = logging.getLogger("batchspec.serve")

T = TypeVar("T")

# The model context the server reserves K/V for when the model's own is longer (or unknown).
DEFAULT_MAX_MODEL_LEN = 2048


class QueueFull(Exception):
    """The bounded waiting queue is full: the client should retry later (HTTP 429)."""


class EngineUnavailable(Exception):
    """The engine loop has died or is shutting down (HTTP 503)."""


@dataclass
class Update:
    """What a request gained since its last update: new tokens (one or more rounds' worth) with their
    logprobs when it asked for them, and how it ended, or why the engine could not finish it (`error`)."""

    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token in token_ids

    def then(self, later: Update) -> Update:
        """This update followed by `later`, as one."""
        logprobs = None if self.logprobs is None or later.logprobs is None else self.logprobs + later.logprobs
        return Update(self.token_ids + later.token_ids, later.finish_reason, later.error, logprobs)


class RequestHandle:
    """The HTTP side's end of one request: its updates, and a way to abort it."""

    def __init__(self, request_id: int, owner: EngineLoop, loop: asyncio.AbstractEventLoop) -> None:
        self.id = request_id
        self.arrival = time.perf_counter()
        self.finished = False
        self._owner = owner
        self._loop = loop
        self._queue: asyncio.Queue[Update] = asyncio.Queue()
        # engine-thread bookkeeping: what this request has been sent and has cost so far
        self.sent = 0
        self.drafted = 0
        self.accepted = 0

    async def updates(self) -> AsyncIterator[Update]:
        """Updates until the request ends; the updates already queued are merged into one (a slow
        client gets fewer, larger chunks, never a growing backlog). Raises EngineUnavailable."""
        while not self.finished:
            update = await self._queue.get()
            while not self._queue.empty() and update.finish_reason is None and update.error is None:
                update = update.then(self._queue.get_nowait())
            if update.error is not None:
                self.finished = True
                raise EngineUnavailable(update.error)
            self.finished = update.finish_reason is not None
            yield update

    def abort(self, reason: str = "abort") -> None:
        """Stop the request (its row is freed before the next round); `reason` labels the metrics
        ("stop" when the server found a stop string). A no-op once the request has ended."""
        if not self.finished:
            self.finished = True
            self._owner.abort(self.id, reason)

    def push(self, update: Update) -> None:
        """Called from the engine thread."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, update)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


class EngineLoop:
    """Owns `engine` in a background thread (`start`/`close`); `submit` and `abort` are thread-safe.

    The K/V buffer is reserved once, here: `max_model_len` tokens per row plus a round of drafts,
    for as many rows as `--max-num-seqs` (bounded by `--max-kv-slots`). At most `max_waiting`
    requests wait for a row; more are refused (QueueFull) rather than queued without bound.
    """

    def __init__(
        self, engine: Engine, metrics: Metrics, max_model_len: int | None = None, max_waiting: int = 256
    ) -> None:
        limit = engine.limit
        if max_model_len is None:
            max_model_len = min(limit or DEFAULT_MAX_MODEL_LEN, DEFAULT_MAX_MODEL_LEN)
        if max_model_len < 2:
            raise BatchspecError(f"--max-model-len must be >= 2 (a prompt and a token), got {max_model_len}")
        if limit is not None and max_model_len > limit:
            raise BatchspecError(f"--max-model-len {max_model_len} exceeds the model's context of {limit} tokens")
        if max_waiting < 1:
            raise BatchspecError(f"--max-waiting must be >= 1, got {max_waiting}")
        self.engine = engine
        self.metrics = metrics
        self.max_model_len = max_model_len
        self.max_waiting = max_waiting
        # as many rows as the policy uses, unless max_kv_slots caps them
        self.rows = engine.reserve(None, engine.slots_for(0, SamplingParams(max_new_tokens=max_model_len)))
        self.peak_running = 0  # the most rows ever decoding at once (never above `rows`)
        self._prefix_counted = (0, 0)  # the engine's prefix cache queries and hits already in the metrics
        self.error: str | None = None
        self._commands: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards the fields below, shared with the HTTP side
        self._handles: dict[int, RequestHandle] = {}
        self._waiting: set[int] = set()  # submitted, no row yet
        self._running = 0
        self._closed = False
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._run, name="batchspec-engine", daemon=True)
        metrics.set_load(self.num_running, self.num_waiting)

    # ---- HTTP side ----------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Stop the thread (after the round in progress) and end every request still in flight."""
        with self._lock:
            self._closed = True
        self._commands.put(("stop",))
        if self._thread.is_alive():
            self._thread.join()
        self._fail_all("the server is shutting down")

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None and not self._closed

    def num_running(self) -> int:
        return self._running

    def num_waiting(self) -> int:
        return len(self._waiting)

    def in_flight(self) -> int:
        with self._lock:
            return len(self._handles)

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> list[int]:
        """The engine's own check (vocabulary, context, K/V budget), without waiting for a round:
        it reads only what `reserve` fixed at start-up, so calling it from the HTTP side is safe."""
        return self.engine.validate(prompt_ids, params)

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> RequestHandle:
        """Queue a validated request; raises QueueFull or EngineUnavailable."""
        return self.submit_all(prompt_ids, [params])[0]

    def submit_all(self, prompt_ids: list[int], params: list[SamplingParams]) -> list[RequestHandle]:
        """Queue one request per params for one prompt (the n choices of a request), all or none:
        raises QueueFull when they do not all fit the waiting queue, or EngineUnavailable."""
        loop = asyncio.get_running_loop()
        with self._lock:
            if not self.alive:
                raise EngineUnavailable(self.error or "the engine loop is not running")
            if len(self._waiting) + len(params) > self.max_waiting:
                raise QueueFull(f"{len(self._waiting)} requests are already waiting for a row (--max-waiting "
                                f"{self.max_waiting}), {len(params)} more do not fit; retry later")
            handles = [RequestHandle(next(self._ids), self, loop) for _ in params]
            for handle in handles:
                self._handles[handle.id] = handle
                self._waiting.add(handle.id)
        for handle, p in zip(handles, params):
            self.metrics.prompt_tokens.inc(len(prompt_ids))
            self._commands.put(("add", handle.id, prompt_ids, p))
        return handles

    def call(self, work: Callable[[], T]) -> Future[T]:
        """Run `work` on the engine thread between two steps and return its future: work that needs
        the models (a prompt's plain forward for its logprobs) never runs beside a step, which would
        share their weights, threads and memory with it. Raises EngineUnavailable."""
        future: Future[T] = Future()
        with self._lock:  # with `_fail_all`'s lock: a call queued before the loop dies is answered
            if not self.alive:
                raise EngineUnavailable(self.error or "the engine loop is not running")
            self._commands.put(("call", work, future))
        return future

    def abort(self, request_id: int, reason: str = "abort") -> None:
        self._commands.put(("abort", request_id, reason))

    # ---- engine thread ------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while self._drain(block=not self.engine.has_unfinished()):
                if self.engine.has_unfinished():
                    self._publish(self.engine.step())
        except BaseException as exc:  # the engine is in an unknown state: serve nothing more
            log.exception("the engine loop died")
            self.error = f"the engine loop died: {type(exc).__name__}: {exc}"
            self._fail_all(self.error)

    def _drain(self, block: bool) -> bool:
        """Apply every queued command (waiting for one if `block`); False once asked to stop."""
        try:
            command = self._commands.get(block=block)
        except queue.Empty:
            return True
        while True:
            if command[0] == "stop":
                return False
            if command[0] == "add":
                self._add(*command[1:])
            elif command[0] == "call":
                self._call(*command[1:])
            else:
                self._abort(*command[1:])
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _add(self, request_id: int, prompt_ids: list[int], params: SamplingParams) -> None:
        try:
            self.engine.add_request(prompt_ids, params, request_id=request_id)
        except BatchspecError as err:  # validated on the HTTP side already; kept as this request's error
            self._finish(request_id, Update(error=str(err)))

    @staticmethod
    def _call(work: Callable[[], Any], future: Future) -> None:
        """A failing call is its caller's error, not the engine's: the loop goes on."""
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(work())
        except Exception as err:
            future.set_exception(err)

    def _abort(self, request_id: int, reason: str) -> None:
        seq = self.engine.abort(request_id)
        self._running = len(self.engine.running)
        self._finish(request_id, Update(finish_reason="abort"), reason, seq)

    def _publish(self, finished: list[Sequence]) -> None:
        """After a step: each request's new tokens, acceptance by draft position, finished requests."""
        self._running = len(self.engine.running)
        self.peak_running = max(self.peak_running, self._running)
        stats = self.engine.stats
        queries, hits = self._prefix_counted
        self.metrics.prefix_cache_queries.inc(stats.prefix_cache_queries - queries)
        self.metrics.prefix_cache_hits.inc(stats.prefix_cache_hits - hits)
        self._prefix_counted = (stats.prefix_cache_queries, stats.prefix_cache_hits)
        for seq in [*self.engine.running, *finished]:
            with self._lock:
                handle = self._handles.get(seq.index)
                self._waiting.discard(seq.index)
            if handle is None:
                continue
            if seq.drafted > handle.drafted:  # this step's round drafted for this row
                self.metrics.record_draft(seq.drafted - handle.drafted, seq.accepted - handle.accepted)
                handle.drafted, handle.accepted = seq.drafted, seq.accepted
            new = seq.generated[handle.sent :]
            logprobs = None if seq.logprobs is None else seq.logprobs[handle.sent : handle.sent + len(new)]
            if new:
                if handle.sent == 0:
                    self.metrics.time_to_first_token.observe(seq.token_times[0] - handle.arrival)
                handle.sent += len(new)
                self.metrics.generation_tokens.inc(len(new))
            if seq.finished:
                self._finish(seq.index, Update(new, seq.finish_reason, logprobs=logprobs), seq.finish_reason, seq)
            elif new:
                handle.push(Update(new, logprobs=logprobs))

    def _finish(self, request_id: int, update: Update, reason: str | None = None, seq: Sequence | None = None) -> None:
        with self._lock:
            handle = self._handles.pop(request_id, None)
            self._waiting.discard(request_id)
        if handle is None:
            return
        if reason is not None:
            end = seq.finish_time if seq is not None and seq.finish_time is not None else time.perf_counter()
            self.metrics.finished(reason, end - handle.arrival)
        handle.push(update)

    def _fail_all(self, message: str) -> None:
        """End every request in flight and every call not run (the thread will run none again)."""
        with self._lock:
            handles, self._handles = self._handles, {}
            self._waiting.clear()
            calls = []
            while True:
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    break
                if command[0] == "call":
                    calls.append(command[2])
        for handle in handles.values():
            handle.push(Update(error=message))
        for future in calls:
            if future.set_running_or_notify_cancel():
                future.set_exception(EngineUnavailable(message))
