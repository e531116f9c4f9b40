"""Weight-only quantized linears (`batchspec.kernels.QuantizedLinear`): the quantization itself, the
batch invariance that exactness rests on, and end-to-end token identity with plain decoding of the
same quantized model."""

from __future__ import annotations

import argparse
import copy
import json

import pytest
import torch
from tinyworld import VOCAB_SIZE, ScriptedCosts, perturbed_copy, random_prompts, save_pair, tiny_model, torch_threads

from batchspec import kernels
from batchspec.config import BatchspecError, ModelConfig, SamplingParams, SpecConfig
from batchspec.cli import build_parser, main
from batchspec.costs import fingerprint
from batchspec.forensics.oracle import model_identity
from batchspec.kernels import (
    PackedLinear,
    QuantizedLinear,
    apply_quantization,
    pack_linears,
    quantization_kernel_reason,
    quantize_int4,
    quantize_int8,
    weight_bytes,
    weights_summary,
)
from batchspec.build import build_engine
from batchspec.models import draft_prefill_kernel, draft_quantization, load_pair
from batchspec.reference import greedy_decode

pytestmark = pytest.mark.skipif(quantization_kernel_reason("int4", torch.device("cpu")) is not None,
                                reason="torch's quantized CPU kernels do not run here")

# Shape classes: a square projection, an MLP up (wide out) and down (wide in) projection, a narrow
# K/V projection, an output layer whose row count is no multiple of 16 (int8 only).
SHAPES = [(256, 256), (512, 128), (128, 512), (32, 256), (101, 128)]
KINDS = [("int8", 32), ("int4", 32), ("int4", 128)]


def fits(kind: tuple[str, int], shape: tuple[int, int]) -> bool:
    bits, group = kind
    out_features, in_features = shape
    return bits == "int8" or (out_features % 16 == 0 and in_features % group == 0)


def layer(shape: tuple[int, int], bits: str, group: int, seed: int = 0) -> QuantizedLinear:
    torch.manual_seed(seed)
    out_features, in_features = shape
    return QuantizedLinear(torch.nn.Linear(in_features, out_features), bits, group)


def test_int8_quantization_is_per_output_channel_and_round_to_nearest():
    torch.manual_seed(0)
    w = torch.randn(24, 64)
    w[3] = 0  # an all-zero row must not divide by zero
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and scale.dtype == torch.bfloat16 and scale.shape == (24,)
    assert q.abs().max() <= 127 and torch.all(q[3] == 0)
    error = (q.float() * scale.float()[:, None] - w).abs()
    assert torch.all(error <= scale.float()[:, None] * 0.5 + 1e-6)  # within half a step, per row


@pytest.mark.parametrize("group", [32, 128])
def test_int4_quantization_is_per_group_in_torchs_convention(group):
    torch.manual_seed(0)
    w = torch.randn(16, 256)
    w[0, :group] = 0.25  # a constant group is represented exactly
    q, scale, zero = quantize_int4(w, group)
    assert q.min() >= 0 and q.max() <= 15 and scale.shape == zero.shape == (16, 256 // group)
    dequantized = (q.float().reshape(16, -1, group) - 8) * scale.float()[..., None] + zero.float()[..., None]
    error = (dequantized.reshape(16, 256) - w).abs()
    step = scale.float().repeat_interleave(group, dim=1)
    assert torch.all(error <= step * 0.5 + 2e-2 * w.abs().amax())  # half a step, plus bf16 rounding of zero
    assert torch.all(dequantized.reshape(16, 256)[0, :group] == 0.25)


@pytest.mark.parametrize("bits, group", KINDS)
def test_quantized_linear_computes_the_dequantized_product(bits, group):
    """The kernel's output is x (in bfloat16) times the dequantized weight, plus the bias."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 64)
    quantized = QuantizedLinear(linear, bits, group)
    if bits == "int8":
        q, scale = quantize_int8(linear.weight)
        weight = q.float() * scale.float()[:, None]
    else:
        q, scale, zero = quantize_int4(linear.weight, group)
        weight = ((q.float().reshape(64, -1, group) - 8) * scale.float()[..., None] + zero.float()[..., None])
        weight = weight.reshape(64, 256)
    x = torch.randn(2, 3, 256)
    with torch.no_grad():
        expected = x.to(torch.bfloat16).float() @ weight.T + linear.bias
        out = quantized(x)
    assert out.shape == (2, 3, 64) and out.dtype == torch.float32
    torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())
    with torch.no_grad():
        reference = linear(x)
    assert (out - reference).abs().max() < 0.1 * reference.abs().max()  # close to the float layer


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("bits, group", KINDS)
@pytest.mark.parametrize("shape", SHAPES)
def test_a_rows_output_does_not_depend_on_the_other_rows(shape, bits, group, threads):
    """Exactness rests on this: a row computed alone (M = 1) equals, bit for bit, the same row inside a
    forward of M = 2..64 rows, whatever the other rows hold (random, scaled x100), at 1 and 2 threads."""
    if not fits((bits, group), shape):
        pytest.skip("shape the kernel cannot take (stays float)")
    quantized = layer(shape, bits, group)
    generator = torch.Generator().manual_seed(1)
    rows = torch.randn(64, shape[1], generator=generator)
    with torch_threads(threads), torch.no_grad():
        alone = torch.cat([quantized(rows[i:i + 1]) for i in range(8)])
        for m in [2, 3, 4, 5, 7, 8, 12, 16, 17, 31, 32, 48, 64]:
            others = torch.randn(m, shape[1], generator=generator) * 100
            batch = torch.cat([rows[:1], others[1:]])
            assert torch.equal(quantized(batch)[:1], alone[:1]), f"row 0 changed inside {m} rows"
            mixed = rows[:min(m, 8)]
            assert torch.equal(quantized(mixed), alone[:min(m, 8)]), f"rows changed together at {m}"
        tokens = quantized(rows[:12].reshape(3, 4, shape[1]))  # [batch, tokens, features]
        assert torch.equal(tokens.reshape(12, -1)[:8], alone)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_packed_float32_rows_output_does_not_depend_on_the_other_rows_at_two_threads(threads):
    """The same property for the float layers left beside quantized ones (issue 33: at 2 threads too)."""
    torch.manual_seed(0)
    packed = PackedLinear(torch.nn.Linear(256, 512))
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(64, 256, generator=generator)
    with torch_threads(threads), torch.no_grad():
        alone = packed(x[:1])
        for m in [2, 3, 4, 8, 16, 33, 64]:
            assert torch.equal(packed(torch.cat([x[:1], x[1:m] * 100]))[:1], alone), m


def test_quantizing_a_model_replaces_what_fits_and_leaves_the_rest_in_float():
    model = tiny_model("qwen2", vocab_size=VOCAB_SIZE)  # hidden 64: int4 g32 fits, g128 does not
    float_bytes = weight_bytes(model)
    apply_quantization(model, "int4", 32)
    assert weights_summary(model) == "int4-g32 x14, int8 x1"  # 2 layers x 7 projections, head int8
    assert model.get_output_embeddings().kernel == "int8"
    assert weight_bytes(model) < 0.3 * float_bytes
    coarse = tiny_model("qwen2", vocab_size=VOCAB_SIZE)
    apply_quantization(coarse, "int4", 128)  # K = 64 or 128: only the 128-wide inputs take groups of 128
    pack_linears(coarse)
    summary = weights_summary(coarse)
    assert "int4-g128 x2" in summary and "packed-float32 x12" in summary and "int8 x1" in summary
    gpt2 = tiny_model("gpt2", vocab_size=VOCAB_SIZE)  # blocks are Conv1D, quantized as linears
    apply_quantization(gpt2, "int8")
    assert weights_summary(gpt2) == "int8 x9"  # 2 layers x (c_attn, attn c_proj, c_fc, mlp c_proj) + head


def test_bad_quantization_settings_are_one_clear_line(monkeypatch):
    model = tiny_model("llama", vocab_size=VOCAB_SIZE)
    with pytest.raises(BatchspecError, match="unknown quantization 'int3'"):
        apply_quantization(model, "int3")
    with pytest.raises(BatchspecError, match="group size must be one of 32, 128"):
        apply_quantization(model, "int4", 64)
    with pytest.raises(BatchspecError, match="unknown quantization"):
        ModelConfig(quantization="q4")
    with pytest.raises(BatchspecError, match="quantization_group_size must be one of"):
        ModelConfig(quantization_group_size=16)
    assert "CPU kernels (model is on cuda)" in quantization_kernel_reason("int4", torch.device("cuda"))
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    with pytest.raises(BatchspecError, match=r"^--quantization int8: torch's int8 kernels are vectorized for AVX2"):
        apply_quantization(model, "int8")
    monkeypatch.undo()
    monkeypatch.setitem(kernels._QUANT_OPS, "int4", ("_convert_weight_to_int4pack_for_cpu", "_int4_op_of_a_later_torch"))
    with pytest.raises(BatchspecError, match=r"lacks aten\._int4_op_of_a_later_torch$"):
        apply_quantization(model, "int4")
    assert type(model.model.layers[0].mlp.up_proj) is torch.nn.Linear  # refused before replacing anything


def test_quantized_models_refuse_a_cast_and_copy_deeply():
    model = tiny_model("llama", vocab_size=VOCAB_SIZE)
    apply_quantization(model, "int4")
    with pytest.raises(BatchspecError, match="cannot change dtype or device"):
        model.to(torch.bfloat16)
    copied = copy.deepcopy(model)
    ids = torch.tensor([random_prompts(1, [7], seed=4)[0]])
    with torch.no_grad():
        assert torch.equal(copied(ids).logits, model(ids).logits)
    state = model.state_dict()
    assert state["model.layers.0.mlp.up_proj.qweight"].dtype == torch.uint8  # packed int4, two per byte
    assert state["lm_head.qweight"].dtype == torch.int8


def test_packed_models_expose_their_weights_and_identity_sees_every_linear():
    """Issue 33: packed weights were plain attributes, so the oracle's identity hashed only embeddings
    and norms, `state_dict` lacked the linears and `deepcopy` raised."""
    model = tiny_model("qwen2", vocab_size=VOCAB_SIZE)
    reference = copy.deepcopy(model)
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.model.layers[1].mlp.down_proj.weight[0, 0] += 0.5
    for m in (model, other):
        pack_linears(m)
    assert model_identity(model) != model_identity(other)
    assert model_identity(copy.deepcopy(model)) == model_identity(model)
    state, expected = model.state_dict(), reference.state_dict()
    assert state.keys() == expected.keys()
    assert all(torch.equal(state[k], expected[k]) for k in expected)
    fresh = tiny_model("qwen2", vocab_size=VOCAB_SIZE, seed=5)
    pack_linears(fresh)
    fresh.load_state_dict(state)  # repacks the dense weights
    ids = torch.tensor([random_prompts(1, [6], seed=2)[0]])
    with torch.no_grad():
        assert torch.equal(fresh(ids).logits, model(ids).logits)
        assert torch.equal(copy.deepcopy(model)(ids).logits, model(ids).logits)
    int8, int4 = copy.deepcopy(reference), copy.deepcopy(reference)
    apply_quantization(int8, "int8")
    apply_quantization(int4, "int4")
    identities = {model_identity(m) for m in (model, int8, int4, reference)}
    assert len(identities) == 4


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("quantization", ["int8", "int4"])
@pytest.mark.parametrize("method, scheduler, speculation", [
    ("ragged", "continuous", "fixed"), ("ragged", "static", "adaptive"), ("eqspec", None, "fixed"),
    ("exspec", "pool", "fixed"), ("ragged", "continuous", "adaptive"),
])
def test_speculation_on_quantized_models_equals_plain_decoding_of_the_quantized_model(
        arch, quantization, method, scheduler, speculation):
    """Ragged, padded (eqspec), pooled (exspec) and adaptive rounds on a quantized target and a
    differently quantized drafter: each output is plain decoding of its prompt alone on the same
    quantized target, token for token."""
    target = tiny_model(arch, vocab_size=VOCAB_SIZE)
    draft = perturbed_copy(target, noise=0.02, seed=1)
    apply_quantization(target, quantization)
    apply_quantization(draft, "int4" if quantization == "int8" else "int8")
    pack_linears(target)
    pack_linears(draft)
    prompts = random_prompts(6, [1, 4, 9, 13, 20, 4], seed=3)
    spec = SpecConfig(method=method, scheduler=scheduler, speculation=speculation, num_draft_tokens=4, batch_size=3)
    engine = build_engine(target, spec, (), draft_model=draft, costs=ScriptedCosts(1.0, 0.1, 0.2))
    outputs = engine.generate(prompts, SamplingParams(max_new_tokens=14))
    for prompt, seq in zip(prompts, outputs):
        assert seq.generated == greedy_decode(target, prompt, 14), f"prompt {seq.index} diverged"
    assert sum(seq.accepted for seq in outputs) > 0  # drafts were verified and some kept


def test_loading_a_quantized_pair_and_the_drafters_default(tmp_path, monkeypatch):
    target_dir, draft_dir = save_pair(tmp_path)
    pair = load_pair(ModelConfig(str(target_dir), str(draft_dir), quantization="int8", draft_quantization="int4"))
    assert weights_summary(pair.target).startswith("int8 x")
    path = "+prefill-int8" if draft_prefill_kernel("int4", "cpu") == "int8" else ""  # a drafter's prompt path
    assert weights_summary(pair.draft).startswith(f"int4-g32{path} x")
    plain = load_pair(ModelConfig(str(target_dir), str(draft_dir)))
    assert weights_summary(plain.target) == weights_summary(plain.draft) == "packed-float32 x15"
    assert fingerprint(plain.target) != fingerprint(pair.target)  # cost tables are cached per weight format
    assert draft_quantization(ModelConfig(quantization="int8")) == "int8"  # unset: the target's
    assert draft_quantization(ModelConfig(quantization="int8", draft_quantization="none")) == "none"
    assert draft_quantization(ModelConfig(draft_quantization="auto", device="cuda")) == "none"
    auto = ModelConfig(draft_dtype="auto")  # int4 where the kernel runs and bfloat16 is not native
    monkeypatch.setattr("batchspec.models.computes_bfloat16", lambda device: False)
    assert draft_quantization(auto) == "int4"
    monkeypatch.setattr("batchspec.models.computes_bfloat16", lambda device: True)
    assert draft_quantization(auto) == "none"
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    monkeypatch.setattr("batchspec.models.computes_bfloat16", lambda device: False)
    assert draft_quantization(auto) == "none"


@pytest.mark.parametrize("command", ["generate", "bench", "serve", "audit"])
def test_every_model_loading_command_takes_the_quantization_options(command):
    """The options come from ModelConfig's fields, so each command that loads models has them, with
    ModelConfig's choices (the drafter's only where the command loads one)."""
    parser = build_parser([command])
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    options = {flag: action for action in sub._actions for flag in action.option_strings}
    if command == "bench":  # a comma-separated sweep, each name one of ModelConfig's choices
        assert options["--quantization"].type("int4,none") == ["int4", "none"]
    else:
        assert options["--quantization"].choices == ["none", "int8", "int4"]
    assert options["--quantization-group-size"].choices == [32, 128]
    if command != "audit":
        assert options["--draft-quantization"].choices == ["none", "int8", "int4", "auto"]


def test_bench_sweeps_quantizations_in_one_run(tiny_pair_dirs, tmp_path, capsys):
    """`bench --quantization none,int4`: the bench once per target format, each exact against plain
    decoding of its own target, each with its own report naming the weights."""
    target, draft = tiny_pair_dirs
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": text}) + "\n" for text in ["the a of", "to and in is it you"]))
    report = tmp_path / "report.json"
    assert main(["bench", "--target", str(target), "--draft", str(draft), "--prompts", str(prompts),
                 "--methods", "ar@1,ragged@2", "--max-new-tokens", "6", "-k", "3", "--quantization", "none,int4",
                 "--draft-quantization", "int8", "--json", str(report)]) == 0
    out = capsys.readouterr().out
    assert "=== --quantization none ===" in out and "=== --quantization int4 ===" in out
    assert "target float32: packed-float32 x15" in out and "target float32: int4-g32 x14, int8 x1" in out
    assert "peak RSS" in out and "GiB since --quantization int4 began loading" in out
    for quantization, head in (("none", "packed-float32 x15"), ("int4", "int4-g32 x14, int8 x1")):
        data = json.loads((tmp_path / f"report.{quantization}.json").read_text())
        assert data["settings"]["weights"]["target"].startswith(f"float32: {head}")
        # a drafter's prompt path, on all but its output layer
        drafter = "int8+prefill-int8 x14, int8 x1" if draft_prefill_kernel("int8", "cpu") == "int8" else "int8 x15"
        assert data["settings"]["weights"]["draft"].startswith(f"float32: {drafter}")
        assert data["settings"]["peak_rss_bytes"] > 0
        assert all(m["error"] is None and m["exact_matches"] == m["prompts"] for m in data["methods"]), data["methods"]
    assert main(["bench", "--prompts", str(prompts), "--quantization", "none,int5"]) != 0
    assert "--quantization: choose from none, int8, int4, comma-separated, got 'none,int5'" in capsys.readouterr().err
