"""The HTTP side of `batchspec serve`: an OpenAI-compatible FastAPI app around one EngineLoop.

Everything here is async and never touches the engine: a request's body is read (413 beyond
`--max-body-bytes`, 408 when it takes longer than `--body-timeout`), then parsed, encoded and
validated in a worker thread (400 at once if it can never be served: a 4 MB prompt tokenizes for
seconds, and on the event loop it stalled every other client and `/health`), submitted to the
engine loop (429 when the waiting queue is full, 503 when the loop has died), and answered from its
updates, as one JSON body or as server-sent events (one chunk per update, so a round that accepts
several tokens is one chunk). A response that ends early, because the client went away or a stop
string was found, aborts its request, so its row stops costing compute before the next round.

`n` choices are n engine requests (`config.choice_params`: choice i has seed `seed + i`), answered
together (streamed: chunks of every choice as they come, each with its index). Logprobs of generated
tokens come with the engine's updates; those of an echoed prompt from one plain forward of the
prompt (`reference.prompt_logprobs`), run on the engine thread between steps (`EngineLoop.call`).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from ..config import BatchspecError, ModelConfig, SamplingParams, SpecConfig, choice_params
from ..llm import LLM
from ..logprobs import TokenLogprob
from ..methods import METHODS
from ..models import ModelPair, encode_prompt
from ..reference import prompt_logprobs
from .loop import EngineLoop, EngineUnavailable, QueueFull, RequestHandle
from .metrics import Metrics
from .protocol import APIError, ChatCompletionRequest, CompletionRequest, _Request, short_repr
from .text import TextStream, TokenSpeller, encode_chat

T = TypeVar("T")


DEFAULT_MAX_BODY_BYTES = 4 * 2**20  # a prompt filling a 32k-token context is ~150 KB of text
DOCS_PATHS = ("/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json")
DEFAULT_MAX_N = 8  # choices per request: n requests in flight, each its own prefill (no prefix cache yet)
# JSON has no -inf (a token outside a sampled request's top-k/top-p support): vLLM's stand-in for it.
LOWEST_LOGPROB = -9999.0


@dataclass(frozen=True)
class ServeOptions:
    """Server settings beyond the models and decoding (see `batchspec serve --help`). `docs` serves
    FastAPI's /docs, /redoc and /openapi.json (behind the key when there is one)."""

    served_model_name: str = "bundled"
    max_model_len: int | None = None  # None: min(model context, 2048)
    max_waiting: int = 256
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    body_timeout: float = 30.0  # seconds to receive a request's whole body
    docs: bool = False
    max_n: int = DEFAULT_MAX_N  # choices (`n`) a request may ask for

    def __post_init__(self) -> None:
        if self.api_key is not None and not self.api_key.strip():
            # what `--api-key "$KEY"` gives when KEY is unset: it must not start an open server silently
            raise BatchspecError("--api-key is empty (an unset variable?): give the key, or leave --api-key out "
                                 "to serve without one")
        if self.max_body_bytes < 1:
            raise BatchspecError(f"--max-body-bytes must be >= 1, got {self.max_body_bytes}")
        if not self.body_timeout > 0:
            raise BatchspecError(f"--body-timeout must be > 0, got {self.body_timeout}")
        if self.max_n < 1:
            raise BatchspecError(f"--max-n must be >= 1, got {self.max_n}")


@dataclass
class _Piece:
    """What one update adds to a choice: text, the tokens behind it, the finish reason, and the tokens'
    logprobs when asked for."""

    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None


@dataclass
class _Prepared:
    """A request checked and encoded: its prompt (ids, and text as `echo` shows it), the engine's
    params (choice 0's) and how many choices."""

    body: _Request
    ids: list[int]
    prompt_text: str
    params: SamplingParams
    n: int


class _Server:
    """The endpoints' state: the engine loop, the tokenizer and how prompts are encoded."""

    def __init__(self, models: ModelPair, model_config: ModelConfig, spec: SpecConfig, options: ServeOptions) -> None:
        if METHODS[spec.method].deliberately_wrong:
            raise BatchspecError(f"method {spec.method} is deliberately wrong (kept for audits); it is not served")
        engine = LLM(model_config, spec, models=models).make_engine()
        self.metrics = Metrics(options.served_model_name, engine.k)
        self.loop = EngineLoop(engine, self.metrics, options.max_model_len, options.max_waiting)
        self.target = models.target
        self.tokenizer = models.tokenizer
        self._tokenizer_lock = threading.Lock()
        self.model_config = model_config
        self.options = options
        self.created = int(time.time())

    # ---- endpoints ----------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        raw = await self._body(request)
        return await self._respond(await anyio.to_thread.run_sync(self._prepare_completion, raw), chat=False)

    async def chat_completions(self, request: Request) -> Response:
        raw = await self._body(request)
        return await self._respond(await anyio.to_thread.run_sync(self._prepare_chat, raw), chat=True)

    async def models(self) -> dict[str, Any]:
        card = {"id": self.options.served_model_name, "object": "model", "created": self.created,
                "owned_by": "batchspec", "max_model_len": self.loop.max_model_len}
        return {"object": "list", "data": [card]}

    async def health(self) -> Response:
        if not self.loop.alive:
            message = self.loop.error or "the engine loop is not running"
            return APIError(503, message, code="engine_unavailable").response()
        return JSONResponse({"status": "ok"})

    async def metrics_text(self) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    # ---- one request --------------------------------------------------------------------------
    async def _body(self, request: Request) -> bytes:
        """The request's body, at most `max_body_bytes` (413) and received within `body_timeout`
        seconds (408: a client sending a byte a minute would hold its connection forever)."""
        limit = self.options.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise _too_large(limit)
        chunks, size = [], 0
        try:
            with anyio.fail_after(self.options.body_timeout):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > limit:
                        raise _too_large(limit)
                    chunks.append(chunk)
        except TimeoutError:
            raise APIError(408, f"the request body did not arrive within {self.options.body_timeout:g} s "
                           "(--body-timeout)", code="request_timeout") from None
        return b"".join(chunks)

    def _prepare_completion(self, raw: bytes) -> _Prepared:
        """Parse, check and encode a completion (in a worker thread: tokenizing may take seconds)."""
        body = _parse(raw, CompletionRequest)
        self._check(body)
        prompt = body.single_prompt()
        if isinstance(prompt, str):
            ids = self._encode(lambda: encode_prompt(self.tokenizer, prompt, False,
                                                     self.model_config.allow_special_tokens), "prompt")
        else:
            ids = list(prompt)
        params = self._validate(body, ids, "prompt")
        text = prompt if isinstance(prompt, str) else self._encode(lambda: self.tokenizer.decode(ids), "prompt")
        return _Prepared(body, ids, text, params, body.choices(self.options.max_n))

    def _prepare_chat(self, raw: bytes) -> _Prepared:
        """Parse, check and render a chat completion (in a worker thread, as `_prepare_completion`)."""
        body = _parse(raw, ChatCompletionRequest)
        self._check(body)
        if not self.model_config.chat_template:
            raise APIError(400, "the chat template is off (--no-chat-template): use /v1/completions", "messages")
        if not body.messages:
            raise APIError(400, "messages must not be empty", "messages")
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        ids = self._encode(lambda: encode_chat(self.tokenizer, messages, self.model_config.allow_special_tokens),
                           "messages")
        return _Prepared(body, ids, "", self._validate(body, ids, "messages"), body.choices(self.options.max_n))

    def _check(self, body: _Request) -> None:
        if body.model is not None and body.model != self.options.served_model_name:
            raise APIError(404, f"The model {short_repr(body.model)} does not exist (this server serves "
                           f"`{self.options.served_model_name}`)", "model", "model_not_found")
        body.refuse_unsupported()

    def _encode(self, encode: Callable[[], list[int]], param: str) -> list[int]:
        """Run `encode` under the tokenizer's lock: requests are encoded in worker threads, and two
        encodings at once gave wrong ids (tokenizing switches settings of the shared tokenizer)."""
        try:
            with self._tokenizer_lock:
                return encode()
        except BatchspecError as err:
            raise APIError(400, str(err), param) from err

    def _validate(self, body: _Request, ids: list[int], field: str) -> SamplingParams:
        """Every refusal a request can get before it is queued (a 400 naming the field). A request that
        decodes nothing (echo, max_tokens 0) is checked as one that decodes a token."""
        limit = self.loop.max_model_len
        if len(ids) >= limit:
            raise APIError(400, f"prompt of {len(ids)} tokens leaves no room for output in the context of {limit} "
                           "tokens (--max-model-len)", field)
        budget = body.token_budget() if body.decodes() else 1
        params = body.sampling_params(limit - len(ids) if budget is None else budget)  # None: the rest of the context
        if len(ids) + params.max_new_tokens > limit:
            raise APIError(400, f"prompt of {len(ids)} tokens + max_tokens {params.max_new_tokens} exceeds the context "
                           f"of {limit} tokens (--max-model-len)", "max_tokens")
        try:
            self.loop.validate(ids, params)
        except BatchspecError as err:
            raise APIError(400, str(err), field) from err
        return params

    async def _respond(self, prepared: _Prepared, chat: bool) -> Response:
        """Compute an echoed prompt's logprobs, submit the request's choices and answer them."""
        body, ids, params = prepared.body, prepared.ids, prepared.params
        echoed: list[TokenLogprob | None] | None = None
        top = body.prompt_logprobs_asked()
        if top is not None:
            scoring = replace(params, prompt_logprobs=top)
            echoed = await self._on_engine(lambda: prompt_logprobs(self.target, ids, scoring))
        handles: list[RequestHandle] = []
        if body.decodes():
            try:
                handles = self.loop.submit_all(ids, choice_params(params, prepared.n))
            except QueueFull as err:
                raise APIError(429, str(err), code="queue_full") from err
            except EngineUnavailable as err:
                raise APIError(503, str(err), code="engine_unavailable") from err
            pieces = [_pieces(h, TextStream(self.tokenizer, body.stop_strings())) for h in handles]
        else:
            pieces = [_nothing_decoded() for _ in range(prepared.n)]
        reply = _Reply(self.options.served_model_name, chat, body, prepared, self.tokenizer, echoed)
        if body.stream:
            return _StreamedResponse(handles, reply.events(pieces))
        return _AwaitedResponse(handles, lambda: reply.whole(pieces))

    async def _on_engine(self, work: Callable[[], T]) -> T:
        """`work`'s result, run on the engine thread between steps (`EngineLoop.call`); 503 if the loop
        is gone."""
        try:
            return await asyncio.wrap_future(self.loop.call(work))
        except EngineUnavailable as err:
            raise APIError(503, str(err), code="engine_unavailable") from err


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than {limit} bytes (--max-body-bytes)", code="request_too_large")


def _parse(raw: bytes, model: type[_Request]) -> _Request:
    """A request body as `model`, or a 400: invalid JSON (or UTF-8), JSON nested deeper than Python
    parses (a RecursionError), an integer of more digits than Python converts (a ValueError), or
    the first field that does not validate, named as the API spells it."""
    try:
        data = json.loads(raw)
    except RecursionError:
        raise APIError(400, "invalid JSON body: nested too deeply") from None
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError, too many digits
        raise APIError(400, f"invalid JSON body: {err}") from None
    try:
        return model.model_validate(data)
    except ValidationError as err:
        first = err.errors(include_url=False, include_input=False)[0]
        where = ".".join(str(part) for part in first.get("loc", ()))
        raise APIError(400, f"{where}: {first['msg']}" if where else first["msg"], where or None) from None
    except RecursionError:
        raise APIError(400, "a field is nested too deeply") from None


async def _pieces(handle: RequestHandle, stream: TextStream) -> AsyncIterator[_Piece]:
    """One piece per update, until the engine ends the request or a stop string does (which aborts
    it: the row is freed before the next round)."""
    async for update in handle.updates():
        before = len(stream.token_ids)
        text = stream.add(update.token_ids)
        finish = "stop" if stream.stopped else update.finish_reason
        if stream.stopped:
            handle.abort("stop")
        if finish is not None:
            text += stream.finish()
        taken = stream.token_ids[before:]  # the update's first tokens: none after a stop string
        yield _Piece(text, taken, finish, None if update.logprobs is None else update.logprobs[: len(taken)])
        if finish is not None:
            return


async def _nothing_decoded() -> AsyncIterator[_Piece]:
    """A choice that decodes nothing (echo with max_tokens 0): it ends at once, at its budget."""
    yield _Piece("", [], "length", [])


async def _interleaved(streams: list[AsyncIterator[_Piece]]) -> AsyncIterator[tuple[int, _Piece]]:
    """(choice index, piece) from every choice's pieces as they come: n choices decode side by side,
    so none waits for another to finish before its chunks are sent."""
    pending = {asyncio.ensure_future(anext(stream)): i for i, stream in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=pending.__getitem__):
                i = pending.pop(task)
                try:
                    piece = task.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(streams[i]))] = i
                yield i, piece
    finally:
        for task in pending:
            task.cancel()


@dataclass
class _Choice:
    """One choice's output so far, for the whole-body answer."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None


class _Reply:
    """Builds one request's response bodies, whole or as chunks, in OpenAI's shapes, its logprobs
    included: chat's `logprobs.content` entries, completions' `tokens`/`token_logprobs`/`top_logprobs`/
    `text_offset` lists (`text_offset`: where each token's spelling starts in the concatenation of the
    spellings, echoed prompt first)."""

    def __init__(self, model: str, chat: bool, body: _Request, prepared: _Prepared, tokenizer: Any,
                 echoed: list[TokenLogprob | None] | None) -> None:
        self.model = model
        self.chat = chat
        self.body = body
        self.prompt_ids = prepared.ids
        self.n = prepared.n
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.with_logprobs = body.logprobs_asked() is not None
        self.echo = not chat and bool(getattr(body, "echo", False))
        self.echo_text = prepared.prompt_text if self.echo else ""
        self.echo_logprobs: dict[str, Any] | None = None
        offset = 0
        if echoed is not None:  # the same for every choice: spelled once
            self.echo_logprobs = self._completion_logprobs(TokenSpeller(tokenizer), self.prompt_ids, echoed, 0)
            offset = sum(map(len, self.echo_logprobs["tokens"]))
        # each choice spells its tokens after the prompt, at offsets after the echoed prompt's
        self.spellers = [TokenSpeller(tokenizer, self.prompt_ids) for _ in range(self.n)]
        self.offsets = [offset] * self.n

    def _envelope(self, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion" if self.chat else "text_completion") + (".chunk" if chunk and self.chat else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def _usage(self, completion_tokens: int) -> dict[str, int]:
        """OpenAI's count: the prompt once, the completion tokens of every choice."""
        prompt = len(self.prompt_ids)
        return {"prompt_tokens": prompt, "completion_tokens": completion_tokens,
                "total_tokens": prompt + completion_tokens}

    def _choice(self, index: int, text: str, token_ids: list[int], finish: str | None, chunk: bool,
                logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        if not self.chat:
            choice: dict[str, Any] = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        elif chunk:
            choice = {"index": index, "delta": {"content": text} if text else {}, "logprobs": logprobs,
                      "finish_reason": finish}
        else:
            choice = {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                      "finish_reason": finish}
        if self.body.return_token_ids:
            choice["token_ids"] = token_ids
        return choice

    def _logprobs(self, index: int, token_ids: list[int], entries: list[TokenLogprob] | None) -> dict[str, Any] | None:
        """Choice `index`'s logprobs for its next tokens, in the endpoint's shape (None if not asked)."""
        if not self.with_logprobs or entries is None:
            return None
        if self.chat:
            return {"content": self._chat_logprobs(self.spellers[index], token_ids, entries)}
        part = self._completion_logprobs(self.spellers[index], token_ids, entries, self.offsets[index])
        self.offsets[index] += sum(map(len, part["tokens"]))
        return part

    @staticmethod
    def _chat_logprobs(speller: TokenSpeller, token_ids: list[int], entries: list[TokenLogprob]) -> list[dict]:
        content = []
        for token, entry in zip(token_ids, entries):
            spelled, *alternatives = speller.spell([token, *(t for t, _ in entry.top)])
            content.append({**_spelled(spelled, entry.logprob), "top_logprobs": [
                _spelled(text, value) for text, (_, value) in zip(alternatives, entry.top)]})
            speller.push(token)
        return content

    @staticmethod
    def _completion_logprobs(speller: TokenSpeller, token_ids: list[int], entries: list[TokenLogprob | None],
                             offset: int) -> dict[str, Any]:
        tokens: list[str] = []
        values: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offsets: list[int] = []
        for token, entry in zip(token_ids, entries):
            spelled, *alternatives = speller.spell([token, *(t for t, _ in entry.top)] if entry else [token])
            tokens.append(spelled)
            offsets.append(offset)
            offset += len(spelled)
            values.append(None if entry is None else _finite(entry.logprob))
            tops.append(None if entry is None else {
                text: _finite(value) for text, (_, value) in zip(alternatives, entry.top)})
            speller.push(token)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

    async def whole(self, pieces: list[AsyncIterator[_Piece]]) -> dict[str, Any]:
        choices = [_Choice() for _ in range(self.n)]
        async for i, piece in _interleaved(pieces):
            choice = choices[i]
            choice.text.append(piece.text)
            choice.token_ids += piece.token_ids
            choice.logprobs += piece.logprobs or []
            choice.finish_reason = piece.finish_reason
        answers = []
        for i, choice in enumerate(choices):
            logprobs = self._logprobs(i, choice.token_ids, choice.logprobs)
            if self.echo_logprobs is not None and logprobs is not None:
                logprobs = {key: self.echo_logprobs[key] + logprobs[key] for key in logprobs}
            answers.append(self._choice(i, self.echo_text + "".join(choice.text), choice.token_ids,
                                        choice.finish_reason, chunk=False, logprobs=logprobs))
        reply = {**self._envelope(chunk=False), "choices": answers,
                 "usage": self._usage(sum(len(c.token_ids) for c in choices))}
        if self.body.return_token_ids:
            reply["prompt_token_ids"] = self.prompt_ids
        return reply

    async def events(self, pieces: list[AsyncIterator[_Piece]]) -> AsyncIterator[str]:
        """Server-sent events: each choice's opening chunk (chat: the role; completions' echo: the
        prompt), chunks of every choice as they come (each names its choice's `index`), the usage chunk
        if asked for, then [DONE]. An update without new text (an incomplete character, a held-back
        possible stop string) sends nothing unless token ids or logprobs were asked for."""
        usage: dict[str, Any] = {"usage": None} if self.body.include_usage else {}
        envelope = self._envelope(chunk=True)
        first = {"prompt_token_ids": self.prompt_ids} if self.body.return_token_ids else {}  # as vLLM: once
        for i in range(self.n):
            if self.chat:
                opening = {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                           "finish_reason": None}
            elif self.echo:
                opening = self._choice(i, self.echo_text, [], None, chunk=True, logprobs=self.echo_logprobs)
            else:
                continue
            yield _event({**envelope, "choices": [opening], **usage, **first})
            first = {}
        completion_tokens = 0
        try:
            async for i, piece in _interleaved(pieces):
                completion_tokens += len(piece.token_ids)
                worth_sending = self.body.return_token_ids or self.with_logprobs
                if piece.text or piece.finish_reason or (worth_sending and piece.token_ids):
                    logprobs = self._logprobs(i, piece.token_ids, piece.logprobs)
                    choice = self._choice(i, piece.text, piece.token_ids, piece.finish_reason, chunk=True,
                                          logprobs=logprobs)
                    yield _event({**envelope, "choices": [choice], **usage, **first})
                    first = {}
        except EngineUnavailable as err:
            yield _event(APIError(503, str(err), code="engine_unavailable").body())
        else:
            if self.body.include_usage:
                yield _event({**envelope, "choices": [], "usage": self._usage(completion_tokens)})
        yield "data: [DONE]\n\n"


def _finite(logprob: float) -> float:
    """JSON has no -inf: LOWEST_LOGPROB stands for it (as in vLLM)."""
    return max(logprob, LOWEST_LOGPROB)


def _spelled(text: str, logprob: float) -> dict[str, Any]:
    """A chat logprobs entry: the token's text, its logprob and its UTF-8 bytes."""
    return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8", errors="replace"))}


def _event(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


class _StreamedResponse(StreamingResponse):
    """Server-sent events whose requests (one per choice) are aborted however the response ends:
    Starlette cancels the stream when the client disconnects, and this frees the rows within one round."""

    def __init__(self, handles: list[RequestHandle], events: AsyncIterator[str]) -> None:
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.handles = handles

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for handle in self.handles:
                handle.abort()


class _AwaitedResponse(Response):
    """A JSON body computed once the request has ended, while watching the connection: a client
    that disconnects before that aborts its requests (uvicorn would otherwise decode them to the end)."""

    def __init__(self, handles: list[RequestHandle], produce: Callable[[], Awaitable[dict[str, Any]]]) -> None:
        super().__init__()
        self.handles = handles
        self.produce = produce

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        outcome: Response | None = None
        async with anyio.create_task_group() as group:

            async def watch() -> None:
                while (await receive())["type"] != "http.disconnect":
                    pass
                group.cancel_scope.cancel()

            group.start_soon(watch)
            try:
                outcome = JSONResponse(await self.produce())
            except EngineUnavailable as err:
                outcome = APIError(503, str(err), code="engine_unavailable").response()
            finally:
                for handle in self.handles:
                    handle.abort()
                group.cancel_scope.cancel()
        if outcome is not None:
            await outcome(scope, receive, send)


class _BearerAuth:
    """With --api-key, every /v1 route (and the API docs, when served) needs `Authorization: Bearer
    <key>` (401 otherwise); /health and /metrics stay open, as in vLLM, for load balancers and scrapers."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and (scope["path"].startswith("/v1") or scope["path"] in DOCS_PATHS):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                error = APIError(401, "missing or invalid API key (send `Authorization: Bearer <key>`)",
                                 code="invalid_api_key")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    return exc.response()


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Starlette's own errors (unknown route, wrong method) in the same shape."""
    return APIError(exc.status_code, str(exc.detail)).response()


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    """A bug, not the client's fault: still OpenAI's shape (uvicorn logs the traceback)."""
    return APIError(500, f"internal server error: {type(exc).__name__}").response()


def create_app(models: ModelPair, model_config: ModelConfig, spec: SpecConfig, options: ServeOptions) -> FastAPI:
    """The app; the engine's K/V is reserved here (so a budget that cannot hold one row fails
    before serving), and its loop thread runs while the app does (lifespan)."""
    server = _Server(models, model_config, spec, options)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        server.loop.start()
        yield
        await asyncio.to_thread(server.loop.close)

    docs = {} if options.docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="batchspec", lifespan=lifespan, **docs)
    app.state.engine_loop = server.loop
    app.state.metrics = server.metrics
    app.post("/v1/completions")(server.completions)
    app.post("/v1/chat/completions")(server.chat_completions)
    app.get("/v1/models")(server.models)
    app.get("/health")(server.health)
    app.get("/metrics")(server.metrics_text)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)
    if options.api_key:
        app.add_middleware(_BearerAuth, api_key=options.api_key)
    return app
