"""Rejection sampling preserves the target's distribution: the chi-square machinery, the exact
enumeration check, and statistical tests (rule level and through the engine) that pass for the real
rule and reject deliberately broken ones, proving the tests have power. Every draw is seeded."""

from __future__ import annotations

import itertools
import json
from collections import Counter
from functools import lru_cache

import numpy as np
import pytest
import torch
from scipy import stats
from tinyworld import ScriptedCosts, perturbed_copy, random_prompts

from batchspec import acceptance, sampling
from batchspec.cli import main as cli_main
from batchspec.config import SamplingParams, SpecConfig
from batchspec.distribution import (
    END,
    compare_positions,
    exact_rejection_check,
    position_histograms,
    random_model,
    two_sample_chi2,
)
from batchspec.build import build_engine
from tinyworld import tiny_model

ALPHA = 0.01


# ---- broken rules: TEST-ONLY, each a published way to get speculative sampling wrong ---------------
# Drop-in replacements for `acceptance.residual(p, q, slot, lengths)`, patched in with monkeypatch so
# the real exact check, sampler and engine run with them.
def _stopping_slot(p, q, slot, lengths=None):
    """(p at the stopping slot [b, V], q there or None for the bonus slot k, rejected [b, 1])."""
    k = q.shape[1]
    rows = torch.arange(p.shape[0])
    drafted = q[rows, slot.clamp(max=k - 1)] if k else None
    return p[rows, slot], drafted, (slot < (k if lengths is None else lengths))[:, None]


def _broken_correction_from_drafter(p, q, slot, lengths=None):
    """The token emitted at a rejection is drawn from the drafter's q instead of the residual."""
    target, drafted, rejected = _stopping_slot(p, q, slot, lengths)
    return target if drafted is None else torch.where(rejected, drafted, target)


def _broken_residual_is_p(p, q, slot, lengths=None):
    """On rejection, resample from p instead of normalize(max(0, p - q))."""
    return _stopping_slot(p, q, slot, lengths)[0]


def _broken_residual_not_normalised(p, q, slot, lengths=None):
    """max(0, p - q) used without renormalising: an inverse-CDF draw past its mass falls back to the
    target's argmax, so that token absorbs the missing mass."""
    target, drafted, rejected = _stopping_slot(p, q, slot, lengths)
    if drafted is None:
        return target
    leftover = (target - drafted).clamp(min=0)
    fallback = torch.nn.functional.one_hot(target.argmax(dim=-1), target.shape[-1]).to(target.dtype)
    return torch.where(rejected, leftover + (1 - leftover.sum(-1, keepdim=True)) * fallback, target)


BROKEN = [_broken_correction_from_drafter, _broken_residual_is_p, _broken_residual_not_normalised]


# ---- chi-square machinery --------------------------------------------------------------------------
def test_chi2_matches_scipy_when_no_bin_is_rare():
    a, b = {"x": 50, "y": 30, "z": 20}, {"x": 40, "y": 45, "z": 35}
    expected = stats.chi2_contingency(np.array([[50, 30, 20], [40, 45, 35]]), correction=False)
    result = two_sample_chi2(a, b)
    assert (result.bins, result.dof, result.samples) == (3, 2, (100, 120))
    assert result.chi2 == pytest.approx(expected[0]) and result.p_value == pytest.approx(expected[1])


def test_chi2_merges_rare_tokens_until_expected_counts_reach_five():
    a = {"x": 60, "y": 30, "r1": 3, "r2": 2, "r3": 4, "r4": 1}
    b = {"x": 55, "y": 35, "r1": 2, "r3": 3, "r5": 5}
    result = two_sample_chi2(a, b)
    assert result.bins == 3  # x, y, other (r1..r5: 20 samples)
    lone_rare = two_sample_chi2({"x": 100, "y": 100, "r": 1}, {"x": 100, "y": 100})
    assert lone_rare.bins == 2 and lone_rare.samples == (201, 200)
    assert two_sample_chi2({"x": 10}, {"x": 7}).dof == 0
    same = two_sample_chi2(a, a)
    assert same.chi2 == pytest.approx(0) and same.p_value == pytest.approx(1)


def test_position_histograms_count_stopped_samples_as_end():
    hist = position_histograms([[5, 6], [5], [7, 6, 1]], 3)
    assert hist[0] == Counter({5: 2, 7: 1})
    assert hist[1] == Counter({6: 2, END: 1})
    assert hist[2] == Counter({END: 2, 1: 1})


# ---- exact enumeration -----------------------------------------------------------------------------
EXACT_CASES = [
    (3, 1, SamplingParams(temperature=1.0)),
    (4, 2, SamplingParams(temperature=0.7, top_k=3)),
    (4, 3, SamplingParams(temperature=1.3, top_p=0.8)),
    (5, 2, SamplingParams(temperature=1.0, top_k=4, top_p=0.9)),
    (3, 0, SamplingParams(temperature=0.9)),  # no drafts: the bonus alone is plain sampling
]


@pytest.mark.parametrize("vocab, k, params", EXACT_CASES)
def test_exact_speculative_distribution_equals_target(vocab, k, params):
    for seed in range(3):
        assert exact_rejection_check(vocab, k, params, seed) < 1e-12


@pytest.mark.parametrize("broken", BROKEN)
def test_exact_check_catches_broken_rules(broken, monkeypatch):
    monkeypatch.setattr(acceptance, "residual", broken)
    assert exact_rejection_check(4, 2, SamplingParams(temperature=1.0), seed=0) > 1e-3


# ---- rule level: many rounds on toy models, joint distribution of k+1 tokens -------------------------
@lru_cache(maxsize=None)
def toy_tables(vocab: int, k: int, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Next-token tables of a toy target p and drafter q: entry j has shape [vocab] * (j + 1)."""
    params = SamplingParams(temperature=1.0, top_k=vocab - 1)
    models = random_model(vocab, 2 * seed, params), random_model(vocab, 2 * seed + 1, params)
    return tuple(
        [torch.stack([m(x) for x in itertools.product(range(vocab), repeat=j)]).view(*[vocab] * (j + 1)).float()
         for j in range(k + 1)]
        for m in models
    )


def _rows(table: torch.Tensor, prefix: torch.Tensor) -> torch.Tensor:
    """The next-token distribution [n, vocab] after each row's prefix [n, j]."""
    return table[tuple(prefix.T)] if prefix.shape[1] else table.expand(prefix.shape[0], -1)


def _draw(table: torch.Tensor, prefix: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    return torch.multinomial(_rows(table, prefix), 1, generator=generator).squeeze(1)


def rule_samples(vocab: int, k: int, n: int, seed: int) -> tuple[list[tuple], list[tuple]]:
    """(plain, speculative) samples of k+1 tokens: one vectorized round of `acceptance.rejection`
    over n rows, each completed by plain sampling."""
    p_tab, q_tab = toy_tables(vocab, k, 0)
    gen = torch.Generator().manual_seed(seed)
    plain = torch.zeros((n, k + 1), dtype=torch.long)
    for j in range(k + 1):
        plain[:, j] = _draw(p_tab[j], plain[:, :j], gen)
    drafts = torch.zeros((n, k), dtype=torch.long)
    for j in range(k):
        drafts[:, j] = _draw(q_tab[j], drafts[:, :j], gen)
    p = torch.stack([_rows(p_tab[j], drafts[:, :j]) for j in range(k + 1)], dim=1)
    q = torch.stack([_rows(q_tab[j], drafts[:, :j]) for j in range(k)], dim=1)
    uniform = torch.rand((n, k), generator=gen)
    noise = sampling.gumbel(torch.rand((n, vocab), generator=gen))
    tokens, count = acceptance.rejection(drafts, p, q, uniform, noise)
    for j in range(k + 1):
        fill = _draw(p_tab[j], tokens[:, :j], gen)
        tokens[:, j] = torch.where(count > j, tokens[:, j], fill)
    return [tuple(r) for r in plain.tolist()], [tuple(r) for r in tokens.tolist()]


def test_rule_chi_square_accepts_the_rule():
    plain, spec = rule_samples(vocab=5, k=2, n=20000, seed=1)
    assert two_sample_chi2(Counter(plain), Counter(spec)).p_value > ALPHA


@pytest.mark.parametrize("broken", BROKEN)
def test_rule_chi_square_rejects_broken_rules(broken, monkeypatch):
    monkeypatch.setattr(acceptance, "residual", broken)
    plain, spec = rule_samples(vocab=5, k=2, n=20000, seed=1)
    assert two_sample_chi2(Counter(plain), Counter(spec)).p_value < 1e-6


# ---- engine level: tiny models, per-position histograms ------------------------------------------------
POSITIONS = 4
ENGINE_PARAMS = SamplingParams(max_new_tokens=POSITIONS, temperature=1.0, top_k=8)
ENGINE_SAMPLES = 2000


@lru_cache(maxsize=None)
def engine_world() -> tuple[torch.nn.Module, torch.nn.Module, list[int]]:
    """A tiny target, a drafter far enough from it (acceptance ~55%) that broken rules show."""
    target = tiny_model("llama", vocab_size=96, seed=0)
    return target, perturbed_copy(target, 0.05, seed=1), random_prompts(1, [5], seed=3, vocab=96)[0]


def engine_samples(method: str, seed: int, repeat: int = 1, **spec_fields) -> list[list[int]]:
    """ENGINE_SAMPLES continuations of the world's prompt (said `repeat` times, so prompt lookup finds
    matches); `spec_fields` choose speculation and drafter, adaptive speculation on scripted costs
    that make its widths vary between 0 and K."""
    target, draft, prompt = engine_world()
    spec = SpecConfig(method=method, num_draft_tokens=2, batch_size=128, generator_seed=seed,
                      **{"speculation": "fixed", **spec_fields})
    engine = build_engine(target, spec, draft_model=draft if spec.speculative else None,
                          costs=ScriptedCosts(1.0, 0.0012, 0.02))
    return [s.generated for s in engine.generate([prompt * repeat] * ENGINE_SAMPLES, ENGINE_PARAMS)]


@lru_cache(maxsize=None)
def plain_engine_samples(repeat: int = 1) -> list[list[int]]:
    return engine_samples("ar", seed=0, repeat=repeat)


@pytest.mark.parametrize("method, seed", [("ragged", 1), ("eqspec", 2)])
def test_engine_chi_square_accepts_speculative_sampling(method, seed):
    results = compare_positions(plain_engine_samples(), engine_samples(method, seed), POSITIONS)
    assert min(r.p_value for r in results) > ALPHA / POSITIONS  # Bonferroni over positions


@pytest.mark.parametrize("repeat, seed, fields", [
    (1, 3, {"speculation": "adaptive"}),
    (2, 4, {"drafter": "ngram", "ngram_min": 1, "ngram_max": 3}),
    (2, 5, {"drafter": "hybrid", "speculation": "adaptive", "ngram_min": 1, "ngram_max": 3}),
])
def test_engine_chi_square_accepts_adaptive_speculation_and_prompt_lookup(repeat, seed, fields):
    """Widths chosen per round from the drafter's confidence (sum(q^2) for these unseeded rows), and
    deterministic n-gram drafts (q a point mass) inside and next to sampled ones, keep the target's
    distribution."""
    results = compare_positions(plain_engine_samples(repeat), engine_samples("ragged", seed, repeat, **fields), POSITIONS)
    assert min(r.p_value for r in results) > ALPHA / POSITIONS


@pytest.mark.parametrize("broken", BROKEN)
def test_engine_chi_square_rejects_broken_rules(broken, monkeypatch):
    plain = plain_engine_samples()
    monkeypatch.setattr(acceptance, "residual", broken)
    results = compare_positions(plain, engine_samples("ragged", seed=1), POSITIONS)
    assert min(r.p_value for r in results) < 1e-6


# ---- the command -------------------------------------------------------------------------------------
def test_verify_distribution_command(tiny_pair_dirs, tmp_path, capsys):
    target, draft = tiny_pair_dirs
    report = tmp_path / "report.json"
    args = ["verify-distribution", "--target", str(target), "--draft", str(draft), "--no-chat-template",
            "--samples", "300", "--positions", "3", "-k", "2", "--batch-size", "100", "--limit", "2",
            "--report", str(report)]
    assert cli_main(args) == 0
    printed = capsys.readouterr().out
    assert "exact check" in printed and "worst:" in printed
    data = json.loads(report.read_text())
    assert data["passed"] and data["exact"]["passed"] and len(data["chi_square"]["tests"]) == 6
    assert cli_main(args[:-2] + ["--method", "ar"]) == 2
    for extra, field, value in ((["--speculation", "adaptive"], "speculation", "adaptive"),
                                (["--draft", "ngram", "--ngram-min", "1", "--ngram-max", "2"], "drafter", "ngram")):
        assert cli_main(args + extra) == 0
        data = json.loads(report.read_text())
        assert data["passed"] and data["config"][field] == value
