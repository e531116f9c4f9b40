"""The prefix cache (`batchspec.kv.prefix`): a row filled from it holds the same K/V bits and gives the
same logits bits as the row's own prefill, for prefixes cut at every block boundary and mid-block,
whole and chunked; the engine's outputs equal plain decoding of each prompt alone with the cache
shared by concurrent requests, across eviction and aborts; the cache keeps to its budget; 0 is off."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from tinyworld import VOCAB_SIZE, ScriptedCosts, next_turn, perturbed_copy, random_prompts, tiny_model, tiny_stateful_model

from batchspec.build import build_engine
from batchspec.config import BatchspecError, SamplingParams, SpecConfig
from batchspec.kernels import apply_linear_kernel
from batchspec.kv import PrefixCache
from batchspec.layouts import RaggedLayout
from batchspec.reference import reference_decode

BLOCK = 4  # small blocks: a short prompt crosses several boundaries
GIB = 2**30


@functools.cache
def exact_model() -> torch.nn.Module:
    """Row-invariant linears and the exact attention path, as the engine runs real models
    (tests/test_kv.py): logits can be compared bit for bit."""
    model = tiny_model("qwen2", vocab_size=VOCAB_SIZE, seed=2)
    apply_linear_kernel(model, "auto")
    return model


@functools.cache
def pair(arch: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    target = tiny_model(arch, vocab_size=VOCAB_SIZE, seed=0)
    return target, perturbed_copy(target, noise=0.02, seed=1)


# ---- the layout: the same bits with and without the cache --------------------------------------
def admit(layout: RaggedLayout, prompt: list[int], chunk: int | None) -> torch.Tensor:
    """Admit `prompt` as the next row, whole or in chunks of `chunk` as the engine does (the staging
    row starting with what the cache holds); its last-token logits [vocab]."""
    if chunk is None:
        return layout.prefill([prompt])[0]
    start = layout.begin_stage(prompt)
    while start < len(prompt):
        logits = layout.stage(prompt[start : start + chunk])
        start += chunk
    layout.unstage()
    return logits


@pytest.mark.parametrize("chunk", [None, 3])
@pytest.mark.parametrize("cut", range(3 * BLOCK + 2))
def test_a_row_filled_from_the_cache_holds_and_computes_the_same_bits(cut, chunk):
    """An earlier prompt shares the new one's first `cut` tokens (every block boundary and every cut
    inside a block); the new row, filled from the cache as far as whole blocks match, holds the same
    K/V bits and gives the same logits bits, after its prompt and through a verify after it, as the
    same row prefilled without a cache."""
    base = random_prompts(1, [3 * BLOCK + 2], seed=50)[0]
    earlier = base[:cut] + [5, 6, 7]
    prompt = base[:cut] + [9, 10, 11, 12, 13]
    follow = torch.tensor([[14, 15, 16]])
    cache = PrefixCache(GIB, block=BLOCK)
    cached, plain = RaggedLayout(exact_model(), 2, 32), RaggedLayout(exact_model(), 2, 32)
    cached.use_prefix_cache(cache, "target")
    for layout in (cached, plain):
        admit(layout, earlier, chunk)
    got, want = admit(cached, prompt, chunk), admit(plain, prompt, chunk)
    assert cached.prefix_hits == cut // BLOCK * BLOCK
    assert cached.prefill_fed == plain.prefill_fed - cached.prefix_hits
    assert torch.equal(got, want)
    assert torch.equal(cached.store.row_kv(1, 0, len(prompt)), plain.store.row_kv(1, 0, len(prompt)))
    assert torch.equal(cached.forward(follow.expand(2, 3))[1], plain.forward(follow.expand(2, 3))[1])


@pytest.mark.parametrize("chunk", [None, 5])
def test_a_prompt_wholly_cached_still_computes_its_last_token(chunk):
    """The same prompt again (whole blocks, all cached): every slot but the last is filled from the
    cache, the last token is computed and its logits are the row's own."""
    prompt = random_prompts(1, [3 * BLOCK], seed=51)[0]
    cache = PrefixCache(GIB, block=BLOCK)
    cached, plain = RaggedLayout(exact_model(), 2, 32), RaggedLayout(exact_model(), 1, 32)
    cached.use_prefix_cache(cache, "target")
    first = admit(cached, prompt, chunk)
    again = admit(cached, prompt, chunk)
    assert cached.prefix_hits == len(prompt) - 1 and cached.prefill_fed == len(prompt) + 1
    assert torch.equal(again, first) and torch.equal(again, admit(plain, prompt, chunk))
    assert torch.equal(cached.store.row_kv(1, 0, len(prompt)), plain.store.row_kv(0, 0, len(prompt)))


def test_one_whole_prefill_of_several_rows_fills_each_from_the_cache():
    """Rows admitted together with different cached lengths (one forward per run of equal (cached,
    length)), beside a row with no hit: each row's logits are its own."""
    shared = random_prompts(1, [2 * BLOCK + 1], seed=52)[0]
    prompts = [shared + [7, 8], shared[:BLOCK] + [9, 10, 11], [12, 13, 14], shared + [7, 8]]
    cache = PrefixCache(GIB, block=BLOCK)
    cached, plain = RaggedLayout(exact_model(), 5, 32), RaggedLayout(exact_model(), 4, 32)
    cached.use_prefix_cache(cache, "target")
    cached.prefill([shared])
    got, want = cached.prefill(prompts), plain.prefill(prompts)
    assert cached.prefix_hits == 2 * BLOCK + BLOCK + 0 + 2 * BLOCK
    assert torch.equal(got, want)


def test_an_empty_row_fed_from_the_cache_holds_what_a_catch_up_computes():
    """A lazy drafter's row (empty, then fed its sequence in one piece): filled from the cache as far as
    it holds the tokens (no logits are wanted, so all of them may come from it)."""
    tokens = random_prompts(1, [2 * BLOCK + 3], seed=53)[0]
    cache = PrefixCache(GIB, block=BLOCK)
    cached, plain = RaggedLayout(exact_model(), 2, 32), RaggedLayout(exact_model(), 1, 32)
    cached.use_prefix_cache(cache, "drafter")
    cached.add_empty(2)
    plain.add_empty(1)
    cached.feed_row(0, tokens)
    cached.feed_row(1, tokens[: 2 * BLOCK])
    plain.feed_row(0, tokens[: 2 * BLOCK])
    assert cached.prefix_hits == 2 * BLOCK and cached.lengths.tolist() == [len(tokens), 2 * BLOCK]
    assert torch.equal(cached.store.row_kv(1, 0, 2 * BLOCK), plain.store.row_kv(0, 0, 2 * BLOCK))


# ---- the cache itself: budget, eviction order, chains ------------------------------------------
def block_bytes(layout: RaggedLayout) -> int:
    return layout.store.row_kv(0, 0, BLOCK).numel() * layout.store.data.element_size()


def test_eviction_takes_the_least_recently_used_chains_from_their_ends():
    """Room for 4 blocks: X and Y (2 blocks each) fill it; X is used again; Z's 2 blocks evict Y's,
    last block first, and a block's parent is always cached while it is."""
    x, y, z = random_prompts(3, [2 * BLOCK], seed=54)
    layout = RaggedLayout(exact_model(), 4, 16)
    layout.prefill([x, y, z])
    cache = PrefixCache(4 * block_bytes(layout), block=BLOCK)
    cache.insert("t", x, layout.store, 0)
    cache.insert("t", y, layout.store, 1)
    assert len(cache) == 4 and cache.bytes == cache.budget
    assert cache.fill("t", x, layout.store, 3, 2 * BLOCK) == 2 * BLOCK  # X used: Y is the oldest
    cache.insert("t", z, layout.store, 2)
    assert cache.evicted == 2 and cache.bytes <= cache.budget and cache.chains_intact()
    assert cache.fill("t", y, layout.store, 3, 2 * BLOCK) == 0
    assert cache.fill("t", x, layout.store, 3, 2 * BLOCK) == 2 * BLOCK
    assert cache.fill("t", z, layout.store, 3, 2 * BLOCK) == 2 * BLOCK


def test_an_insert_never_evicts_the_chain_it_extends_and_spaces_are_apart():
    prompt = random_prompts(1, [4 * BLOCK], seed=55)[0]
    layout = RaggedLayout(exact_model(), 1, 16)
    layout.prefill([prompt])
    cache = PrefixCache(2 * block_bytes(layout) + 1, block=BLOCK)
    cache.insert("target", prompt, layout.store, 0)
    assert len(cache) == 2 and cache.evicted == 0 and cache.chains_intact()  # its first two blocks
    assert cache.fill("drafter", prompt, layout.store, 0, len(prompt)) == 0
    assert PrefixCache(block_bytes(layout) - 1, block=BLOCK).fill("target", prompt, layout.store, 0, 9) == 0


# ---- the engine: outputs equal plain decoding of each prompt alone -----------------------------
SYSTEM = random_prompts(1, [37], seed=60)[0]  # 2 blocks of 16 and 5 tokens


def system_prompts(count: int, seed: int) -> list[list[int]]:
    """Prompts sharing SYSTEM, then a question of its own (some also share a first question)."""
    questions = random_prompts(count, [3, 11, 6, 20, 1], seed)
    return [SYSTEM + (questions[0] if i % 3 == 2 else []) + q for i, q in enumerate(questions)]


def params_for(count: int, sampled: bool, max_new: int = 10) -> list[SamplingParams]:
    if not sampled:
        return [SamplingParams(max_new_tokens=max_new)] * count
    return [SamplingParams(max_new_tokens=max_new, temperature=0.9, top_k=40, seed=100 + i) for i in range(count)]


def assert_plain(target: torch.nn.Module, prompts, params, outputs) -> None:
    for prompt, sp, seq in zip(prompts, params, outputs):
        assert seq.generated == reference_decode(target, prompt, sp), f"request {seq.index} diverged"


CASES = {  # method, scheduler, max_prefill_tokens, speculation
    "ragged-chunked": ("ragged", "continuous", 8, "fixed"),
    "ragged-chunked-adaptive": ("ragged", "continuous", 8, "adaptive"),
    "ragged-whole": ("ragged", "continuous", 0, "fixed"),
    "ragged-static": ("ragged", "static", None, "fixed"),
    "ar-chunked": ("ar", "continuous", 16, None),
    "exspec-pool": ("exspec", "pool", None, "fixed"),
}


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_prompts_sharing_a_system_prompt_decode_as_plain_decoding(case, sampled):
    """One `generate` of prompts sharing a system prompt: later rows are filled from the cache (target
    and drafter), every prompt token is either computed or cached, and outputs are plain decoding's."""
    method, scheduler, chunk, speculation = CASES[case]
    target, draft = pair("llama")
    spec = SpecConfig(method=method, scheduler=scheduler, max_prefill_tokens=chunk, speculation=speculation,
                      num_draft_tokens=3, batch_size=2, prefix_cache_gb=0.01, check_invariants=True)
    engine = build_engine(target, spec, draft_model=draft, costs=ScriptedCosts(1.0, 0.1, 0.2))
    prompts, params = system_prompts(6, seed=61), params_for(6, sampled)
    outputs = engine.generate(prompts, params)
    assert_plain(target, prompts, params, outputs)
    stats = engine.stats
    assert stats.prefix_cache_queries == stats.prefill_tokens == sum(map(len, prompts))
    assert stats.prefix_cache_hits >= 3 * 32 and stats.prefill_fed == stats.prefill_tokens - stats.prefix_cache_hits
    if spec.speculative and speculation == "fixed":  # a drafter prefilling at admission shares it too
        assert engine.rows.drafter._home.prefix_hits > 0


def test_the_next_turn_of_a_conversation_prefills_only_what_is_new():
    """A finished row's K/V (prompt and answer) stays in the cache: the next turn, which resends the
    conversation, computes only the new turn's tokens and the partial block before them."""
    target, draft = pair("qwen2")
    spec = SpecConfig(method="ragged", speculation="fixed", num_draft_tokens=3, batch_size=2,
                      prefix_cache_gb=0.01, check_invariants=True)
    engine = build_engine(target, spec, draft_model=draft)
    engine.reserve(rows=2, capacity=128)
    params = SamplingParams(max_new_tokens=20)
    first, answer, second, output, hits = next_turn(engine, 29, params)
    assert output == reference_decode(target, second, params)
    kept = (len(first) + len(answer) - 1) // 16 * 16  # the answer's last token has no K/V yet
    assert hits == kept


def test_requests_sharing_a_prefix_admitted_while_others_decode_and_one_aborted_mid_prefill():
    """Requests sharing a prefix arrive while earlier ones decode; one is aborted while its prompt is
    half staged (after its cached prefix was filled). Everyone else decodes as plain decoding, and the
    aborted prompt left nothing in the cache (only complete prefills are kept)."""
    target, draft = pair("llama")
    spec = SpecConfig(method="ragged", speculation="fixed", num_draft_tokens=3, batch_size=3, max_prefill_tokens=8,
                      prefix_cache_gb=0.01, check_invariants=True)
    engine = build_engine(target, spec, draft_model=draft)
    engine.reserve(rows=3, capacity=128)
    prompts = system_prompts(5, seed=64)
    params = params_for(5, sampled=True, max_new=14)
    finished = {}
    ids = [engine.add_request(prompts[0], params[0])]
    for _ in range(7):  # prompt 0 in, a few rounds
        finished.update({s.index: s for s in engine.step()})
    assert engine.running
    aborted_prompt = SYSTEM + random_prompts(1, [40], seed=65)[0]
    ids += [engine.add_request(p, sp) for p, sp in zip([aborted_prompt, *prompts[1:]], [params[0], *params[1:]])]
    engine.step()
    assert engine.prefill.staging is not None and engine.prefill.staging.index == ids[1]
    assert engine.rows.staged == 32 + 8  # the system prompt's 2 cached blocks, then a chunk
    blocks = len(engine.parts.prefix_cache)
    assert engine.abort(ids[1]).finish_reason == "abort"
    while engine.has_unfinished():
        finished.update({s.index: s for s in engine.step()})
    assert ids[1] not in finished
    assert_plain(target, prompts, params, [finished[i] for i in [ids[0], *ids[2:]]])
    assert engine.parts.prefix_cache.fill("target", aborted_prompt, engine.rows.home.store, 0, 0) == 0
    assert len(engine.parts.prefix_cache) >= blocks


def test_eviction_under_a_tiny_budget_keeps_outputs_exact_and_never_exceeds_it(monkeypatch):
    """A budget of a few blocks: prompts keep evicting each other; after every insert the cache holds
    at most its budget and whole chains, and every output is still plain decoding's."""
    target, draft = pair("gpt2")
    probe = RaggedLayout(target, 1, 16)
    probe.prefill([[3] * 16])
    five_blocks = 5 * probe.store.row_kv(0, 0, 16).numel() * 4  # float32, target and drafter alike
    spec = SpecConfig(method="ragged", speculation="fixed", num_draft_tokens=2, batch_size=2, max_prefill_tokens=8,
                      prefix_cache_gb=five_blocks / GIB)
    engine = build_engine(target, spec, draft_model=draft)
    engine.reserve(rows=2, capacity=128)
    cache = engine.parts.prefix_cache
    assert cache.budget == five_blocks
    insert = cache.insert
    sizes = []

    def checked(*args, **kwargs):
        insert(*args, **kwargs)
        assert cache.bytes <= cache.budget and cache.chains_intact()
        assert cache.bytes == sum(b.nbytes for b in cache._blocks.values())
        sizes.append(cache.bytes)

    monkeypatch.setattr(cache, "insert", checked)
    prompts = system_prompts(4, seed=66) + random_prompts(3, [50, 35], seed=67) + system_prompts(3, seed=68)
    params = params_for(len(prompts), sampled=False, max_new=8)
    outputs = engine.generate(prompts, params)
    assert_plain(target, prompts, params, outputs)
    assert cache.evicted > 0 and len(sizes) >= len(prompts) and engine.stats.prefix_cache_hits > 0


# ---- when it is on, and where it is refused -----------------------------------------------------
def test_budget_zero_is_off_and_the_default_follows_the_method():
    target, draft = pair("llama")
    off = build_engine(target, SpecConfig(speculation="fixed", prefix_cache_gb=0), draft_model=draft)
    assert off.parts.prefix_cache is None
    prompt = random_prompts(1, [40], seed=69)[0]
    off.generate([prompt, prompt], SamplingParams(max_new_tokens=2))
    assert off.stats.prefix_cache_hits == off.stats.prefix_cache_queries == 0
    assert off.stats.prefill_fed == 80
    assert build_engine(target, SpecConfig(), draft_model=draft).parts.prefix_cache is None  # API default: off
    on = build_engine(target, SpecConfig(prefix_cache_gb=None), draft_model=draft)
    assert on.parts.prefix_cache is not None and on.parts.prefix_cache.budget == GIB
    eqspec = build_engine(target, SpecConfig(method="eqspec", prefix_cache_gb=None), draft_model=draft)
    assert eqspec.parts.prefix_cache is None


def test_where_it_cannot_work_asking_for_it_is_refused_in_one_line():
    with pytest.raises(BatchspecError, match="method eqspec keeps rows in a left-padded rectangle"):
        SpecConfig(method="eqspec", prefix_cache_gb=1)
    with pytest.raises(BatchspecError, match="prefix_cache_gb must be >= 0"):
        SpecConfig(prefix_cache_gb=-1)
    with pytest.raises(BatchspecError, match="finite"):
        SpecConfig(prefix_cache_gb=float("nan"))
    with pytest.raises(BatchspecError, match="not supported for targets with recurrent state"):
        build_engine(tiny_stateful_model("mamba2"), SpecConfig(method="ar", prefix_cache_gb=1))
    assert build_engine(tiny_stateful_model("mamba2"), SpecConfig(method="ar", prefix_cache_gb=None)) \
        .parts.prefix_cache is None


# ---- the command line -----------------------------------------------------------------------------
def test_generate_reports_prompt_tokens_sent_and_computed(tmp_path, tiny_pair_dirs, capsys):
    """`generate --prefix-cache-gb`: prompts sharing a long system text, outputs verified against
    plain decoding, and the summary's prompt tokens: sent, computed, from the cache."""
    from batchspec.cli import main

    target, draft = tiny_pair_dirs
    system = " ".join(["the water is long and the day is long"] * 6)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("".join(f"{system} {q}\n" for q in ("call him now", "write the number", "what time is it")))
    args = ["generate", "--prompts", str(prompts), "--target", str(target), "--draft", str(draft), "--batch-size", "1",
            "--max-new-tokens", "6", "--no-chat-template"]
    assert main([*args, "--prefix-cache-gb", "0.01", "--verify"]) == 0
    summary = json.loads(capsys.readouterr().out)
    tokens = summary["prompt_tokens"]
    assert summary["exact_match"] == "3/3" and tokens["prefix_cache_hits"] >= 2 * 48
    assert tokens["computed"] == tokens["sent"] - tokens["prefix_cache_hits"]
    assert main([*args, "--method", "eqspec", "--prefix-cache-gb", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "method eqspec keeps rows in a left-padded rectangle" in err and "\n" not in err
