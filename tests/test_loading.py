"""Loading a model a tensor at a time (`models.load_model`): the loaded and quantized model is bit for
bit what transformers' `from_pretrained` followed by the quantizing and packing passes gives, while
no converted copy of all the linears and no page of the checkpoint-wide map outlives its use."""

from __future__ import annotations

import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
from tinyworld import VOCAB_SIZE, tiny_model, tiny_tokenizer
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from batchspec import kernels, models
from batchspec.kernels import (
    QuantizedLinear,
    apply_linear_kernel,
    apply_quantization,
    quantization_kernel_reason,
    quantize_int4,
    quantize_int8,
    replace_linears,
)
from batchspec.kv import use_exact_attention
from batchspec.memory import peak_rss_bytes, reset_peak_rss, return_freed_memory
from batchspec.models import load_model

QUANTIZED = quantization_kernel_reason("int4", torch.device("cpu")) is None
needs_kernels = pytest.mark.skipif(not QUANTIZED, reason="torch's quantized CPU kernels do not run here")
needs_maps = pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc/self/maps")


def save(folder: Path, arch: str, tied: bool, stored: torch.dtype = torch.float32) -> Path:
    """A tiny model (hidden 128: int4 groups of 32 and 128 fit) and its tokenizer as an HF folder."""
    model = tiny_model(arch, vocab_size=VOCAB_SIZE, seed=5, hidden=128)
    if tied:
        model.config.tie_word_embeddings = True
        model.lm_head.weight = model.model.embed_tokens.weight
    model.to(stored).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def reference(folder: Path, dtype: torch.dtype, quantization: str, group_size: int = 32) -> torch.nn.Module:
    """The loading path before streaming: transformers' model in `dtype`, then the passes."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=True).eval()
    apply_quantization(model, quantization, group_size)
    apply_linear_kernel(model, "auto")
    use_exact_attention(model)
    return model


def assert_identical(loaded: torch.nn.Module, expected: torch.nn.Module) -> None:
    """Every tensor (quantized values, scales, zeros, packed weights read back dense, buffers that the
    state dict leaves out), the config's dtype and the logits, bit for bit."""
    assert loaded.config.dtype == expected.config.dtype
    state, want = loaded.state_dict(), expected.state_dict()
    assert state.keys() == want.keys()
    for name, tensor in want.items():
        assert state[name].dtype == tensor.dtype and torch.equal(state[name], tensor), name
    buffers = {name: b.to_dense() if b.is_mkldnn else b for name, b in loaded.named_buffers()}
    for name, tensor in expected.named_buffers():
        tensor = tensor.to_dense() if tensor.is_mkldnn else tensor
        assert buffers[name].dtype == tensor.dtype and torch.equal(buffers[name], tensor), name
    ids = torch.tensor([[3, 5, 9, 17, 40, 2], [7, 7, 8, 30, 11, 4]])
    with torch.inference_mode():
        assert torch.equal(loaded(ids).logits, expected(ids).logits)


@pytest.mark.parametrize("arch, tied", [("llama", False), ("qwen2", False), ("qwen2", True)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
def test_loading_gives_transformers_model_quantized_bit_for_bit(tmp_path, monkeypatch, arch, tied, dtype,
                                                                quantization):
    if quantization != "none" and not QUANTIZED:
        pytest.skip("torch's quantized CPU kernels do not run here")
    folder = save(tmp_path, arch, tied)
    monkeypatch.setattr(models, "_MAP_APART_BYTES", 0)  # tiny tensors take the large tensors' path
    monkeypatch.setattr(models, "_READ_BLOCK_VALUES", 1000)  # conversions read in several blocks
    loaded, _ = load_model(str(folder), dtype=dtype, quantization=quantization)
    assert_identical(loaded, reference(folder, models.parse_dtype(dtype), quantization))


@needs_kernels
def test_a_bfloat16_file_loads_as_float32_bit_for_bit(tmp_path, monkeypatch):
    folder = save(tmp_path, "llama", tied=False, stored=torch.bfloat16)
    monkeypatch.setattr(models, "_MAP_APART_BYTES", 0)
    loaded, _ = load_model(str(folder), quantization="int4")
    assert next(loaded.parameters()).dtype == torch.float32
    assert_identical(loaded, reference(folder, torch.float32, "int4"))


def test_modules_kept_in_float32_are_left_to_transformers_conversion(tmp_path, monkeypatch):
    """A model class that keeps some modules in float32 under bfloat16 is converted by transformers
    itself (casting every tensor would miss them). (Llama's forward does not run so: not called.)"""
    folder = save(tmp_path, "llama", tied=False)
    monkeypatch.setattr(LlamaForCausalLM, "_keep_in_fp32_modules_strict", ["lm_head"])
    loaded, _ = load_model(str(folder), dtype="bfloat16", linear_kernel="torch")
    assert loaded.lm_head.weight.dtype == torch.float32 and loaded.model.norm.weight.dtype == torch.bfloat16
    expected = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, local_files_only=True)
    state = loaded.state_dict()
    for name, tensor in expected.state_dict().items():
        assert state[name].dtype == tensor.dtype and torch.equal(state[name], tensor), name


@needs_maps
@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_only_the_embedding_stays_mapped_and_only_its_own_bytes(tmp_path, monkeypatch, quantization):
    """After loading, the checkpoint-wide map is gone; the embedding table alone maps its own bytes
    (a lookup reads one row per token), everything else owns its memory."""
    if quantization != "none" and not QUANTIZED:
        pytest.skip("torch's quantized CPU kernels do not run here")
    folder = save(tmp_path, "qwen2", tied=False)
    monkeypatch.setattr(models, "_MAP_APART_BYTES", 0)
    loaded, _ = load_model(str(folder), quantization=quantization)
    checkpoint = str(folder / "model.safetensors")
    mapped = [m for m in models._mapped_files() if m.path == checkpoint]
    table = loaded.get_input_embeddings().weight
    table_bytes = table.numel() * table.element_size()
    assert len(mapped) == 1 and mapped[0].hi - mapped[0].lo <= table_bytes + 2 * 4096
    assert models._mapping_of(table, mapped) is not None
    others = [t for t in [*loaded.parameters(), *loaded.buffers()] if t is not table]
    assert not any(models._mapping_of(t, mapped) for t in others)


@needs_maps
def test_an_embedding_that_a_float_linear_reads_is_copied(tmp_path, monkeypatch):
    """A tied output layer left in float reads the whole table every step: mapping it saves nothing."""
    folder = save(tmp_path, "qwen2", tied=True)
    monkeypatch.setattr(models, "_MAP_APART_BYTES", 0)
    load_model(str(folder), linear_kernel="torch")
    assert not [m for m in models._mapped_files() if m.path == str(folder / "model.safetensors")]


def test_replacing_linears_releases_each_one_before_the_next():
    """The float weight of a replaced linear is freed before the next linear is read (a mapped one
    keeps its pages resident while it lives)."""
    model = tiny_model("llama", seed=1)
    replaced: list[weakref.ref] = []

    def make(name: str, linear: torch.nn.Linear) -> torch.nn.Module:
        assert all(ref() is None for ref in replaced), f"a replaced weight outlived its layer at {name}"
        replaced.append(weakref.ref(linear.weight))
        return torch.nn.Identity()

    assert replace_linears(model, make) == 15  # 2 layers x 7, and the head
    assert not any(type(m) is torch.nn.Linear for m in model.modules())


@needs_kernels
def test_quantizing_in_row_blocks_gives_the_same_bits(monkeypatch):
    torch.manual_seed(0)
    weight = torch.randn(300, 256) * torch.rand(300, 1) * 4
    weight[7] = 0  # an all-zero row: scale 0
    whole8, whole4 = quantize_int8(weight), quantize_int4(weight, 32)
    monkeypatch.setattr(kernels, "QUANTIZE_BLOCK_VALUES", 256 * 7)  # 7 rows a block, the last one short
    for got, want in zip([*quantize_int8(weight), *quantize_int4(weight, 32)], [*whole8, *whole4]):
        assert got.dtype == want.dtype and torch.equal(got, want)
    layer = QuantizedLinear(torch.nn.Linear(256, 300), "int8")
    assert layer.qweight.shape == (300, 256)


@pytest.mark.real
def test_the_bundled_int4_pair_loads_within_3_gb():
    """Issue 28's memory target, in a fresh process: loading the bundled pair as `make run` does (int4
    target from the GGUF's blocks, the drafter under --draft-dtype auto) peaks at 3 GB RSS or less,
    and one forward of each model after it stays there."""
    from batchspec.bundled import bundled_installed

    if not (bundled_installed("target") and bundled_installed("draft")):
        pytest.skip("bundled model pair not installed (run `make setup`)")
    code = """
import resource, torch
from batchspec.config import ModelConfig
from batchspec.models import load_pair
pair = load_pair(ModelConfig(quantization="int4", draft_dtype="auto"))
with torch.inference_mode():
    for model in (pair.target, pair.draft):
        model(torch.tensor([[1, 2, 3, 4]]), use_cache=False)
rss = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS"))
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, rss * 1024)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-2000:]
    peak, steady = map(int, done.stdout.split()[-2:])
    assert steady <= peak <= 3e9, f"peak {peak / 1e9:.2f} GB, steady {steady / 1e9:.2f} GB"


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs /proc/self/clear_refs")
def test_the_peak_rss_restarts_for_each_format_of_a_sweep():
    """`bench --quantization none,int4` reports each format's own peak, not the float32 one before it."""
    assert reset_peak_rss()
    block = torch.ones(2**26)  # 256 MiB, every page written
    grown = peak_rss_bytes()
    del block
    return_freed_memory()
    assert reset_peak_rss()
    assert peak_rss_bytes() < grown - 200 * 2**20
