"""Sampling under batched speculation: filtering, keyed noise, the coupled rule's token identity with
plain seeded sampling, isolation of rules within a batch, and the CLI's sampling options."""

from __future__ import annotations

import json
from dataclasses import replace
from functools import lru_cache

import pytest
import torch
from hypothesis import given, settings, strategies as st
from tinyworld import ScriptedCosts, ScriptedDrafter, perturbed_copy, random_prompts

from batchspec import acceptance, sampling
from batchspec.cli import main as cli_main
from batchspec.config import BatchspecError, SamplingParams, SpecConfig
from batchspec.drafters import Draft, Drafter, ModelDrafter, Picker, pick_argmax
from batchspec.build import build_engine
from batchspec.layouts import PaddedLayout, RaggedLayout
from tinyworld import tiny_model
from batchspec.reference import greedy_decode, reference_decode
from batchspec.sequence import Sequence

VOCAB = 96
STOP = (1,)
ARCHS = ("llama", "qwen2", "gpt2")


@lru_cache(maxsize=None)
def pair(arch: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A tiny target and a drafter that agrees with it about half the time."""
    target = tiny_model(arch, vocab_size=VOCAB, seed=0)
    return target, perturbed_copy(target, 0.02, seed=1)


def oracle(target: torch.nn.Module, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    return [reference_decode(target, p, sp, STOP) for p, sp in zip(prompts, params)]


@torch.inference_mode()
def outside_support(target: torch.nn.Module, prompt: list[int], output: list[int], params: SamplingParams) -> list[int]:
    """Positions where an unseeded sample is a token plain sampling could never emit there: outside
    the target's filtered (temperature, top-k, top-p) support given the output before it, after a
    stop token, or past max_new_tokens. Rejection sampling has no single right answer, but this set
    must be empty."""
    assert 1 <= len(output) <= params.max_new_tokens
    logits = target(input_ids=torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1]
    allowed = sampling.filter_logits(logits, [params] * len(output)) > float("-inf")
    bad = [t for t, token in enumerate(output) if not allowed[t, token]]
    return bad + [t for t, token in enumerate(output[:-1]) if token in STOP]


def run(
    target: torch.nn.Module,
    prompts: list[list[int]],
    params: list[SamplingParams],
    spec: SpecConfig,
    draft_model: torch.nn.Module | None = None,
    drafter: Drafter | None = None,
    seed: int | None = 0,
    costs: ScriptedCosts | None = None,
) -> list[list[int]]:
    engine = build_engine(target, replace(spec, generator_seed=seed), STOP, draft_model=draft_model, drafter=drafter,
                          costs=costs)
    return [s.generated for s in engine.generate(prompts, params)]


class AdversarialDrafter(Drafter):
    """A model drafter that always proposes its LEAST likely token: every draft should be rejected,
    and the output must not change. Reports no probabilities (its proposal is deterministic)."""

    def __init__(self, inner: ModelDrafter) -> None:
        self.inner = inner

    def add(self, seqs: list[Sequence]) -> None:
        self.inner.add(seqs)

    def drop(self, keep: list[bool]) -> list[int]:
        return self.inner.drop(keep)

    # the continuous scheduler prefills in chunks by default: its rows arrive through these
    def stage(self, tokens: list[int]) -> None:
        self.inner.stage(tokens)

    def unstage(self) -> None:
        self.inner.unstage()

    def discard_staged(self) -> None:
        self.inner.discard_staged()

    def propose(self, seqs: list[Sequence], k: int, pick: Picker = pick_argmax) -> Draft:
        draft = self.inner.propose(seqs, k, lambda logits, step: logits.argmin(dim=-1))
        return Draft(draft.tokens, None)


# ---- filtering -------------------------------------------------------------------------------------
def naive_support(row: torch.Tensor, params: SamplingParams) -> set[int]:
    """The definition, by full sort: top-k first, then the smallest prefix reaching top_p."""
    scaled = row / params.temperature
    order = scaled.argsort(descending=True)
    if params.top_k:
        order = order[: params.top_k]
    probs = torch.softmax(scaled[order].double(), dim=-1).tolist()
    keep, before = set(), 0.0
    for token, prob in zip(order.tolist(), probs):
        if params.top_p < 1 and before >= params.top_p:
            break
        keep.add(token)
        before += prob
    return keep


@settings(max_examples=40)
@given(
    vocab=st.sampled_from([7, 50, 700]),  # 700 makes the top-p window grow past its first 64 entries
    temperature=st.floats(0.2, 2.0),
    top_k=st.sampled_from([0, 1, 5, 100]),
    top_p=st.sampled_from([1.0, 0.95, 0.5, 0.05]),
    seed=st.integers(0, 1000),
)
def test_filter_support_matches_full_sort_definition(vocab, temperature, top_k, top_p, seed):
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(seed)) * 3
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    filtered = sampling.filter_logits(logits, [params] * 3)
    for row, out in zip(logits, filtered):
        kept = torch.isfinite(out)
        assert set(kept.nonzero().flatten().tolist()) == naive_support(row, params)
        assert torch.equal(out[kept], (row / temperature)[kept])


def test_filter_is_per_row_and_shape_independent():
    logits = torch.randn(3, 4, 40, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.5, top_k=3), SamplingParams(temperature=1.0),
              SamplingParams(temperature=1.7, top_p=0.8)]
    together = sampling.filter_logits(logits, params)
    for i, sp in enumerate(params):
        for j in range(4):
            assert torch.equal(together[i, j], sampling.filter_logits(logits[i, j][None], [sp])[0])


# ---- keyed noise -----------------------------------------------------------------------------------
def test_keyed_noise_depends_only_on_its_key():
    keys = [(7, 0), (7, 1), (8, 0), (-3, 12)]
    together = sampling.keyed_gumbel(keys, 50)
    for key, row in zip(keys, together):
        assert torch.equal(row, sampling.keyed_gumbel([key], 50)[0])
    assert len({tuple(r.tolist()) for r in together}) == len(keys)
    # Cached noise is the same noise, in any order, also after eviction.
    randomness = sampling.Randomness(None, cache_entries=2)
    for order in (keys, keys[::-1], keys[1:2] * 3):
        assert torch.equal(randomness.keyed(order, 50), sampling.keyed_gumbel(order, 50))
    assert len(randomness._noise) == 2


# ---- greedy stays greedy ---------------------------------------------------------------------------
def test_all_greedy_is_bit_identical_to_the_greedy_rule():
    logits = torch.randn(3, 4, VOCAB, generator=torch.Generator().manual_seed(1))
    drafts = logits[:, :3].argmax(-1)
    drafts[1, 1] = (drafts[1, 1] + 1) % VOCAB
    seqs = [Sequence(i, [5, 6], SamplingParams(), frozenset()) for i in range(3)]
    randomness = sampling.Randomness(0)
    for got, want in zip(sampling.accept_round(Draft(drafts, logits[:, :3]), logits, seqs, randomness),
                         acceptance.greedy(drafts, logits)):
        assert torch.equal(got, want)
    assert torch.equal(sampling.choose_tokens(logits[:, 0], seqs, 0, randomness), logits[:, 0].argmax(-1))
    assert sampling.draft_picker(seqs, randomness) is pick_argmax


# ---- coupled: token-identical to plain seeded sampling ---------------------------------------------
def mixed_params(count: int, seed: int, max_new_tokens: int = 14) -> list[SamplingParams]:
    temps, top_ps, top_ks = (0.3, 0.8, 1.5, 1.0), (1.0, 0.9, 1.0, 0.6), (0, 0, 12, 5)
    return [
        SamplingParams(max_new_tokens=max_new_tokens, temperature=temps[i % 4], top_p=top_ps[i % 4],
                       top_k=top_ks[i % 4], seed=seed + i)
        for i in range(count)
    ]


@pytest.mark.parametrize(
    "arch, method, scheduler",
    [("llama", "ragged", "static"), ("qwen2", "eqspec", "static"), ("gpt2", "ragged", "continuous"),
     ("llama", "eqspec", "static")],
)
def test_coupled_matches_plain_seeded_sampling(arch, method, scheduler):
    target, draft = pair(arch)
    prompts = random_prompts(7, [3, 9, 5, 12], seed=2, vocab=VOCAB)
    params = mixed_params(7, seed=40)
    spec = SpecConfig(speculation="fixed", method=method, num_draft_tokens=3, batch_size=3, scheduler=scheduler)
    assert run(target, prompts, params, spec, draft_model=draft) == oracle(target, prompts, params)


@settings(max_examples=25)
@given(
    arch=st.sampled_from(ARCHS),
    layout=st.sampled_from([("ragged", "static"), ("eqspec", "static"), ("ragged", "continuous")]),
    batch_size=st.integers(1, 4),
    k=st.integers(1, 5),
    temperature=st.floats(0.3, 1.5),
    top_p=st.sampled_from([1.0, 0.9, 0.5]),
    top_k=st.sampled_from([0, 3, 30]),
    seed=st.integers(0, 2**40),
)
def test_coupled_matches_plain_seeded_sampling_property(arch, layout, batch_size, k, temperature, top_p, top_k, seed):
    target, draft = pair(arch)
    prompts = random_prompts(5, [2, 7, 4], seed=seed % 1000, vocab=VOCAB)
    params = [SamplingParams(max_new_tokens=10, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed + i)
              for i in range(5)]
    spec = SpecConfig(speculation="fixed", method=layout[0], num_draft_tokens=k, batch_size=batch_size, scheduler=layout[1])
    assert run(target, prompts, params, spec, draft_model=draft) == oracle(target, prompts, params)


@settings(max_examples=20)
@given(
    arch=st.sampled_from(ARCHS),
    layout=st.sampled_from([("ragged", "static"), ("eqspec", "static"), ("ragged", "continuous"), ("exspec", "pool")]),
    drafter_kind=st.sampled_from(["model", "ngram", "hybrid"]),
    costs=st.sampled_from([(1.0, 0.01, 0.01), (1.0, 0.1, 0.2), (1.0, 0.5, 3.0)]),
    batch_size=st.integers(1, 4),
    k=st.integers(1, 5),
    temperature=st.floats(0.3, 1.5),
    top_k=st.sampled_from([0, 3, 30]),
    seed=st.integers(0, 2**40),
)
def test_coupled_is_exact_under_adaptive_speculation_and_prompt_lookup(arch, layout, drafter_kind, costs, batch_size,
                                                                       k, temperature, top_k, seed):
    """Rows verifying different numbers of drafts, plain steps between speculative rounds, n-gram rows
    with and without a match: still plain seeded sampling, token for token."""
    target, draft = pair(arch)
    base = random_prompts(5, [2, 7, 4], seed=seed % 1000, vocab=VOCAB)
    prompts = [p * 3 if i % 2 == 0 else p for i, p in enumerate(base)]
    params = [SamplingParams(max_new_tokens=12, temperature=temperature, top_k=top_k, seed=seed + i) for i in range(5)]
    spec = SpecConfig(method=layout[0], scheduler=layout[1], num_draft_tokens=k, batch_size=batch_size,
                      speculation="adaptive", drafter=drafter_kind, ngram_min=1, ngram_max=3)
    assert run(target, prompts, params, spec, draft_model=draft, costs=ScriptedCosts(*costs)) == oracle(target, prompts, params)


@pytest.mark.parametrize("method", ["ragged", "eqspec"])
def test_coupled_is_drafter_independent(method):
    """Scripted drafters that know the answer (always, sometimes, never) and an adversarial drafter
    proposing its least likely tokens change acceptance, never the output."""
    target, draft = pair("llama")
    prompts = random_prompts(5, [4, 8], seed=3, vocab=VOCAB)
    params = mixed_params(5, seed=11, max_new_tokens=12)
    expected = oracle(target, prompts, params)
    spec = SpecConfig(speculation="fixed", method=method, num_draft_tokens=4, batch_size=4)
    scripted = ScriptedDrafter({tuple(p): e for p, e in zip(prompts, expected)}, [1.0, 0.6, 0.0], VOCAB, seed=5)
    assert run(target, prompts, params, spec, drafter=scripted) == expected
    adversarial = AdversarialDrafter(ModelDrafter((RaggedLayout if method == "ragged" else PaddedLayout)(draft, 4, 64)))
    assert run(target, prompts, params, spec, drafter=adversarial) == expected


def test_coupled_output_depends_only_on_the_request():
    """Same seed twice, alone or in any batch (with greedy, coupled and unseeded rows around it),
    any K, layout or scheduler: the same tokens."""
    target, draft = pair("qwen2")
    mine = SamplingParams(max_new_tokens=16, temperature=1.0, top_p=0.95, seed=1234)
    prompt = random_prompts(1, [6], seed=9, vocab=VOCAB)[0]
    others = random_prompts(5, [3, 11], seed=10, vocab=VOCAB)
    other_params = [SamplingParams(max_new_tokens=16), SamplingParams(max_new_tokens=5, temperature=0.7),
                    SamplingParams(max_new_tokens=20, temperature=1.2, seed=9), SamplingParams(max_new_tokens=3),
                    SamplingParams(max_new_tokens=16, temperature=0.9, top_k=4)]
    alone = run(target, [prompt], [mine], SpecConfig(method="ar", batch_size=1))[0]
    assert alone == reference_decode(target, prompt, mine, STOP)
    for spec, engine_seed in ((SpecConfig(speculation="fixed", method="ragged", num_draft_tokens=2, batch_size=4), 0),
                              (SpecConfig(speculation="fixed", method="ragged", num_draft_tokens=5, batch_size=3, scheduler="continuous"), 1),
                              (SpecConfig(speculation="fixed", method="eqspec", num_draft_tokens=3, batch_size=6), 2)):
        batch = others[:2] + [prompt] + others[2:]
        got = run(target, batch, other_params[:2] + [mine] + other_params[2:], spec, draft_model=draft, seed=engine_seed)
        assert got[2] == alone


def test_rules_do_not_disturb_each_other_in_one_batch():
    target, draft = pair("llama")
    prompts = random_prompts(6, [5, 8], seed=4, vocab=VOCAB)
    params = [SamplingParams(max_new_tokens=15), SamplingParams(max_new_tokens=15, temperature=1.0, top_p=0.6),
              SamplingParams(max_new_tokens=15, temperature=0.8, seed=3), SamplingParams(max_new_tokens=15),
              SamplingParams(max_new_tokens=15, temperature=1.3, top_k=10), SamplingParams(max_new_tokens=15, temperature=0.5, seed=4)]
    for method in ("ragged", "eqspec"):
        got = run(target, prompts, params, SpecConfig(speculation="fixed", method=method, num_draft_tokens=3, batch_size=6), draft_model=draft)
        for out, prompt, sp in zip(got, prompts, params):
            if sp.greedy:
                assert out == greedy_decode(target, prompt, sp.max_new_tokens, STOP)
            elif sp.seed is not None:
                assert out == reference_decode(target, prompt, sp, STOP)
            else:
                assert outside_support(target, prompt, out, sp) == []


def test_drafter_uses_the_targets_noise_and_positions():
    """A drafter identical to the target proposes exactly the target's samples under the coupled
    rule (same keyed noise at the same positions), and has every draft accepted under the rejection
    rule (q == p), so acceptance is complete in both."""
    target, _ = pair("llama")
    prompts = random_prompts(4, [5, 9], seed=8, vocab=VOCAB)
    for seed in (5, None):
        params = [SamplingParams(max_new_tokens=16, temperature=1.0, top_p=0.9, seed=None if seed is None else seed + i)
                  for i in range(4)]
        engine = build_engine(target, SpecConfig(speculation="fixed", method="ragged", num_draft_tokens=4, batch_size=4, generator_seed=0),
                              draft_model=target)
        engine.generate(prompts, params)
        assert engine.stats.drafted > 0 and engine.stats.accepted == engine.stats.drafted


# ---- rejection: repeatable with an engine seed -----------------------------------------------------
def test_rejection_runs_are_repeatable_with_an_engine_seed():
    target, draft = pair("gpt2")
    prompts = random_prompts(4, [3, 6], seed=5, vocab=VOCAB)
    params = [SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.9)] * 4
    spec = SpecConfig(speculation="fixed", method="ragged", num_draft_tokens=3, batch_size=4)
    first = run(target, prompts, params, spec, draft_model=draft, seed=7)
    assert run(target, prompts, params, spec, draft_model=draft, seed=7) == first
    assert run(target, prompts, params, spec, draft_model=draft, seed=8) != first


def test_rejection_accepts_drafters_without_probabilities():
    """A drafter that reports no q is treated as a point mass, which keeps the rule exact: samples
    stay inside the target's filtered support, drafts the target likes are accepted, and at a
    temperature so low that the target is all but certain, the output is its greedy path even
    though 30% of the drafts are wrong."""
    target, _ = pair("llama")
    prompts = random_prompts(3, [4], seed=6, vocab=VOCAB)
    greedy = [greedy_decode(target, p, 10, STOP) for p in prompts]
    spec = SpecConfig(speculation="fixed", method="ragged", num_draft_tokens=3, batch_size=3)
    for temperature, top_k in ((0.8, 5), (0.01, 0)):  # 0.01: the lowest temperature accepted
        params = SamplingParams(max_new_tokens=10, temperature=temperature, top_k=top_k)
        scripted = ScriptedDrafter({tuple(p): g for p, g in zip(prompts, greedy)}, 0.7, VOCAB)
        engine = build_engine(target, replace(spec, generator_seed=1), STOP, drafter=scripted)
        out = [s.generated for s in engine.generate(prompts, params)]
        assert all(outside_support(target, p, o, params) == [] for p, o in zip(prompts, out))
        assert 0 < engine.stats.accepted < engine.stats.drafted
        if temperature < 0.1:
            assert out == greedy


def test_rejection_caps_each_row_at_its_own_drafts():
    """A row with L of k drafts is judged exactly as a round of L drafts would judge it (same
    randomness): the padding after them is neither accepted nor used for the correction, and the
    token at slot L is drawn from p, the bonus distribution."""
    gen = torch.Generator().manual_seed(4)
    b, k, vocab = 64, 4, 6
    p = torch.softmax(torch.randn(b, k + 1, vocab, generator=gen) * 2, dim=-1)
    q = torch.softmax(torch.randn(b, k, vocab, generator=gen) * 2, dim=-1)
    drafts = torch.multinomial(q.view(-1, vocab), 1, generator=gen).view(b, k)
    uniform = torch.rand(b, k, generator=gen)
    noise = sampling.gumbel(torch.rand(b, vocab, generator=gen))
    lengths = torch.arange(b) % (k + 1)
    tokens, count = acceptance.rejection(drafts, p, q, uniform, noise, lengths)
    for row in range(b):
        n = int(lengths[row])
        alone_tokens, alone_count = acceptance.rejection(drafts[row:row + 1, :n], p[row:row + 1, : n + 1],
                                                         q[row:row + 1, :n], uniform[row:row + 1, :n], noise[row:row + 1])
        assert int(count[row]) == int(alone_count[0]) <= n + 1
        assert tokens[row, : int(count[row])].tolist() == alone_tokens[0, : int(alone_count[0])].tolist()
    greedy_tokens, greedy_count = acceptance.greedy(drafts, torch.log(p), lengths)
    assert bool((greedy_count <= lengths + 1).all())


def test_rejection_with_prompt_lookup_stays_in_the_targets_support():
    target, draft = pair("qwen2")
    base = random_prompts(4, [3, 6], seed=12, vocab=VOCAB)
    prompts = [p * 3 for p in base]
    params = [SamplingParams(max_new_tokens=12, temperature=0.9, top_k=5)] * 4
    for kind in ("ngram", "hybrid"):
        spec = SpecConfig(method="ragged", num_draft_tokens=3, batch_size=4, drafter=kind, ngram_min=1, ngram_max=3,
                          speculation="adaptive")
        engine = build_engine(target, replace(spec, generator_seed=2), STOP, draft_model=draft,
                              costs=ScriptedCosts(1.0, 0.01, 0.05))  # cheap enough to verify 1-token matches
        out = engine.generate(prompts, params)
        assert engine.stats.drafted > 0
        assert all(outside_support(target, p, o.generated, sp) == [] for p, o, sp in zip(prompts, out, params))


def test_unseeded_sampling_has_no_reference_output():
    target, _ = pair("llama")
    with pytest.raises(BatchspecError, match="seed"):
        reference_decode(target, [4, 5], SamplingParams(temperature=1.0))


# ---- CLI ---------------------------------------------------------------------------------------------
def test_generate_cli_samples_with_seed_and_verifies(tiny_pair_dirs, tmp_path, capsys):
    target, draft = tiny_pair_dirs
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the water is\nhow many people were there\nwrite a long word\n")
    common = ["generate", "--prompts", str(prompts), "--target", str(target), "--draft", str(draft),
              "--no-chat-template", "--max-new-tokens", "10", "--batch-size", "2", "-k", "3"]
    assert cli_main(common + ["--output", str(tmp_path / "greedy.jsonl")]) == 0
    capsys.readouterr()
    sampled = common + ["--temperature", "1.2", "--top-k", "40", "--seed", "3", "--verify",
                        "--output", str(tmp_path / "sampled.jsonl")]
    assert cli_main(sampled) == 0
    assert json.loads(capsys.readouterr().out)["exact_match"] == "3/3"
    read = lambda name: [json.loads(line)["token_ids"] for line in (tmp_path / name).read_text().splitlines()]
    assert read("sampled.jsonl") != read("greedy.jsonl")  # the sampling options took effect
