"""The OpenAI API's request bodies and errors, as far as batchspec serves them.

Request models are strict (a string where a number belongs is a 400, not silently converted) and
keep unknown fields (clients send `user`, `metadata`, ...), but a field that would change the
output in a way batchspec does not implement (logprobs, penalties, n > 1, ...) is refused with a
400 naming it, never silently ignored. Ranges (negative, NaN, ...) are checked by SamplingParams,
the same check the Python API and the CLI use.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from ..config import BatchspecError, SamplingParams


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
        return JSONResponse(self.body(), status_code=self.status)


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
    logprobs: Any = None
    top_logprobs: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None

    def refuse_unsupported(self) -> None:
        """A 400 for any field set to something that would change the output and is not implemented."""
        unsupported = {
            "n": self.n not in (None, 1),
            "logprobs": self.logprobs not in (None, False, 0),
            "top_logprobs": self.top_logprobs not in (None, 0),
            "presence_penalty": self.presence_penalty not in (None, 0),
            "frequency_penalty": self.frequency_penalty not in (None, 0),
            "logit_bias": bool(self.logit_bias),
            **self._unsupported(),
        }
        for name, refused in unsupported.items():
            if refused:
                hint = " (send one request per completion)" if name == "n" else ""
                raise APIError(400, f"{name}={getattr(self, name)!r} is not supported by this server{hint}", name)

    def _unsupported(self) -> dict[str, bool]:
        return {}

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
            )
        except BatchspecError as err:
            # SamplingParams' messages start with the field's name: say it as the API spells it
            message = str(err).replace("max_new_tokens", "max_tokens")
            name = message.split(" ", 1)[0]
            raise APIError(400, message, name if name in type(self).model_fields else None) from err

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Request):
    """POST /v1/completions: one prompt, as text or token ids (OpenAI's default max_tokens, 16)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None

    def _unsupported(self) -> dict[str, bool]:
        return {"echo": bool(self.echo), "best_of": self.best_of not in (None, 1), "suffix": bool(self.suffix)}

    def token_budget(self) -> int | None:
        return 16 if self.max_tokens is None else self.max_tokens

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
    budget the request may fill the rest of the context (as OpenAI's chat API does)."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None

    def token_budget(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
