"""The OpenAI API's request bodies and errors, as far as batchspec serves them.

Request models are strict (a string where a number belongs is a 400, not silently converted) and
keep unknown fields (clients send `user`, `metadata`, ...), but a field that would change the
output in a way batchspec does not implement (penalties, tools, response formats, best_of, ...:
`UNSUPPORTED`) is refused with a 400 naming it, never silently ignored. Ranges (negative, NaN,
...) are checked by SamplingParams, the same check the Python API and the CLI use; those of `n`,
`logprobs`, `top_logprobs` and `echo` here, each a 400 naming the field.
"""

from __future__ import annotations

import json
import reprlib
from typing import Any, ClassVar, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from ..config import MAX_LOGPROBS, BatchspecError, SamplingParams


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
             429: "rate_limit_error", 503: "server_error"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        kind = self.TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return _AsciiJSONResponse(self.body(), status_code=self.status)


class _AsciiJSONResponse(JSONResponse):
    """JSON with non-ASCII characters escaped: an error message may quote what the client sent, and
    a lone surrogate in it cannot be encoded as UTF-8 (the answer would have become a 500)."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode("ascii")


def short_repr(value: object) -> str:
    """A client's value as an error message quotes it: bounded in length and depth (it may be 4 MB,
    or nested 100k levels)."""
    short = reprlib.Repr()  # Python 3.11's takes no keyword arguments
    short.maxlevel, short.maxstring, short.maxother, short.maxlist, short.maxdict = 2, 60, 60, 4, 4
    return short.repr(value)


# Fields of OpenAI's API (and vLLM's extra ones) that change the output, which batchspec does not
# implement, each with the values that change nothing. A request setting one to anything else gets a
# 400 naming it; a client that asked for JSON output, a tool call or a penalty must not get plain text
# as if it had not asked.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1), "suffix": (None, ""), "prompt_logprobs": (None, 0),
    "presence_penalty": (None, 0), "frequency_penalty": (None, 0), "repetition_penalty": (None, 1),
    "length_penalty": (None, 1), "logit_bias": (None, {}), "min_p": (None, 0), "min_tokens": (None, 0),
    "ignore_eos": (None, False), "use_beam_search": (None, False), "bad_words": (None, []),
    "allowed_token_ids": (None,), "include_stop_str_in_output": (None, False), "skip_special_tokens": (None, True),
    "truncate_prompt_tokens": (None,), "tools": (None, []), "tool_choice": (None, "none", "auto"),
    "functions": (None, []), "function_call": (None, "none", "auto"), "response_format": (None, {"type": "text"}),
    "structured_outputs": (None,), "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,),
    "guided_grammar": (None,), "prediction": (None,), "audio": (None,), "modalities": (None, ["text"]),
}


def _same(value: object, neutral: object) -> bool:
    """`value == neutral` as JSON means it: true is not 1, but 1.0 is 1."""
    if isinstance(value, bool) or isinstance(neutral, bool):
        return type(value) is type(neutral) and value == neutral
    if isinstance(value, (int, float)) and isinstance(neutral, (int, float)):
        return value == neutral
    return type(value) is type(neutral) and value == neutral


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    include_usage: bool | None = False


class _Request(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # not in OpenAI's API: an extra body field, as vLLM takes it
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # extra body, as vLLM
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool | None = False  # extra body, as vLLM: token ids alongside the text
    # set to anything but a neutral value, these are refused (UNSUPPORTED); typed, so a wrong type
    # is reported as such
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None

    # this endpoint's fields of UNSUPPORTED and its own refusals
    REFUSED: ClassVar[dict[str, tuple[Any, ...]]] = UNSUPPORTED

    def refuse_unsupported(self) -> None:
        """A 400 for the first field of REFUSED set to something that would change the output."""
        extra = self.model_extra or {}
        for name, neutral in self.REFUSED.items():
            value = getattr(self, name) if name in type(self).model_fields else extra.get(name)
            if not any(_same(value, v) for v in neutral):
                raise APIError(400, f"{name}={short_repr(value)} is not supported by this server{self._hint(name)}",
                               name)

    def _hint(self, name: str) -> str:
        return ""

    def choices(self, max_n: int) -> int:
        """`n`, the number of choices: 1 by default, a 400 naming `n` outside 1..max_n (`--max-n`)."""
        n = 1 if self.n is None else self.n
        if not 1 <= n <= max_n:
            raise APIError(400, f"n must be in 1..{max_n} (choices per request; --max-n), got {n}", "n")
        return n

    def decodes(self) -> bool:
        """Whether the request decodes anything (completions' echo with max_tokens 0 does not)."""
        return True

    def logprobs_asked(self) -> int | None:
        """Alternatives per generated token's logprobs (None: no logprobs)."""
        return None

    def prompt_logprobs_asked(self) -> int | None:
        """Alternatives per prompt token's logprobs (None: none; `echo` on completions)."""
        return None

    def token_budget(self) -> int | None:
        return self.max_tokens

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def sampling_params(self, max_new_tokens: int, stop_ids: tuple[int, ...] = ()) -> SamplingParams:
        """Validated SamplingParams (OpenAI's defaults: temperature 1, top_p 1); a range error is a 400."""
        try:
            return SamplingParams(
                max_new_tokens=max_new_tokens,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=0 if self.top_k is None else self.top_k,
                seed=self.seed,
                stop_token_ids=tuple(self.stop_token_ids or ()),
                logprobs=self.logprobs_asked(),
            )
        except BatchspecError as err:
            # SamplingParams' messages start with the field's name: say it as the API spells it
            message = str(err).replace("max_new_tokens", "max_tokens")
            name = message.split(" ", 1)[0]
            raise APIError(400, message, name if name in type(self).model_fields else None) from err

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


def _alternatives(value: int | None, name: str) -> int | None:
    """A logprobs count checked for its range: a 400 naming the field."""
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise APIError(400, f"{name} must be in 0..{MAX_LOGPROBS}, got {value}", name)
    return value


class CompletionRequest(_Request):
    """POST /v1/completions: one prompt, as text or token ids (OpenAI's default max_tokens, 16).
    `logprobs` N: each token's logprob and the N most likely alternatives'; `echo`: the prompt before
    the output, with its tokens' logprobs when `logprobs` is given; with `max_tokens` 0 only that
    (lm-evaluation-harness's log-likelihoods)."""

    # `top_logprobs` is chat's; completions spell it `logprobs`
    REFUSED: ClassVar[dict[str, tuple[Any, ...]]] = {**UNSUPPORTED, "top_logprobs": (None, 0)}

    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool | None = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def token_budget(self) -> int | None:
        return 16 if self.max_tokens is None else self.max_tokens

    def decodes(self) -> bool:
        """False for echo with max_tokens 0: the prompt's logprobs are all it asks for."""
        return not (self.echo and self.max_tokens == 0)

    def logprobs_asked(self) -> int | None:
        return _alternatives(self.logprobs, "logprobs")

    def prompt_logprobs_asked(self) -> int | None:
        return self.logprobs_asked() if self.echo else None

    def single_prompt(self) -> str | list[int]:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise APIError(400, f"{len(prompt)} prompts in one request: this server takes one prompt per "
                               "request (send several requests; they are batched together)", "prompt")
            prompt = prompt[0]
        return prompt


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: str
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_Request):
    """POST /v1/chat/completions: a conversation rendered with the chat template. Without a token
    budget the request may fill the rest of the context (as OpenAI's chat API does). `logprobs`
    true: each token's logprob, with `top_logprobs` alternatives (0..MAX_LOGPROBS)."""

    # no prompt echo in chat (OpenAI has none): refused by name rather than ignored
    REFUSED: ClassVar[dict[str, tuple[Any, ...]]] = {**UNSUPPORTED, "echo": (None, False)}

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None

    def token_budget(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def _hint(self, name: str) -> str:
        return " (echo is a /v1/completions field)" if name == "echo" else ""

    def logprobs_asked(self) -> int | None:
        top = _alternatives(self.top_logprobs, "top_logprobs")
        if not self.logprobs:
            if top:
                raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
            return None
        return top or 0
