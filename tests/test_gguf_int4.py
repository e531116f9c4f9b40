"""The bundled target's int4 weights from its GGUF's own Q4_K blocks (`batchspec.gguf_int4`): the
mapping onto torch's int4 g32 convention against gguf's own dequantization, the kernel's reading of
it, and `prepare` + `load_model` on a tiny qwen2 GGUF whose linears are hand-built Q4_K blocks
(gguf's Python package cannot quantize to Q4_K)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch
from test_models import PREFIX, make_chunk_packages, write_gguf
from tinyworld import tiny_model

from batchspec import bundled
from batchspec.bundled import BundledModel, converted_dir
from batchspec.gguf_int4 import (
    GGUF_KERNEL,
    GGUFInt4Linear,
    apply_gguf_int4,
    dequantize,
    extract,
    gguf_int4_weights,
    hf_module_name,
    pack_nibbles,
    q4k_to_int4,
    stored_metadata,
    unpack_nibbles,
    use_gguf_int4,
)
from batchspec.kernels import main_kernel, quantization_kernel_reason, weights_summary
from batchspec.models import load_model
from batchspec.reference import greedy_decode

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(quantization_kernel_reason("int4", torch.device("cpu")) is not None,
                                reason="torch's int4 CPU kernel does not run here")


def random_q4k(rows: int, cols: int, seed: int) -> np.ndarray:
    """Q4_K rows of random but valid blocks ([rows, cols/256 * 144] uint8): positive fp16 d and dmin,
    random 6-bit scales and mins, random 4-bit values."""
    rng = np.random.default_rng(seed)
    blocks = rows * cols // 256
    d = rng.uniform(2e-4, 2e-3, blocks).astype(np.float16).view(np.uint8).reshape(blocks, 2)
    dmin = rng.uniform(1e-4, 1e-3, blocks).astype(np.float16).view(np.uint8).reshape(blocks, 2)
    rest = rng.integers(0, 256, (blocks, 140), dtype=np.uint8)  # 12 scale bytes + 128 value bytes
    return np.concatenate([d, dmin, rest], axis=1).reshape(rows, cols // 256 * 144)


def test_q4k_blocks_map_onto_torchs_int4_g32_bit_for_bit_with_float32_scales():
    blocks = random_q4k(48, 512, seed=0)
    q, scale, zero = q4k_to_int4(blocks, 512)
    assert q.shape == (48, 512) and q.dtype == np.uint8 and q.max() <= 15
    assert scale.shape == zero.shape == (48, 16)
    expected = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q4_K)  # [48, 512] float32
    ours = dequantize(torch.from_numpy(q), torch.from_numpy(scale), torch.from_numpy(zero)).numpy()
    np.testing.assert_array_equal(ours, expected)  # (q - 8) * scale + zero == d*sc*q - dmin*m, every bit
    assert torch.equal(unpack_nibbles(torch.from_numpy(pack_nibbles(q))), torch.from_numpy(q).to(torch.int32))


def test_the_kernel_reads_q_scale_and_zero_in_torchs_convention_from_bfloat16_scales():
    """One-hot inputs read the kernel's weights back: exactly (q - 8) * bf16(scale) + bf16(zero) in
    float32, rounded to bfloat16 on output. Against gguf's values that costs ~2e-3 relative."""
    blocks = random_q4k(32, 256, seed=1)
    q, scale, zero = map(torch.from_numpy, q4k_to_int4(blocks, 256))
    layer = GGUFInt4Linear(torch.nn.Linear(256, 32, bias=False), q, scale, zero)
    with torch.no_grad():
        read = layer(torch.eye(256)).T  # [32, 256]
    with_bf16_scales = dequantize(q, scale.to(torch.bfloat16), zero.to(torch.bfloat16))
    assert torch.equal(read, with_bf16_scales.to(torch.bfloat16).float())
    exact = torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q4_K))
    assert (torch.linalg.norm(read - exact) / torch.linalg.norm(exact)).item() < 1e-2
    assert layer.kernel == GGUF_KERNEL


def test_gguf_names_map_to_the_block_linears_only():
    assert hf_module_name("blk.12.ffn_down.weight") == "model.layers.12.mlp.down_proj"
    assert hf_module_name("blk.0.attn_output.weight") == "model.layers.0.self_attn.o_proj"
    assert hf_module_name("blk.0.attn_q.bias") is None
    assert hf_module_name("output.weight") is None and hf_module_name("token_embd.weight") is None
    assert use_gguf_int4(None, "target", "int4", 32)
    assert not use_gguf_int4("/some/model", "target", "int4", 32)  # a user model: from its float weights
    assert not use_gguf_int4(None, "target", "int4", 128)  # Q4_K's sub-blocks are groups of 32
    assert not use_gguf_int4(None, "draft", "int4", 32) and not use_gguf_int4(None, "target", "int8", 32)


Q4K_LINEARS = ("q_proj", "k_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # v_proj: Q8_0


def write_q4k_gguf(path: Path, model: torch.nn.Module) -> dict[str, np.ndarray]:
    """A tiny qwen2 GGUF whose block linears are random Q4_K blocks (v_proj Q8_0, the rest F32); the
    float model gets the dequantized values, as a real conversion would. Returns the Q4_K rows by module."""
    import gguf

    q4k: dict[str, np.ndarray] = {}

    def encode(index: int, name: str, tensor: torch.Tensor) -> tuple:
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module.rsplit(".", 1)[-1] in Q4K_LINEARS:
            rows, cols = tensor.shape
            blocks = q4k[module] = random_q4k(rows, cols, seed=index)
            kind = gguf.GGMLQuantizationType.Q4_K
        elif name.endswith("v_proj.weight"):
            kind = gguf.GGMLQuantizationType.Q8_0
            blocks = gguf.quants.quantize(tensor.numpy(), kind)
        else:
            return tensor.numpy().astype(np.float32), None
        tensor.copy_(torch.from_numpy(gguf.quants.dequantize(blocks, kind)))
        return blocks, kind

    write_gguf(path, model, encode)
    return q4k


@pytest.fixture
def tiny_q4k_bundle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The bundled target replaced by a tiny Q4_K qwen2 GGUF in fake chunk packages, cache in tmp."""
    model = tiny_model("qwen2", seed=7, hidden=256)  # K-quant blocks need inputs in multiples of 256
    q4k = write_q4k_gguf(tmp_path / "tiny.gguf", model)
    data = (tmp_path / "tiny.gguf").read_bytes()
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    half = len(data) // 2
    make_chunk_packages(root, [data[:half], data[half:]])
    spec = BundledModel("tiny-q4k", PREFIX, 2, len(data), hashlib.sha256(data).hexdigest(), "1", ("</s>",))
    monkeypatch.setitem(bundled.BUNDLED, "target", spec)
    monkeypatch.setenv("BATCHSPEC_CACHE", str(tmp_path / "cache"))
    return model, q4k, spec


def test_prepare_keeps_the_q4k_blocks_and_int4_loads_them(tiny_q4k_bundle, tmp_path):
    model, q4k, spec = tiny_q4k_bundle
    converted_dir(spec)  # what `batchspec prepare` does first: the float32 folder
    path = gguf_int4_weights("target")
    meta = stored_metadata(path)
    assert meta["sha256"] == spec.sha256 and meta["gguf_types"] == {"Q4_K": 12, "Q8_0": 2}
    assert gguf_int4_weights("target") == path  # kept: not joined or extracted again
    mtime = path.stat().st_mtime_ns
    assert gguf_int4_weights("target").stat().st_mtime_ns == mtime

    loaded, _ = load_model(None, role="target", quantization="int4")
    assert weights_summary(loaded) == f"{GGUF_KERNEL} x12, int8 x3"  # v_proj (Q8_0) and the output layer
    modules = dict(loaded.named_modules())
    for name, blocks in q4k.items():
        layer = modules[name]
        assert isinstance(layer, GGUFInt4Linear)
        with torch.no_grad():
            read = layer(torch.eye(layer.in_features)).T
        q, scale, zero = map(torch.from_numpy, q4k_to_int4(blocks, layer.in_features))
        expected = dequantize(q, scale.to(torch.bfloat16), zero.to(torch.bfloat16)).to(torch.bfloat16).float()
        assert torch.equal(read, expected), name  # the GGUF's values, read through bfloat16 scales

    # a user model (the same GGUF passed as a file) is quantized from its float weights instead
    user, _ = load_model(str(tmp_path / "tiny.gguf"), quantization="int4")
    assert weights_summary(user) == "int4-g32 x14, int8 x1"
    assert main_kernel(user) == "int4-g32"  # what the bench's title names
    prompt = [0, 5, 9, 17, 40]
    assert len(greedy_decode(loaded, prompt, 6)) == 6


def test_a_file_from_another_bundle_is_rebuilt_and_a_broken_one_is_one_line(tiny_q4k_bundle, tmp_path):
    model, q4k, spec = tiny_q4k_bundle
    path = gguf_int4_weights("target")
    extract(tmp_path / "tiny.gguf", path, {"name": spec.name, "sha256": "0" * 64})  # stale source
    assert stored_metadata(path)["sha256"] == "0" * 64
    assert stored_metadata(gguf_int4_weights("target"))["sha256"] == spec.sha256
    from batchspec.config import BatchspecError

    bad = tmp_path / "broken.safetensors"
    bad.write_bytes(b"not a safetensors file")
    with pytest.raises(BatchspecError, match="could not read the int4 weights"):
        apply_gguf_int4(tiny_model("qwen2", hidden=256), bad)


def test_a_machine_without_the_kernel_is_refused_before_anything_is_written(tiny_q4k_bundle, tmp_path, monkeypatch):
    from batchspec.config import BatchspecError
    from batchspec.gguf_int4 import weights_path

    _, _, spec = tiny_q4k_bundle
    converted_dir(spec)
    monkeypatch.setattr("batchspec.gguf_int4.quantization_unsupported_reason", lambda model, bits, prompt_int8=False: "no int4 kernel here")
    with pytest.raises(BatchspecError, match="^--quantization int4: no int4 kernel here$"):
        load_model(None, role="target", quantization="int4")
    assert not weights_path(spec).exists()
    monkeypatch.undo()  # BATCHSPEC_GGUF_INT4=0: the bundled target quantized from its float32 folder
    monkeypatch.setitem(bundled.BUNDLED, "target", spec)
    monkeypatch.setenv("BATCHSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("BATCHSPEC_GGUF_INT4", "0")
    loaded, _ = load_model(None, role="target", quantization="int4")
    assert weights_summary(loaded) == "int4-g32 x14, int8 x1" and not weights_path(spec).exists()
