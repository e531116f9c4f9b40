"""Targets with recurrent state (pure Mamba2; Gated DeltaNet + attention: Qwen3-Next, Qwen3.5, OLMo
hybrid; Mamba2 + attention: Falcon-H1, Granite 4, Bamba; short convolutions + attention: LFM2): every
row's tokens must equal plain decoding of that prompt alone on the model's own cache, whatever the
batch, K, drafter, acceptance pattern, sampling or row reuse."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from hypothesis import given, settings, strategies as st
from tinyworld import (
    TINY_STATEFUL_ARCHS,
    VOCAB_SIZE,
    ScriptedDrafter,
    assert_oracle_matches_generate,
    perturbed_copy,
    random_prompts,
    tiny_model,
    tiny_stateful_model,
    tiny_tokenizer,
)
from transformers import AutoModelForCausalLM, DynamicCache, JambaConfig, MambaConfig, MiniMaxConfig, NemotronHConfig

from batchspec.cli import main
from batchspec.config import DEFAULT_PREFILL_TOKENS, BatchspecError, SamplingParams, SpecConfig
from batchspec.forensics.audit import Auditor
from batchspec.forensics.audit_inputs import AuditItem
from batchspec.forensics.compare import SYNC_ERROR
from batchspec.forensics.invariants import InvariantError
from batchspec.kv import StateStore, check_supported, is_stateful
from batchspec.layouts import RaggedLayout
from batchspec.layouts.stateful import ReplayStatefulLayout, StatefulLayout
from batchspec.build import build_engine
from batchspec.reference import greedy_decode, reference_decode

ARCHS = list(TINY_STATEFUL_ARCHS)
RECURRENT = [a for a in ARCHS if a != "lfm2"]  # LFM2's layers keep a convolution window only


@functools.cache
def target(arch: str) -> torch.nn.Module:
    return tiny_stateful_model(arch, vocab_size=VOCAB_SIZE, seed=0)


@functools.cache
def drafter(arch: str, kind: str) -> torch.nn.Module:
    """`stateful`: a perturbed copy of the target (partial, ragged acceptance; its own recurrent
    state); `attention`: a tiny Llama sharing the vocabulary (K/V cursors beside a stateful target)."""
    if kind == "stateful":
        return perturbed_copy(target(arch), noise=0.02, seed=1)
    return tiny_model("llama", vocab_size=VOCAB_SIZE, seed=3)


@functools.cache
def oracle(arch: str, prompt: tuple[int, ...], params: SamplingParams, stop: tuple[int, ...] = ()) -> list[int]:
    return reference_decode(target(arch), list(prompt), params, stop)


def stateful_layouts(layout: type) -> object:
    """A layout factory putting stateful models on `layout` and others on the ragged layout (what
    build_engine does with the method's own stateful layout)."""

    def make(model: torch.nn.Module, max_rows: int, capacity: int):
        return (layout if is_stateful(model) else RaggedLayout)(model, max_rows, capacity)

    return make


def assert_exact(arch, prompts, outputs, params, stop=()):
    per_request = params if isinstance(params, list) else [params] * len(prompts)
    for prompt, sp, seq in zip(prompts, per_request, outputs):
        assert seq.generated == oracle(arch, tuple(prompt), sp, tuple(stop)), f"{arch}: prompt {seq.index} diverged"


# ---- what the supported list rests on --------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_cached_forwards_continue_the_state_exactly(arch):
    """On the model's own cache, a prefill then multi-token and single-token cached forwards give the
    logits of one full forward (what a verification forward of K+1 tokens relies on)."""
    model = target(arch)
    ids = torch.tensor(random_prompts(1, [23], seed=1))
    with torch.inference_mode():
        full = model(input_ids=ids).logits
        cache, pos, parts = DynamicCache(config=model.config), 0, []
        for n in (7, 3, 1, 4, 2, 1, 1, 3, 1):
            parts.append(model(input_ids=ids[:, pos : pos + n], position_ids=torch.arange(pos, pos + n)[None],
                               cache=cache, use_cache=True).logits)
            pos += n
    assert (torch.cat(parts, dim=1) - full).abs().max() < 1e-3 * full.abs().max()


@pytest.mark.parametrize("arch", ARCHS)
def test_oracle_matches_transformers_generate(arch):
    """The oracle's plain loop on the model's own cache equals the model's own greedy generate."""
    assert_oracle_matches_generate(target(arch))


# ---- exactness ---------------------------------------------------------------------------------------


@settings(max_examples=30)
@given(
    arch=st.sampled_from(ARCHS),
    draft_kind=st.sampled_from(["stateful", "attention"]),
    method=st.sampled_from(["ragged", "ragged", "ar"]),
    continuous=st.booleans(),
    batch_size=st.integers(1, 8),
    k=st.integers(1, 6),
    lengths=st.lists(st.integers(1, 24), min_size=1, max_size=9),
    max_new=st.integers(1, 20),
    sampled=st.booleans(),
    seed=st.integers(0, 10_000),
    use_stop=st.booleans(),
)
def test_model_drafter_matches_oracle(arch, draft_kind, method, continuous, batch_size, k, lengths, max_new, sampled,
                                      seed, use_stop):
    """Greedy and seeded (coupled) sampling, static and continuous batching, stateful and attention drafters."""
    prompts = random_prompts(len(lengths), lengths, seed)
    params = SamplingParams(max_new_tokens=max_new, temperature=0.8 if sampled else 0.0, top_p=0.9,
                            seed=seed if sampled else None)
    stop: tuple[int, ...] = ()
    if use_stop:  # a token the target really emits mid-continuation, so rows stop at different rounds
        stop = (oracle(arch, tuple(prompts[0]), params)[max_new // 2],)
    spec = SpecConfig(speculation="fixed", method=method, num_draft_tokens=k, batch_size=batch_size,
                      scheduler="continuous" if continuous else "static")
    engine = build_engine(target(arch), spec, stop, draft_model=drafter(arch, draft_kind))
    outputs = engine.generate(prompts, params)
    assert_exact(arch, prompts, outputs, params, stop)
    assert isinstance(engine.rows.home, StatefulLayout)
    assert engine.stats.extra["state_time"] > 0


@settings(max_examples=20)
@given(
    arch=st.sampled_from(ARCHS),
    batch_size=st.integers(1, 8),
    k=st.integers(1, 6),
    lengths=st.lists(st.integers(1, 16), min_size=1, max_size=8),
    p_right=st.one_of(st.sampled_from([0.0, 1.0]), st.lists(st.floats(0, 1), min_size=1, max_size=8)),
    seed=st.integers(0, 10_000),
)
def test_rigged_acceptance_matches_oracle_with_invariants(arch, batch_size, k, lengths, p_right, seed):
    """Drafters always right, always wrong, or right with a per-row probability; the invariant
    checker (committed states against fresh forwards of the committed prefixes) runs every round."""
    params = SamplingParams(max_new_tokens=14)
    prompts = random_prompts(len(lengths), lengths, seed)
    truth = {tuple(p): oracle(arch, tuple(p), params) for p in prompts}
    spec = SpecConfig(speculation="fixed", method="ragged", num_draft_tokens=k, batch_size=batch_size, check_invariants=True)
    engine = build_engine(target(arch), spec, drafter=ScriptedDrafter(truth, p_right, VOCAB_SIZE, seed=seed))
    outputs = engine.generate(prompts, params)
    assert_exact(arch, prompts, outputs, params)
    if p_right == 1.0:
        assert engine.stats.accepted == engine.stats.drafted > 0
    if p_right == 0.0:
        assert engine.stats.accepted == 0


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("layout", [StatefulLayout, ReplayStatefulLayout], ids=["snapshot", "replay"])
def test_both_state_strategies_are_exact(arch, layout):
    """Snapshots and replay keep the same states: a ragged batch with partial acceptance, the
    stateful drafter on the same strategy, invariants checked every round."""
    prompts = random_prompts(6, [1, 9, 5, 14, 2, 11], seed=11)
    params = [SamplingParams(max_new_tokens=n) for n in (16, 7, 16, 12, 3, 16)]
    spec = SpecConfig(speculation="fixed", method="ragged", num_draft_tokens=4, batch_size=4, check_invariants=True)
    engine = build_engine(target(arch), spec, draft_model=drafter(arch, "stateful"), layout=stateful_layouts(layout))
    outputs = engine.generate(prompts, params)
    assert_exact(arch, prompts, outputs, params)
    assert type(engine.rows.home) is layout
    assert 0 < engine.stats.accepted < engine.stats.drafted  # acceptance really was ragged
    assert (engine.stats.extra["state_replay_forwards"] > 0) == (layout is ReplayStatefulLayout)


@pytest.mark.parametrize("arch", ["mamba2", "qwen3_next"])
def test_reused_rows_start_clean(arch):
    """A long queue through few rows: every row is handed to many requests in turn (long prompts,
    then one-token prompts that prefill nothing themselves), and none inherits a previous state."""
    prompts = random_prompts(21, [17, 1, 9, 1, 23, 2, 1], seed=21)
    params = [SamplingParams(max_new_tokens=2 + (i * 5) % 11) for i in range(len(prompts))]
    spec = SpecConfig(speculation="fixed", method="ragged", num_draft_tokens=3, batch_size=3, scheduler="continuous", check_invariants=True)
    outputs = build_engine(target(arch), spec, draft_model=drafter(arch, "stateful")).generate(prompts, params)
    assert [s.index for s in outputs] == list(range(len(prompts)))
    assert_exact(arch, prompts, outputs, params)


def test_default_chunked_prefill_falls_back_to_whole_prompts_for_recurrent_state():
    """The continuous scheduler's default budget applies only where chunked prefill is supported: a
    recurrent-state model prefills whole prompts under it (exact), and asking for chunks is refused."""
    arch = "mamba2"
    spec = SpecConfig(speculation="fixed", method="ragged", num_draft_tokens=3, batch_size=2, scheduler="continuous")
    assert spec.prefill_budget == DEFAULT_PREFILL_TOKENS
    engine = build_engine(target(arch), spec, draft_model=drafter(arch, "stateful"))
    assert engine.prefill.budget is None
    prompts = random_prompts(3, [40, 3, 25], seed=5)
    params = [SamplingParams(max_new_tokens=6)] * 3
    assert_exact(arch, prompts, engine.generate(prompts, params), params)
    with pytest.raises(BatchspecError, match="not supported for .* .recurrent state"):
        build_engine(target(arch), SpecConfig(method="ragged", max_prefill_tokens=8), draft_model=drafter(arch, "stateful"))


# ---- the deliberately wrong method and the checker ------------------------------------------------


@pytest.mark.parametrize("arch", RECURRENT)
def test_naive_state_diverges_and_the_checker_names_it(arch):
    """Rolling back as transformers' `crop` does (recurrent state kept) corrupts outputs."""
    prompts = random_prompts(6, [3, 9, 5, 14, 2, 11], seed=11)
    params = SamplingParams(max_new_tokens=16)
    outputs = _naive_state_run(arch, prompts, params)
    wrong = sum(seq.generated != oracle(arch, tuple(p), params) for p, seq in zip(prompts, outputs))
    assert wrong == len(prompts)
    checked = SpecConfig(method="naive-state", num_draft_tokens=4, batch_size=4, check_invariants=True)
    named = r"(target|drafter): row \d+, round \d+: committed recurrent state of layer \d+ differs"
    with pytest.raises(InvariantError, match=named):
        build_engine(target(arch), checked, draft_model=drafter(arch, "stateful")).generate(prompts, params)


def test_naive_state_is_harmless_without_recurrent_state():
    """`crop` does roll back convolution windows: on LFM2 (no recurrent state) the naive rollback is exact."""
    prompts = random_prompts(4, [3, 9, 5, 11], seed=11)
    params = SamplingParams(max_new_tokens=12)
    assert_exact("lfm2", prompts, _naive_state_run("lfm2", prompts, params), params)


def _naive_state_run(arch: str, prompts: list[list[int]], params: SamplingParams) -> list:
    """naive-state with a drafter right half the time: every round rejects some drafts."""
    truth = {tuple(p): oracle(arch, tuple(p), params) for p in prompts}
    engine = build_engine(target(arch), SpecConfig(method="naive-state", num_draft_tokens=4, batch_size=4),
                          drafter=ScriptedDrafter(truth, 0.5, VOCAB_SIZE, seed=1))
    return engine.generate(prompts, params)


def test_checker_catches_a_commit_that_only_moves_cursors(monkeypatch):
    def cursors_only(self, lengths):
        self.committed = self.lengths = lengths.to(self.device)

    monkeypatch.setattr(StatefulLayout, "commit", cursors_only)
    spec = SpecConfig(speculation="fixed", method="ragged", num_draft_tokens=4, batch_size=2, check_invariants=True)
    engine = build_engine(target("mamba2"), spec, draft_model=drafter("mamba2", "attention"))
    with pytest.raises(InvariantError, match=r"target: row \d+, round 1: committed (conv|recurrent) state .* differs"):
        engine.generate(random_prompts(2, [5, 7], seed=1), SamplingParams(max_new_tokens=10))


def test_checker_catches_a_state_committed_one_token_early(monkeypatch):
    """A subtler slip: each row keeps the snapshot before its last accepted token."""
    original = StateStore.keep_steps
    monkeypatch.setattr(StateStore, "keep_steps", lambda self, keep: original(self, (keep - 1).clamp(min=0)))
    spec = SpecConfig(speculation="fixed", method="ragged", num_draft_tokens=3, batch_size=3, check_invariants=True)
    engine = build_engine(target("qwen3_next"), spec, draft_model=drafter("qwen3_next", "attention"))
    with pytest.raises(InvariantError, match="differs from a fresh forward of the committed prefix"):
        engine.generate(random_prompts(3, [4, 8, 2], seed=3), SamplingParams(max_new_tokens=8))


def test_audit_flags_naive_state_as_sync_errors():
    arch, max_new = "falcon_h1", 16
    prompts = random_prompts(4, [3, 9, 5, 12], seed=11)
    outputs = _naive_state_run(arch, prompts, SamplingParams(max_new_tokens=max_new))
    # the margin is calibrated on the stateful layout (left padding would enter the recurrent state)
    auditor = Auditor(target(arch), tiny_tokenizer(), max_new)
    report = auditor.audit([AuditItem(str(i), p, o.generated) for i, (p, o) in enumerate(zip(prompts, outputs))])
    assert list(report["calibration"]["noise"]) == ["stateful-verify"] and report["calibration"]["margin"] > 0
    assert [row["classification"] for row in report["rows"]] == [SYNC_ERROR] * len(prompts)


# ---- what is refused, with one line ------------------------------------------------------------------


@pytest.mark.parametrize("method, message", [
    ("eqspec", "method eqspec cannot decode mamba2 .*recurrent state.*; use ar, ragged"),
    ("exspec", "method exspec cannot decode mamba2"),
    ("naive-kv", "method naive-kv cannot decode mamba2"),
])
def test_padded_and_other_methods_are_refused_for_stateful_targets(method, message):
    with pytest.raises(BatchspecError, match=message) as err:
        build_engine(target("mamba2"), SpecConfig(method=method), draft_model=drafter("mamba2", "attention"))
    assert "\n" not in str(err.value)


def test_a_stateful_drafter_alone_also_routes_to_the_stateful_layout():
    """An attention target with a Mamba2 drafter: the drafter keeps states, the target cursors."""
    llama = tiny_model("llama", vocab_size=VOCAB_SIZE, seed=3)
    prompts = random_prompts(4, [2, 9, 5, 13], seed=2)
    engine = build_engine(llama, SpecConfig(speculation="fixed", method="ragged", num_draft_tokens=3, batch_size=3, check_invariants=True),
                          draft_model=target("mamba2"))
    outputs = engine.generate(prompts, SamplingParams(max_new_tokens=10))
    assert type(engine.rows.home) is RaggedLayout and isinstance(engine.rows.drafter.layout, StatefulLayout)
    for p, seq in zip(prompts, outputs):
        assert seq.generated == greedy_decode(llama, p, 10)
    with pytest.raises(BatchspecError, match="method eqspec cannot decode mamba2"):
        build_engine(llama, SpecConfig(method="eqspec"), draft_model=target("mamba2"))
    with pytest.raises(BatchspecError, match="naive-state .* needs a target with recurrent state"):
        build_engine(llama, SpecConfig(method="naive-state"), draft_model=target("mamba2"))


def _tiny(config) -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


SMALL = dict(vocab_size=VOCAB_SIZE, hidden_size=32, num_hidden_layers=2, pad_token_id=None)


@pytest.mark.parametrize("make, message", [
    (lambda: _tiny(MambaConfig(state_size=4, **SMALL)), "mamba: multi-token cached forwards restart the SSM scan"),
    (lambda: _tiny(JambaConfig(intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, attn_layer_period=2,
                               attn_layer_offset=1, num_experts=1, mamba_d_state=4, **SMALL)),
     "jamba: its Mamba layers' multi-token cached forwards restart"),
    (lambda: _tiny(NemotronHConfig(layers_block_type=["mamba", "attention"], num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=8, intermediate_size=64, ssm_state_size=8,
                                   mamba_num_heads=4, mamba_head_dim=8, n_groups=1, **SMALL)),
     "nemotron_h: its Mamba2 layers clamp dt at time_step_min in multi-token forwards but not"),
    (lambda: _tiny(MiniMaxConfig(intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                 num_local_experts=2, num_experts_per_tok=1, **SMALL)),
     "minimax: models with recurrent state are supported for mamba2, qwen3_next, .*, lfm2 only"),
])
def test_unsupported_stateful_architectures_are_refused(make, message):
    model = make()
    assert is_stateful(model)
    with pytest.raises(BatchspecError, match=message) as err:
        check_supported(model)
    assert "\n" not in str(err.value)
    with pytest.raises(BatchspecError, match=message):
        build_engine(model, SpecConfig(method="ragged"), draft_model=drafter("mamba2", "attention"))


def test_clamped_time_steps_are_refused():
    """transformers 5.24 clamps dt by time_step_limit in multi-token forwards only: such a Mamba2
    would verify differently from how it decodes."""
    model = tiny_stateful_model("mamba2", vocab_size=VOCAB_SIZE)
    clamped = perturbed_copy(model, 0.0, seed=0)
    for module in clamped.modules():
        if hasattr(module, "time_step_limit"):
            module.time_step_limit = (0.001, float("inf"))
    with pytest.raises(BatchspecError, match=r"mamba2: time_step_limit \(0.001, inf\) is applied by multi-token"):
        check_supported(clamped)


# ---- the command line ----------------------------------------------------------------------------------


def test_cli_generate_on_a_saved_mamba2_is_exact(tmp_path, capsys):
    tok = tiny_tokenizer()
    folders = {}
    for name, model in (("target", target("mamba2")), ("draft", drafter("mamba2", "attention"))):
        folders[name] = tmp_path / name
        model.generation_config.eos_token_id = 1
        model.save_pretrained(folders[name])
        tok.save_pretrained(folders[name])
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"id": str(i), "prompt": text}) for i, text in enumerate(
        ["the water is long", "call him now and then", "write the number", "a"])) + "\n")
    out = tmp_path / "out.jsonl"
    code = main(["generate", "--prompts", str(prompts), "--target", str(folders["target"]), "--draft",
                 str(folders["draft"]), "--method", "ragged", "--batch-size", "2", "--max-new-tokens", "10",
                 "--output", str(out), "--verify"])
    assert code == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["exact_match"] == "4/4" and summary["errors"] == 0
    assert all(1 <= len(json.loads(line)["token_ids"]) <= 10 for line in out.read_text().splitlines())


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("drafter_kind, draft_kind, layout", [
    ("hybrid", "stateful", StatefulLayout), ("model", "attention", ReplayStatefulLayout), ("ngram", None, StatefulLayout),
], ids=["hybrid-snapshot", "adaptive-replay", "ngram-snapshot"])
def test_adaptive_speculation_and_prompt_lookup_keep_states_exact(arch, drafter_kind, draft_kind, layout):
    """Plain steps between speculative rounds (the drafter's state catches up), rows verifying
    different numbers of drafts (padding fed, never committed) and n-gram drafts keep every row exact."""
    from tinyworld import ScriptedCosts

    prompts = [p * 3 if i % 2 == 0 else p for i, p in enumerate(random_prompts(4, [3, 7, 1, 5], seed=5))]
    params = SamplingParams(max_new_tokens=14)
    spec = SpecConfig(method="ragged", num_draft_tokens=4, batch_size=3, speculation="adaptive", drafter=drafter_kind,
                      ngram_min=1, ngram_max=3, check_invariants=True)
    engine = build_engine(target(arch), spec, draft_model=drafter(arch, draft_kind or "stateful"),
                          costs=ScriptedCosts(1.0, 0.1, 0.2), layout=stateful_layouts(layout))
    outputs = engine.generate(prompts, params)
    assert_exact(arch, prompts, outputs, params)
    assert any(0 in s.chosen_k for s in outputs)


def test_adaptive_speculation_calibrates_its_costs_on_a_stateful_target(tmp_path, monkeypatch, capfd):
    """Without injected costs the engine measures them, through the layout a stateful target runs on
    (the ragged layout cannot hold recurrent state), and still decodes exactly."""
    from batchspec import costs as costs_module

    monkeypatch.setattr(costs_module, "costs_dir", lambda: tmp_path)
    monkeypatch.setattr(costs_module, "_MEMO", {})
    prompts = random_prompts(3, [4, 9, 2], seed=8)
    params = SamplingParams(max_new_tokens=10)
    spec = SpecConfig(method="ragged", num_draft_tokens=3, batch_size=2, speculation="adaptive")
    engine = build_engine(target("mamba2"), spec, (), draft_model=drafter("mamba2", "stateful"))
    assert_exact("mamba2", prompts, engine.generate(prompts, params), params)
    err = capfd.readouterr().err  # target and drafter timings measured, cached if they checked out
    assert "target Mamba2ForCausalLM" in err and "drafter Mamba2ForCausalLM" in err
    assert len(list(tmp_path.glob("*.json"))) == err.count("cached in")
