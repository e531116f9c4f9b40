"""Logprobs equal plain decoding's bit for bit (`batchspec.logprobs`), in the engine and the Python API,
and n choices follow the seed rule (`config.choice_params`).

The reference computes each generated token's logprob from plain decoding's own logits
(`reference.reference_logprobs`); the engine from its prefill and verify logits, whatever batch,
layout, speculation or prefill chunking produced them. Values are compared with torch.equal, never
with a tolerance.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch
from hypothesis import given, settings, strategies as st
from tinyworld import VOCAB_SIZE, ScriptedCosts, perturbed_copy, random_prompts, tiny_model

from batchspec.build import build_engine
from batchspec.cli import main as cli_main
from batchspec.kernels import apply_linear_kernel
from batchspec.config import MAX_LOGPROBS, BatchspecError, ModelConfig, SamplingParams, SpecConfig, choice_params
from batchspec.llm import LLM
from batchspec.logprobs import TokenLogprob, logprobs_of, token_logprob
from batchspec.models import eos_token_ids, load_pair
from batchspec.reference import prompt_logprobs, reference_decode, reference_logprobs

STOP = (1,)


@functools.cache
def pair(arch: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A tiny target and drafter with packed linears, as models load by default: row-invariant
    products, without which a verify's logits differ from a one-token step's in the last bits
    (test_bitexact.py), and exact logprobs with them."""
    model = tiny_model(arch, vocab_size=VOCAB_SIZE, seed=0)
    draft = perturbed_copy(model, noise=0.02, seed=1)
    apply_linear_kernel(model, "auto")
    apply_linear_kernel(draft, "auto")
    return model, draft


def target(arch: str) -> torch.nn.Module:
    return pair(arch)[0]


def drafter(arch: str) -> torch.nn.Module:
    return pair(arch)[1]


def as_tensors(entries: list[TokenLogprob | None]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(chosen ids, chosen logprobs, top ids, top logprobs), float64 (which holds float32 exactly)."""
    entries = [e for e in entries if e is not None]
    return (torch.tensor([e.token_id for e in entries]), torch.tensor([e.logprob for e in entries], dtype=torch.float64),
            torch.tensor([[t for t, _ in e.top] for e in entries]),
            torch.tensor([[v for _, v in e.top] for e in entries], dtype=torch.float64))


def assert_bit_equal(got: list[TokenLogprob | None], expected: list[TokenLogprob | None], what: str) -> None:
    assert [e is None for e in got] == [e is None for e in expected], what
    for a, b in zip(as_tensors(got), as_tensors(expected)):
        assert a.shape == b.shape and torch.equal(a, b), what


def mixed_params(count: int, sampled: bool, budgets: list[int], top: int) -> list[SamplingParams]:
    """Greedy, or seeded with per-request temperature/top-k/top-p (some rows without logprobs: they
    must cost nothing and change nothing)."""
    out = []
    for i in range(count):
        logprobs = None if i % 3 == 2 else top
        if sampled:
            out.append(SamplingParams(max_new_tokens=budgets[i % len(budgets)], temperature=(0.7, 1.0, 1.3)[i % 3],
                                      top_k=(0, 7, 0)[i % 3], top_p=(1.0, 1.0, 0.8)[i % 3], seed=100 + i,
                                      logprobs=logprobs))
        else:
            out.append(SamplingParams(max_new_tokens=budgets[i % len(budgets)], logprobs=logprobs))
    return out


# ---- the helper itself -----------------------------------------------------------------------------
def test_token_logprob_is_the_rows_own_log_softmax_whatever_tensor_it_sits_in():
    """A row taken from a batch (a strided, offset view) gives the bits of the same row alone."""
    batch = torch.randn(3, 4, VOCAB_SIZE, generator=torch.Generator().manual_seed(0)) * 4
    greedy, sampled = SamplingParams(logprobs=5), SamplingParams(temperature=0.8, top_k=9, seed=1, logprobs=5)
    for params in (greedy, sampled):
        alone = token_logprob(batch[1, 2].clone(), params, 7, 5)
        assert token_logprob(batch[1, 2], params, 7, 5) == alone
        assert token_logprob(batch.transpose(0, 1)[2, 1], params, 7, 5) == alone
        assert logprobs_of(batch[1, 1:3], params, [3, 7], 5)[1] == alone
    raw = torch.log_softmax(batch[1, 2], dim=-1)
    entry = token_logprob(batch[1, 2], greedy, 7, 5)
    assert entry.logprob == float(raw[7]) and [v for _, v in entry.top] == raw.topk(5).values.tolist()
    filtered = token_logprob(batch[1, 2], sampled, 7, MAX_LOGPROBS)
    assert sum(v > float("-inf") for _, v in filtered.top) == 9  # top-k 9: the rest is outside the support
    assert abs(sum(torch.tensor([v for _, v in filtered.top]).exp().tolist()) - 1) < 1e-5
    with pytest.raises(ValueError, match="vector"):
        token_logprob(batch[1], greedy, 7, 5)


def test_ties_are_broken_by_token_id():
    logits = torch.zeros(10)
    logits[[2, 5, 7]] = 1.0
    assert [t for t, _ in token_logprob(logits, SamplingParams(), 0, 2).top] == [2, 5]
    assert [t for t, _ in token_logprob(logits, SamplingParams(), 0, 5).top] == [2, 5, 7, 0, 1]


def test_logprobs_settings_are_checked():
    for bad in (-1, MAX_LOGPROBS + 1):
        with pytest.raises(BatchspecError, match=f"logprobs must be in 0..{MAX_LOGPROBS}"):
            SamplingParams(logprobs=bad)
        with pytest.raises(BatchspecError, match="prompt_logprobs must be in"):
            SamplingParams(prompt_logprobs=bad)
    with pytest.raises(BatchspecError, match="logprobs must be an integer"):
        SamplingParams(logprobs=2.0)


# ---- the engine: every method, speculation and prefill chunking ----------------------------------
@settings(max_examples=24)
@given(
    arch=st.sampled_from(["llama", "qwen2"]),
    method=st.sampled_from(["ragged", "eqspec", "exspec", "ar"]),
    continuous=st.booleans(),
    adaptive=st.booleans(),
    sampled=st.booleans(),
    batch_size=st.integers(1, 4),
    k=st.integers(1, 5),
    lengths=st.lists(st.integers(1, 14), min_size=1, max_size=5),
    budgets=st.lists(st.integers(1, 12), min_size=1, max_size=3),
    top=st.sampled_from([0, 3, MAX_LOGPROBS]),
    chunk=st.sampled_from([None, 0, 1, 5]),
    seed=st.integers(0, 1000),
)
def test_engine_logprobs_equal_plain_decodings_bit_for_bit(arch, method, continuous, adaptive, sampled, batch_size, k,
                                                           lengths, budgets, top, chunk, seed):
    prompts = random_prompts(len(lengths), lengths, seed)
    params = mixed_params(len(prompts), sampled, budgets, top)
    scheduler = ("continuous" if continuous else "static") if method in ("ragged", "ar") else None
    spec = SpecConfig(method=method, num_draft_tokens=k, batch_size=batch_size, scheduler=scheduler,
                      speculation=("adaptive" if adaptive else "fixed") if method != "ar" else None,
                      max_prefill_tokens=chunk if scheduler == "continuous" else None)
    engine = build_engine(target(arch), spec, STOP, draft_model=drafter(arch), costs=ScriptedCosts())
    for seq, prompt, sp in zip(engine.generate(prompts, params), prompts, params):
        tokens, expected = reference_logprobs(target(arch), prompt, sp, STOP)
        assert seq.generated == tokens
        if sp.logprobs is None:
            assert seq.logprobs is None
            continue
        assert len(seq.logprobs) == len(tokens)
        assert [e.token_id for e in seq.logprobs] == tokens and all(len(e.top) == top for e in seq.logprobs)
        assert_bit_equal(seq.logprobs, expected, f"request {seq.index}")


@pytest.mark.parametrize("method", ["ragged", "eqspec", "exspec"])
def test_logprobs_of_rows_that_stop_inside_a_round(method):
    """A stop token or the budget ends a row mid-round: logprobs only for the tokens it took."""
    prompts = random_prompts(4, [3, 9, 5, 12], seed=3)
    first = reference_decode(target("llama"), prompts[0], SamplingParams(max_new_tokens=12), STOP)
    stop = (*STOP, first[4])
    params = [SamplingParams(max_new_tokens=n, logprobs=2) for n in (12, 1, 7, 12)]
    engine = build_engine(target("llama"), SpecConfig(method=method, num_draft_tokens=5, batch_size=4,
                                                      speculation="fixed"), stop, draft_model=drafter("llama"))
    for seq, prompt, sp in zip(engine.generate(prompts, params), prompts, params):
        tokens, expected = reference_logprobs(target("llama"), prompt, sp, stop)
        assert seq.generated == tokens and len(seq.logprobs) == len(tokens)
        assert_bit_equal(seq.logprobs, expected, f"request {seq.index}")


def test_rows_without_logprobs_never_compute_them(monkeypatch):
    calls = []
    import batchspec.engine as engine_module

    monkeypatch.setattr(engine_module, "logprobs_of", lambda *a: calls.append(a) or [])
    engine = build_engine(target("llama"), SpecConfig(num_draft_tokens=3, batch_size=2), STOP,
                          draft_model=drafter("llama"), costs=ScriptedCosts())
    engine.generate(random_prompts(2, [4, 6], seed=1), SamplingParams(max_new_tokens=8))
    assert calls == []


# ---- prompt logprobs --------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_prompt_logprobs_are_each_tokens_log_softmax_given_the_tokens_before_it(arch, monkeypatch):
    """Chunked forwards give the same bits whatever the chunk (a property of the prompt alone), and
    agree with one whole teacher-forced forward to float tolerance."""
    prompt = random_prompts(1, [23], seed=4)[0]
    params = SamplingParams(prompt_logprobs=4)
    whole = prompt_logprobs(target(arch), prompt, params)
    assert whole[0] is None and len(whole) == len(prompt)
    assert [e.token_id for e in whole[1:]] == prompt[1:] and all(len(e.top) == 4 for e in whole[1:])
    monkeypatch.setattr("batchspec.reference.PROMPT_CHUNK", 5)
    assert_bit_equal(prompt_logprobs(target(arch), prompt, params), whole, "chunked")
    with torch.inference_mode():
        logits = target(arch)(input_ids=torch.tensor([prompt])).logits[0, :-1].float()
    direct = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(prompt[1:])[:, None]).flatten()
    assert torch.allclose(as_tensors(whole)[1].float(), direct, atol=1e-5)
    assert prompt_logprobs(target(arch), prompt[:1], params) == [None]


# ---- the Python API ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm(tiny_pair_dirs) -> LLM:
    target_dir, draft_dir = tiny_pair_dirs
    config = ModelConfig(str(target_dir), str(draft_dir), chat_template=False)
    return LLM(config, SpecConfig(method="ragged", num_draft_tokens=3, batch_size=3, speculation="fixed"),
               models=load_pair(config))


@pytest.mark.parametrize("sampled", [False, True])
def test_llm_outputs_carry_logprobs_equal_to_plain_decodings(llm, sampled):
    prompts = ["the water is long", "there is one long day and", "how many people come"]
    params = [SamplingParams(max_new_tokens=10, logprobs=3, prompt_logprobs=2 if i == 1 else None,
                             temperature=0.9 if sampled else 0.0, top_p=0.9, seed=5 + i if sampled else None)
              for i in range(3)]
    for out, sp in zip(llm.generate(prompts, params), params):
        tokens, expected = reference_logprobs(llm.models.target, out.prompt_token_ids, sp, llm.stop_ids)
        assert out.token_ids == tokens
        assert_bit_equal(out.logprobs, expected, out.prompt)
        if sp.prompt_logprobs is None:
            assert out.prompt_logprobs is None
        else:
            assert_bit_equal(out.prompt_logprobs, prompt_logprobs(llm.models.target, out.prompt_token_ids, sp), "prompt")
    plain = llm.generate(prompts[0], SamplingParams(max_new_tokens=4))[0]
    assert plain.logprobs is None and plain.prompt_logprobs is None


def test_choice_params_follow_the_seed_rule(llm):
    """Choice i of a seeded request is the request with seed + i, alone."""
    base = SamplingParams(max_new_tokens=8, temperature=1.0, seed=11)
    choices = choice_params(base, 3)
    assert [c.seed for c in choices] == [11, 12, 13]
    outs = llm.generate(["the water is long"] * 3, choices)
    for out, seed in zip(outs, (11, 12, 13)):
        alone = llm.generate("the water is long", SamplingParams(max_new_tokens=8, temperature=1.0, seed=seed))[0]
        assert out.token_ids == alone.token_ids
    assert choice_params(SamplingParams(), 2) == [SamplingParams()] * 2
    with pytest.raises(BatchspecError, match="n must be >= 1"):
        choice_params(base, 0)


# ---- generate --logprobs ----------------------------------------------------------------------------
def test_generate_writes_logprobs_and_refuses_out_of_range(tiny_pair_dirs, tmp_path, capsys):
    target_dir, draft_dir = tiny_pair_dirs
    prompts = tmp_path / "p.txt"
    prompts.write_text("the water is long\nhow many people come\n")
    out = tmp_path / "out.jsonl"
    common = ["generate", "--prompts", str(prompts), "--target", str(target_dir), "--draft", str(draft_dir),
              "--no-chat-template", "--max-new-tokens", "6", "-k", "2", "--batch-size", "2"]
    assert cli_main([*common, "-o", str(out), "--logprobs", "2", "--verify"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    loaded = load_pair(ModelConfig(str(target_dir), str(draft_dir)), need_draft=False)
    model, stop_ids = loaded.target, eos_token_ids(loaded.target, loaded.tokenizer)
    for row in rows:
        assert len(row["logprobs"]) == len(row["token_ids"])
        got = [TokenLogprob(e["token_id"], e["logprob"], tuple(map(tuple, e["top"]))) for e in row["logprobs"]]
        tokens, expected = reference_logprobs(model, row["prompt_token_ids"], SamplingParams(max_new_tokens=6, logprobs=2),
                                              stop_ids)
        assert row["token_ids"] == tokens
        assert_bit_equal(got, expected, row["id"])  # JSON keeps every float's bits
    capsys.readouterr()
    assert cli_main([*common, "--logprobs", "21"]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "logprobs must be in 0..20" in err
    assert cli_main([*common, "--logprobs", "1", "--ray"]) != 0
    assert "--logprobs is not carried back from Ray workers" in capsys.readouterr().err
