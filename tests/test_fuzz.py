"""Hostile input, generated: whatever a prompts file's lines hold, `generate` writes an output or an
error record for every prompt (or refuses the file with one line); whatever a request body holds, the
server answers it or refuses it with an OpenAI-shaped 4xx. Never a traceback, never a lost prompt,
never a 5xx. Few examples each (the tiny pair decodes every one), so the file runs in seconds.
"""

from __future__ import annotations

import codecs
import json
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from test_serve import MODEL, chat_pair, make_app, models, serving  # noqa: F401 (fixtures)
from tinyworld import WORDS

import batchspec.commands.generate
from batchspec.cli import main
from batchspec.serve.protocol import UNSUPPORTED

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)
WORDS_TEXT = st.lists(st.sampled_from(WORDS), min_size=1, max_size=5).map(" ".join)
RECORD = st.fixed_dictionaries({}, optional={
    "prompt": WORDS_TEXT | st.text(max_size=8) | JSON,
    "turns": st.lists(WORDS_TEXT | JSON, max_size=2) | JSON,
    "id": st.text(max_size=3) | st.integers(-2, 30) | JSON,
    "category": JSON,
})
LINE = st.one_of(
    RECORD.map(lambda r: json.dumps(r).encode()),  # ensure_ascii: a surrogate becomes valid JSON \ud800
    WORDS_TEXT.map(lambda t: json.dumps({"prompt": t}).encode()),
    st.text(max_size=12).map(lambda t: t.encode("utf-8", "surrogatepass")),  # raw text, stray line breaks too
    st.binary(max_size=12),
    st.integers(1_000, 100_000).map(lambda n: b"[" * n),
    st.just(b'{"prompt": "\\ud800 x"}'),
)


def _prompt_lines(data: bytes) -> int:
    """Prompts in a file, counted apart from the reader: non-blank lines (bytes.splitlines breaks),
    every line that is not UTF-8 counting (it gets an error record)."""
    lines = data.removeprefix(codecs.BOM_UTF8).splitlines()
    return sum(1 for line in lines if line.decode("utf-8", "replace").strip())


@pytest.fixture(scope="module")
def cached_models(tiny_pair_dirs):
    from batchspec.config import ModelConfig
    from batchspec.models import load_pair

    target, draft = tiny_pair_dirs
    return load_pair(ModelConfig(str(target), str(draft)))


@settings(max_examples=30)
@given(lines=st.lists(LINE, min_size=1, max_size=6), bom=st.booleans())
def test_any_prompts_file_gets_a_record_per_prompt_or_one_line(lines, bom, cached_models, tiny_pair_dirs, capsys,
                                                               monkeypatch):
    monkeypatch.setattr(batchspec.commands.generate, "load_models", lambda *args, **kwargs: cached_models)
    target, draft = tiny_pair_dirs
    data = (codecs.BOM_UTF8 if bom else b"") + b"\n".join(lines) + b"\n"
    folder = Path(tempfile.mkdtemp())
    prompts, out = folder / "p.jsonl", folder / "o.jsonl"
    prompts.write_bytes(data)
    capsys.readouterr()
    code = main(["generate", "--prompts", str(prompts), "-o", str(out), "--target", str(target), "--draft", str(draft),
                 "--batch-size", "2", "--max-new-tokens", "3", "-k", "2"])
    err = capsys.readouterr().err
    event(f"exit status {code}")  # --hypothesis-show-statistics: how many examples reached decoding
    assert "Traceback" not in err
    if code == 2:  # the file refused as a whole: no prompts, or ids that break the one id rule
        assert err.strip().splitlines()[-1].startswith("batchspec generate: error: ")
        assert _prompt_lines(data) == 0 or "id" in err
        return
    assert code in (0, 1)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == _prompt_lines(data) and len({r["id"] for r in rows}) == len(rows)
    for row in rows:
        assert isinstance(row["error"], str) or (row["error"] is None and row["token_ids"]), row


FIELDS = sorted({"model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
                 "seed", "stop", "stop_token_ids", "stream", "stream_options", "return_token_ids", *UNSUPPORTED})
BODY = st.one_of(
    st.tuples(st.sampled_from(FIELDS) | st.text(max_size=6), JSON | WORDS_TEXT).map(lambda fv: {fv[0]: fv[1]}),
    st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=3),
)


def _post(url: str, path: str, data: bytes) -> tuple[int, str, bytes]:
    request = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.headers.get("content-type", ""), response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.headers.get("content-type", ""), err.read()


@pytest.fixture(scope="module")
def fuzz_server(models, chat_pair):  # noqa: F811 (the fixtures imported above)
    with serving(make_app(models, chat_pair, batch_size=4)) as url:
        yield url


@settings(max_examples=60)
@given(chat=st.booleans(), fields=BODY, whole=st.none() | JSON)
def test_any_request_body_gets_an_answer_or_an_openai_4xx(fuzz_server, chat, fields, whole):
    base = ({"messages": [{"role": "user", "content": "the water"}]} if chat else {"prompt": "the water"})
    body = whole if whole is not None and not isinstance(whole, dict) else {"model": MODEL, "max_tokens": 2, **base,
                                                                            **fields}
    code, kind, raw = _post(fuzz_server, "/v1/chat/completions" if chat else "/v1/completions",
                            json.dumps(body).encode())
    event(f"HTTP {code}")
    assert code == 200 or 400 <= code < 500, (code, raw[:300])
    if code == 200:
        assert b"choices" in raw
        return
    reply = json.loads(raw)
    assert set(reply) == {"error"} and set(reply["error"]) == {"message", "type", "param", "code"}, reply
