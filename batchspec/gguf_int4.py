"""The bundled target's int4 weights taken from its GGUF file's own Q4_K blocks, not re-quantized.

A Q4_K super-block holds 256 weights of one output row: fp16 `d` and `dmin`, eight 6-bit scales
`sc[j]` and mins `m[j]` (one pair per sub-block of 32 weights) and 4-bit values `q` in [0, 15]; llama.cpp
reads weight `d * sc[j] * q - dmin * m[j]`. torch's int4 kernels (`aten._weight_int4pack_mm_for_cpu`,
groups of 32 inputs along K) read `(q - 8) * scale + zero`. So with

    scale = d * sc[j],    zero = 8 * d * sc[j] - dmin * m[j]

every Q4_K sub-block is one torch int4 group of 32 with the very same 4-bit values. `d * sc` is exact
in float32 (an 11-bit by 6-bit product); `zero` is one float32 rounding away from the exact value,
which could move a dequantized weight by an ulp but moved none of the real target's 1.11e9 (with
float32 scales the weights equal gguf's dequantization bit for bit; tests/test_gguf_int4.py checks
it). The fast kernel reads scale and zero in bfloat16 (what it takes with bfloat16 activations),
which rounds them to 8 significant bits: 1.9e-3 relative error over the real target's Q4_K weights,
the only loss against the GGUF's values.

`batchspec prepare` (and the first `--quantization int4` load of the bundled target) writes those
values once into the cache, CPU-independent: per linear `qweight` (uint8 [N, K/2], value of input
column 2i in the low nibble and 2i+1 in the high one), `scales` and `zeros` (float32 [N, K/32]);
they are packed for this CPU's kernel at every load (`_convert_weight_to_int4pack_for_cpu`, whose
layout depends on the CPU, so a packed tensor is never stored). Linears stored in other GGUF types
(Q6_K, Q8_0, Q5_0, F16, ...) and the output layer are int8 per output channel, quantized at load from
the dequantized float32 weights of the converted folder (which are the GGUF's values, dequantized by
`gguf` itself): Q6_K -> int4 measured 7.9e-2 relative error (issue 28's probe), too lossy; Q6_K ->
int8 1.2e-2.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .bundled import BUNDLED, BundledModel, cache_dir, join_chunks, short_reason
from .errors import BatchspecError
from .kernels import (
    INT4,
    INT8,
    LinearLoader,
    QuantizedLinear,
    apply_quantization,
    quantization_unsupported_reason,
    replace_linears,
)

GROUP = 32  # a Q4_K sub-block: one torch int4 group
Q4K_BLOCK = 256
Q4K_BYTES = 144  # d (2) + dmin (2) + scales (12) + qs (128)
FORMAT = 1
GGUF_KERNEL = "int4-g32(gguf)"

# GGUF tensor name (llama.cpp's qwen2/llama naming) -> the Hugging Face module it becomes.
_LAYER_LINEARS = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_NAME = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.weight$")


def hf_module_name(gguf_name: str) -> str | None:
    """`blk.3.ffn_up.weight` -> `model.layers.3.mlp.up_proj`; None for anything that is not a block linear
    (embeddings, norms, biases, the output layer: the output layer is int8 under int4 anyway)."""
    match = _BLOCK_NAME.match(gguf_name)
    if match is None or match.group(2) not in _LAYER_LINEARS:
        return None
    return f"model.layers.{match.group(1)}.{_LAYER_LINEARS[match.group(2)]}"


def q4k_scale_min(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The eight 6-bit scales and mins of each block from its 12 packed bytes ([B, 12] -> [B, 8] x 2),
    ggml's `get_scale_min_k4`."""
    b = packed.astype(np.uint8).reshape(-1, 3, 4)
    d, m, m_d = b[:, 0], b[:, 1], b[:, 2]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def q4k_to_int4(blocks: np.ndarray, in_features: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K rows ([N, K/256 * 144] uint8, as `gguf.GGUFReader` gives them) -> q (uint8 [N, K], values
    0..15 unchanged), scale and zero (float32 [N, K/32]) with d*sc*q - dmin*m == (q - 8)*scale + zero."""
    n = blocks.shape[0]
    if in_features % Q4K_BLOCK or blocks.shape[1] != in_features // Q4K_BLOCK * Q4K_BYTES:
        raise BatchspecError(f"Q4_K tensor of {blocks.shape[1]} bytes per row does not hold {in_features} inputs")
    raw = np.ascontiguousarray(blocks).reshape(-1, Q4K_BYTES)  # [B, 144], B = N * K/256
    d = raw[:, 0:2].copy().view(np.float16).astype(np.float32)  # [B, 1]
    dmin = raw[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, mn = q4k_scale_min(raw[:, 4:16])  # [B, 8]
    qs = raw[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    q = (qs & np.uint8(0x0F)).reshape(n, in_features)  # sub-block 2j: low nibbles of byte chunk j, 2j+1: high
    scale = d * sc.astype(np.float32)  # exact
    zero = 8 * scale - dmin * mn.astype(np.float32)
    groups = in_features // GROUP
    return q, scale.reshape(n, groups), zero.reshape(n, groups)


def pack_nibbles(q: np.ndarray) -> np.ndarray:
    """[N, K] values 0..15 -> [N, K/2] bytes, column 2i in the low nibble (the file's layout)."""
    return (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_nibbles`: [N, K/2] uint8 -> [N, K] int32 (what torch's int4 packer takes)."""
    low, high = (packed & 0x0F).to(torch.int32), (packed >> 4).to(torch.int32)
    return torch.stack([low, high], dim=-1).reshape(packed.shape[0], -1)


def dequantize(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """torch's int4 convention, (q - 8) * scale + zero per group of 32, computed in float32 (as the
    kernel does, from bfloat16 scales and zeros when given those)."""
    n, k = q.shape
    scale, zero = scale.float(), zero.float()
    grouped = (q.reshape(n, k // GROUP, GROUP).float() - 8) * scale[..., None] + zero[..., None]
    return grouped.reshape(n, k)


def extract(gguf_path: Path, out: Path, source: dict[str, Any]) -> dict[str, int]:
    """Write the int4 form of every Q4_K block linear of `gguf_path` to `out` (safetensors; written to a
    temporary file and renamed, so `out` is absent or whole). Returns how many tensors of each GGUF type
    the block linears had (the non-Q4_K ones become int8 at load)."""
    import gguf
    from safetensors.torch import save_file

    reader = gguf.GGUFReader(str(gguf_path))
    tensors: dict[str, torch.Tensor] = {}
    types: dict[str, int] = {}
    for t in reader.tensors:
        module = hf_module_name(t.name)
        if module is None:
            continue
        kind = t.tensor_type.name
        types[kind] = types.get(kind, 0) + 1
        if t.tensor_type != gguf.GGMLQuantizationType.Q4_K:
            continue
        in_features = int(t.shape[0])  # GGUF lists ne0 (inputs) first
        q, scale, zero = q4k_to_int4(np.asarray(t.data), in_features)
        tensors[f"{module}.qweight"] = torch.from_numpy(pack_nibbles(q))
        tensors[f"{module}.scales"] = torch.from_numpy(np.ascontiguousarray(scale))
        tensors[f"{module}.zeros"] = torch.from_numpy(np.ascontiguousarray(zero))
    metadata = {"batchspec": json.dumps({**source, "format": FORMAT, "gguf_types": types}, sort_keys=True)}
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent)
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=metadata)
        os.chmod(tmp, 0o644)  # like the converted folder's files (mkstemp makes it private)
        Path(tmp).replace(out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return types


def _source(model: BundledModel) -> dict[str, Any]:
    return {"name": model.name, "sha256": model.sha256}


def stored_metadata(path: Path) -> dict[str, Any] | None:
    """The file's own record (source sha256, format, GGUF types), or None if absent or unreadable."""
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            return json.loads((f.metadata() or {}).get("batchspec", "null"))
    except Exception:
        return None


def _is_current(path: Path, model: BundledModel) -> bool:
    meta = stored_metadata(path)
    return meta is not None and meta.get("format") == FORMAT and all(meta.get(k) == v for k, v in _source(model).items())


def weights_path(model: BundledModel, root: Path | None = None) -> Path:
    """Where the int4 form of `model`'s Q4_K blocks lives in the cache."""
    root = cache_dir() if root is None else root
    return root / f"{model.name}-int4-gguf.safetensors"


def gguf_int4_weights(role: str = "target", root: Path | None = None) -> Path:
    """The int4 file of the bundled `role`, written once from its chunks (joined into a temporary
    file, ~20 s, then deleted) if missing or made from another bundle version."""
    model = BUNDLED[role]
    path = weights_path(model, root)
    if _is_current(path, model):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{model.name}-int4-", dir=path.parent))
    try:
        gguf_file = join_chunks(model, work / f"{model.name}.gguf")
        print(f"keeping the int4 blocks of {model.name} (Q4_K -> int4 g32) at {path}", file=sys.stderr)
        try:
            extract(gguf_file, path, _source(model))
        except BatchspecError:
            raise
        except Exception as exc:
            raise BatchspecError(f"reading the Q4_K blocks of bundled {model.name} failed: {short_reason(exc)}") from exc
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return path


class GGUFInt4Linear(QuantizedLinear):
    """A `QuantizedLinear` (int4, groups of 32) whose values, scales and zeros come from a GGUF's Q4_K
    blocks instead of being fitted to float weights; same kernel, same batch invariance."""

    def __init__(self, linear: torch.nn.Linear, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                 prompt_int8: bool = False) -> None:
        if tuple(q.shape) != (linear.out_features, linear.in_features):
            raise BatchspecError(f"int4 weights of shape {tuple(q.shape)} do not fit a linear "
                                 f"{linear.out_features}x{linear.in_features}")
        super().__init__(linear, INT4, GROUP, prompt_int8, int4=(q, scale, zero))

    @property
    def weights_kernel(self) -> str:
        return GGUF_KERNEL


def apply_gguf_int4(model: torch.nn.Module, path: Path, load: LinearLoader = None, prompt_int8: bool = False) -> int:
    """`--quantization int4` from the stored Q4_K blocks: each linear that has them becomes a
    `GGUFInt4Linear` (its float weight never read), every other linear (Q6_K etc. in the GGUF, the output
    layer) int8 per channel from its float weights after `load` (`kernels.apply_quantization`). Returns
    how many linears took GGUF blocks. `prompt_int8`: every linear also gets the prompt path
    (`kernels.PREFILL_INT8`)."""
    from safetensors import safe_open

    reason = quantization_unsupported_reason(model, INT4, prompt_int8)
    if reason is not None:
        raise BatchspecError(f"--quantization int4: {reason}")
    try:
        # pread, not a memory map: the map's pages would all stay resident until the file is closed
        with safe_open(str(path), framework="pt", backend="pread") as f:
            stored = {key.rsplit(".", 1)[0] for key in f.keys()}

            def from_blocks(name: str, linear: torch.nn.Linear) -> GGUFInt4Linear | None:
                if name not in stored:
                    return None
                stored.discard(name)
                if load is not None:
                    load(linear)  # its dtype and bias are the layer's
                q = unpack_nibbles(f.get_tensor(f"{name}.qweight"))
                return GGUFInt4Linear(linear, q, f.get_tensor(f"{name}.scales"), f.get_tensor(f"{name}.zeros"),
                                      prompt_int8)

            replaced = replace_linears(model, from_blocks)
    except BatchspecError:
        raise
    except Exception as exc:
        raise BatchspecError(f"could not read the int4 weights {path}: {short_reason(exc)}; "
                             f"delete it and run `batchspec prepare`") from exc
    if stored:
        raise BatchspecError(f"{path.name} holds int4 weights for {min(stored)}, which is not a linear of this model")
    apply_quantization(model, INT8, load=load, prompt_int8=prompt_int8)  # the rest: not Q4_K, and the output layer
    return replaced


def apply_bundled_int4(model: torch.nn.Module, role: str = "target", load: LinearLoader = None,
                       prompt_int8: bool = False) -> int:
    """`apply_gguf_int4` with the bundled `role`'s stored blocks, written first if missing; a model or
    machine the int4 kernel cannot run on is refused before anything is joined or written."""
    reason = quantization_unsupported_reason(model, INT4, prompt_int8)
    if reason is not None:
        raise BatchspecError(f"--quantization int4: {reason}")
    return apply_gguf_int4(model, gguf_int4_weights(role), load, prompt_int8)


def use_gguf_int4(source: str | None, role: str, quantization: str, group_size: int) -> bool:
    """Whether `load_model` takes the GGUF's int4 blocks: the bundled target under int4 with groups of 32
    (a Q4_K sub-block); a user model, or groups of 128, is quantized from its float weights."""
    return source is None and role == "target" and quantization == INT4 and group_size == GROUP


def gguf_int4_enabled() -> bool:
    """`BATCHSPEC_GGUF_INT4=0` quantizes the bundled target from float instead (for comparisons)."""
    return os.environ.get("BATCHSPEC_GGUF_INT4", "1") != "0"
