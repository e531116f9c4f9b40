"""`batchspec serve`'s logprobs, echo and n > 1 through the official openai client: response shapes as
OpenAI's, logprobs equal bit for bit to plain decoding's (`reference.reference_logprobs`, and
`reference.prompt_logprobs` for an echoed prompt, on a separately loaded target), each seeded choice
identical to the request sent alone with seed `seed + i`, and bad input answered 400 naming the field.

The servers and helpers are test_serve.py's (uvicorn in a thread on loopback, the tiny pair).
"""

from __future__ import annotations

import functools
import json
from dataclasses import replace

import openai
import pytest
from test_serve import (  # noqa: F401 (chat_pair, models: fixtures)
    MODEL,
    assert_openai_error,
    chat_pair,
    client,
    extra,
    make_app,
    models,
    params,
    post,
    serving,
)

from batchspec.config import BatchspecError, SamplingParams
from batchspec.models import encode_prompt, eos_token_ids, load_model
from batchspec.reference import prompt_logprobs, reference_logprobs
from batchspec.serve import ServeOptions
from batchspec.serve.text import encode_chat


@pytest.fixture(scope="module")
def server(models, chat_pair):
    """Ragged, fixed K=3, 4 rows, at most 3 choices a request (so n = 4 is refused)."""
    app = make_app(models, chat_pair, batch_size=4, max_n=3)
    with serving(app) as url:
        yield url, app


@pytest.fixture(scope="module")
def plain(chat_pair):
    """Plain decoding with logprobs, and prompt logprobs, on a separately loaded target."""
    model, tokenizer = load_model(chat_pair.target)
    stop_ids = eos_token_ids(model, tokenizer)
    decode = functools.cache(lambda ids, sp: reference_logprobs(model, list(ids), sp, stop_ids))
    score = functools.cache(lambda ids, sp: prompt_logprobs(model, list(ids), sp))
    return decode, score


def with_logprobs(sp: SamplingParams, top: int) -> SamplingParams:
    return replace(sp, logprobs=top)


# ---- completions -----------------------------------------------------------------------------------
def test_completion_logprobs_equal_plain_decodings(server, plain, models) -> None:
    url, _ = server
    decode, _ = plain
    prompt = "the water is long and"
    ids = encode_prompt(models.tokenizer, prompt, chat_template=False)
    tokens, expected = decode(tuple(ids), with_logprobs(params(16), 3))
    reply = client(url).completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, logprobs=3,
                                           extra_body={"return_token_ids": True})
    choice = reply.choices[0]
    assert extra(choice)["token_ids"] == tokens
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(tokens)
    assert lp.token_logprobs == [e.logprob for e in expected]  # floats through JSON keep their bits
    assert [sorted(top.values(), reverse=True) for top in lp.top_logprobs] == [[v for _, v in e.top] for e in expected]
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    # tokens spelled as they add to the text, special tokens spelled out (the text skips them)
    assert "".join(lp.tokens).strip() == models.tokenizer.decode(tokens, skip_special_tokens=False).strip()
    assert all(lp.top_logprobs[i][lp.tokens[i]] == lp.token_logprobs[i] for i in range(len(tokens))
               if lp.tokens[i] in lp.top_logprobs[i])

    chunks = list(client(url).completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, logprobs=3,
                                                 stream=True))
    streamed = [v for c in chunks if c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    offsets = [v for c in chunks if c.choices[0].logprobs for v in c.choices[0].logprobs.text_offset]
    assert streamed == lp.token_logprobs and offsets == lp.text_offset


def test_echo_with_max_tokens_0_scores_the_prompt_without_decoding(server, plain, models) -> None:
    """lm-evaluation-harness's log-likelihood request: the prompt's logprobs, nothing decoded."""
    url, app = server
    _, score = plain
    prompt = "there is one long day and the water"
    ids = encode_prompt(models.tokenizer, prompt, chat_template=False)
    expected = score(tuple(ids), SamplingParams(prompt_logprobs=2))
    engine = app.state.engine_loop.engine
    prefilled = engine.stats.prefill_tokens
    reply = client(url).completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=2,
                                           temperature=0)
    choice = reply.choices[0]
    assert choice.text == prompt and choice.finish_reason == "length"
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(ids), 0)
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == [e.logprob for e in expected[1:]]
    assert [sorted(t.values(), reverse=True) for t in lp.top_logprobs[1:]] == [[v for _, v in e.top] for e in expected[1:]]
    assert "".join(lp.tokens) == models.tokenizer.decode(ids, skip_special_tokens=False)
    assert engine.stats.prefill_tokens == prefilled  # no request reached the engine

    # echo without logprobs: the prompt's text only; a streamed echo sends it first
    reply = client(url).completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True)
    assert reply.choices[0].text == prompt and reply.choices[0].logprobs is None
    chunks = list(client(url).completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=2,
                                                 stream=True))
    assert chunks[0].choices[0].text == prompt and chunks[0].choices[0].logprobs.token_logprobs == lp.token_logprobs
    assert chunks[-1].choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError, match="max_tokens must be >= 1"):
        client(url).completions.create(model=MODEL, prompt=prompt, max_tokens=0)


def test_echo_with_decoding_puts_the_prompts_logprobs_first(server, plain, models) -> None:
    url, _ = server
    decode, score = plain
    prompt = [5, 6, 7, 8, 9]
    tokens, expected = decode(tuple(prompt), with_logprobs(params(6), 1))
    scored = score(tuple(prompt), SamplingParams(prompt_logprobs=1))
    reply = client(url).completions.create(model=MODEL, prompt=prompt, max_tokens=6, echo=True, logprobs=1,
                                           temperature=0, extra_body={"return_token_ids": True})
    choice = reply.choices[0]
    assert extra(choice)["token_ids"] == tokens
    assert choice.text == models.tokenizer.decode(prompt) + models.tokenizer.decode(tokens, skip_special_tokens=True)
    lp = choice.logprobs
    assert lp.token_logprobs == [None] + [e.logprob for e in scored[1:]] + [e.logprob for e in expected]
    assert lp.text_offset == sorted(lp.text_offset) and len(lp.text_offset) == len(prompt) + len(tokens)


# ---- chat ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_of_seeded_sampling_equal_plain_decodings(server, plain, models, stream) -> None:
    """Sampled: the distribution after temperature, top-k and top-p (outside it: -9999, JSON's -inf)."""
    url, _ = server
    decode, _ = plain
    messages = [{"role": "user", "content": "what is the water"}]
    ids = encode_chat(models.tokenizer, messages)
    tokens, expected = decode(tuple(ids), with_logprobs(params(12, 0.9, 3, 0.9, 5), 4))
    reply = client(url).chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0.9,
                                                top_p=0.9, seed=3, logprobs=True, top_logprobs=4, stream=stream,
                                                extra_body={"top_k": 5, "return_token_ids": True})
    if stream:
        chunks = [c for c in reply if c.choices]
        got = [t for c in chunks for t in extra(c.choices[0]).get("token_ids", [])]
        content = [e for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    else:
        got, content = extra(reply.choices[0])["token_ids"], reply.choices[0].logprobs.content
    assert got == tokens and len(content) == len(tokens)
    assert [e.logprob for e in content] == [e.logprob for e in expected]
    assert [[t.logprob for t in e.top_logprobs] for e in content] == [
        [max(v, -9999.0) for _, v in e.top] for e in expected]
    assert all(e.bytes == list(e.token.encode()) for e in content)
    assert all(e.top_logprobs[0].logprob >= e.logprob for e in content)


def test_chat_without_logprobs_has_none(server) -> None:
    url, _ = server
    reply = client(url).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "the"}],
                                                max_tokens=3, temperature=0, logprobs=False)
    assert reply.choices[0].logprobs is None


# ---- n > 1 -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_n_seeded_choices_are_the_request_with_seeds_seed_plus_i(server, plain, models, stream) -> None:
    url, _ = server
    decode, _ = plain
    prompt = "there is one long day"
    ids = encode_prompt(models.tokenizer, prompt, chat_template=False)
    expected = [decode(tuple(ids), with_logprobs(params(10, 1.0, 20 + i), 0)) for i in range(3)]
    reply = client(url).completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=1.0, seed=20, n=3,
                                           logprobs=0, stream=stream, stream_options={"include_usage": True} if stream
                                           else None, extra_body={"return_token_ids": True})
    if stream:
        chunks = list(reply)
        usage = chunks[-1].usage
        got = {i: [t for c in chunks[:-1] for t in extra(c.choices[0]).get("token_ids", []) if c.choices[0].index == i]
               for i in range(3)}
        values = {i: [v for c in chunks[:-1] if c.choices[0].index == i and c.choices[0].logprobs
                      for v in c.choices[0].logprobs.token_logprobs] for i in range(3)}
    else:
        usage = reply.usage
        assert [c.index for c in reply.choices] == [0, 1, 2]
        got = {c.index: extra(c)["token_ids"] for c in reply.choices}
        values = {c.index: c.logprobs.token_logprobs for c in reply.choices}
    for i, (tokens, entries) in enumerate(expected):
        assert got[i] == tokens and values[i] == [e.logprob for e in entries], i
    assert len({tuple(t) for t, _ in expected}) > 1  # the choices really differ
    assert usage.prompt_tokens == len(ids)  # the prompt once, every choice's tokens
    assert usage.completion_tokens == sum(len(t) for t, _ in expected)


def test_n_greedy_and_unseeded_choices(server, plain, models) -> None:
    url, _ = server
    decode, _ = plain
    messages = [{"role": "user", "content": "how many people come"}]
    ids = encode_chat(models.tokenizer, messages)
    reply = client(url).chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0, n=2,
                                                extra_body={"return_token_ids": True})
    tokens, _ = decode(tuple(ids), with_logprobs(params(8), 0))
    assert [extra(c)["token_ids"] for c in reply.choices] == [tokens, tokens]
    assert [c.message.content for c in reply.choices][0] == reply.choices[1].message.content
    reply = client(url).chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=1.0, n=3)
    assert [c.index for c in reply.choices] == [0, 1, 2] and all(c.finish_reason for c in reply.choices)
    chunks = list(client(url).chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0, n=2,
                                                      stream=True))
    roles = [c.choices[0].index for c in chunks if c.choices[0].delta.role == "assistant"]
    assert roles == [0, 1]
    texts = ["".join(c.choices[0].delta.content or "" for c in chunks if c.choices[0].index == i) for i in (0, 1)]
    assert texts == [reply_text := texts[0], reply_text] and reply_text


# ---- bad input -------------------------------------------------------------------------------------
@pytest.mark.parametrize("path, fields, param, fragment", [
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "top_logprobs must be in 0..20"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs", "needs logprobs: true"),
    ("/v1/chat/completions", {"echo": True}, "echo", "echo=True is not supported"),
    ("/v1/chat/completions", {"logprobs": 3}, "logprobs", "logprobs"),
    ("/v1/completions", {"logprobs": 21}, "logprobs", "logprobs must be in 0..20"),
    ("/v1/completions", {"logprobs": -1}, "logprobs", "logprobs must be in 0..20"),
    ("/v1/completions", {"logprobs": True}, "logprobs", "logprobs"),
    ("/v1/completions", {"top_logprobs": 3}, "top_logprobs", "top_logprobs=3 is not supported"),
    ("/v1/completions", {"n": 4}, "n", "n must be in 1..3"),
    ("/v1/completions", {"n": 0}, "n", "n must be in 1..3"),
    ("/v1/chat/completions", {"n": -2}, "n", "n must be in 1..3"),
    ("/v1/chat/completions", {"n": 2.5}, "n", "n"),
    ("/v1/completions", {"prompt_logprobs": 2}, "prompt_logprobs", "prompt_logprobs=2 is not supported"),
])
def test_bad_logprobs_echo_and_n_are_400s_naming_the_field(server, path, fields, param, fragment) -> None:
    url, _ = server
    body = {"model": MODEL, "max_tokens": 2, "prompt": "the water", "messages": [{"role": "user", "content": "the"}]}
    body.pop("prompt" if "chat" in path else "messages")
    code, reply = post(url, path, json.dumps({**body, **fields}))
    assert fragment in assert_openai_error(code, reply, 400) and reply["error"]["param"] == param, reply


def test_engine_calls_run_between_steps_and_their_failures_are_their_own(server) -> None:
    """A failing call (the prompt forward of an echo) is its request's error, not the engine loop's."""
    _, app = server
    loop = app.state.engine_loop
    assert loop.call(lambda: 6 * 7).result(timeout=30) == 42
    with pytest.raises(ZeroDivisionError):
        loop.call(lambda: 1 / 0).result(timeout=30)
    assert loop.alive


def test_echo_on_a_dead_engine_loop_is_a_503(models, chat_pair) -> None:
    app = make_app(models, chat_pair, batch_size=1)
    app.state.engine_loop.engine.step = lambda: 1 / 0
    with serving(app) as url:
        body = {"model": MODEL, "prompt": "the water", "max_tokens": 2}
        assert_openai_error(*post(url, "/v1/completions", json.dumps(body)), 503)  # the step kills the loop
        code, reply = post(url, "/v1/completions", json.dumps({**body, "max_tokens": 0, "echo": True, "logprobs": 1}))
        assert "engine loop died" in assert_openai_error(code, reply, 503)


def test_max_n_must_be_positive() -> None:
    with pytest.raises(BatchspecError, match="--max-n must be >= 1"):
        ServeOptions(max_n=0)
