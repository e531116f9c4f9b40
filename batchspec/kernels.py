"""Linear layers on CPU with weights packed once for oneDNN, instead of per call.

Why: with torch's default CPU linear (MKL) one token per row is a matrix-vector product read at
memory speed, but from two tokens on each call costs 2-3x as much (as far as we can tell the weight
is packed for a matrix-matrix product on every call), so verifying drafts cost about two plain steps
and speculation lost on CPUs. oneDNN with the weights reordered once at load costs about the same
for 1 to 16 rows: plain decoding gets faster too, and verifying K + 1 tokens costs about one plain
step (the timings: docs/cli.md, `--linear-kernel`).

Every torch-private call lives here (`torch.ops.mkldnn._reorder_linear_weight` and
`_linear_pointwise`, the ops Inductor's CPU backend uses for frozen linears); `linear_kernel`
tells the cost model's cache which kernels a timing was made with. The packed layer computes the
same product as `nn.Linear` up to float rounding (the accumulation order differs), so the engine,
the plain-decoding baseline and the audit's oracle all use the model as loaded, packed or not.

Weight-only quantized linears (`QuantizedLinear`, `apply_quantization`: int8 per output channel,
int4 in groups of 32 or 128) run torch's own CPU kernels (`aten._weight_int8pack_mm`,
`aten._weight_int4pack_mm_for_cpu`), with bfloat16 activations (their float32 path is scalar, 5-20x
slower). Why these and no other path: a row's output must not depend on the other rows of its
forward (docs/quantization.md has the measurements), and a forward of 1 to 64 rows takes the same
kernel. Dequantizing a weight per call for the float32 kernel costs more than the quantized product
of 64 rows (docs/quantization.md), so no shape is routed elsewhere. What may differ is a token's
role: under `--prefill-kernel int8` prompt tokens take int8 x int8 products (`torch._int_mm`,
`PREFILL_INT8`), generated tokens the weights' kernel, wherever either is computed.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from .bundled import short_reason
from .config import GROUP_SIZES, LINEAR_KERNELS, QUANTIZATIONS, BatchspecError
from .kv.support import as_linear, is_linear
from .memory import return_freed_memory
from .roles import prompt_positions

PACKED, TORCH = "packed", "torch"
# oneDNN's packed float32 product of one or two rows takes a slower path than that of three or
# more (timings: docs/cli.md, `--linear-kernel`), so fewer rows are padded with zeros to PADDED_ROWS:
# each row's product does not depend on the others', and a plain decoding step at batch 1 is faster.
# bfloat16 is left alone (its 1-row path is the fastest for most layers).
FEW_ROWS = 3
PADDED_ROWS = 4


# How many leading values of a weight stand for it in `forensics.oracle.model_identity` (which hashes
# that many of every parameter and buffer): a packed weight is opaque, so its sample is kept at pack time.
IDENTITY_SAMPLE = 256


# Called on a linear just before a pass replaces it (or leaves it in float): the loader converts a
# weight still mapped from its file to the model's dtype there, one linear at a time, so that no
# converted copy of every linear is ever held at once (`models.load_model`). None: nothing to do.
LinearLoader = Callable[[torch.nn.Linear], None] | None


class _FrozenLinear(torch.nn.Module):
    """What packed and quantized linears share: nn.Linear's shape attributes, and no `.to`."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight_dtype = linear.weight.dtype

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> _FrozenLinear:
        """`model.to(...)`, `.half()`, `.cuda()` reach here. The packed layouts depend on the dtype and
        the CPU, so converting the stored values would compute garbage: refuse any change instead."""
        probe = torch.empty(0, dtype=self.weight_dtype)  # the stored tensors are opaque or integer, on CPU
        moved = fn(probe)
        if moved.dtype != probe.dtype or moved.device != probe.device:
            raise BatchspecError(f"a model with packed or quantized linears cannot change dtype or device "
                                 f"({probe.dtype} on {probe.device.type} -> {moved.dtype} on "
                                 f"{moved.device.type}): load it with the dtype and device you need")
        return self


class PackedLinear(_FrozenLinear):
    """`nn.Linear` for inference with the weight in oneDNN's blocked layout (no autograd, no `.to`).

    The packed weight and the bias are buffers, so the module's tensors are visible to whatever walks
    them (`state_dict`, memory accounting); `state_dict` holds the dense weight under nn.Linear's
    names, so a packed model's state dict reads like the unpacked one's."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__(linear)
        self._pack(linear)

    def _pack(self, linear: torch.nn.Linear) -> None:
        weight = linear.weight.detach()
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight, None))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())
        self.register_buffer("weight_sample", weight.flatten()[:IDENTITY_SAMPLE].clone(), persistent=False)

    @property
    def weight(self) -> torch.Tensor:
        """The packed weight (oneDNN layout): its shape and dtype are nn.Linear's, which is what
        modeling code reads (e.g. Mamba2 casts to `lm_head.weight.dtype`); computing with it fails
        loudly rather than wrongly."""
        return self.packed_weight

    def unpacked(self) -> torch.nn.Linear:
        """An nn.Linear with the same weight and bias (the reorder is lossless)."""
        linear = torch.nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                                 device="cpu", dtype=self.weight_dtype)
        with torch.no_grad():
            linear.weight.copy_(self.packed_weight.to_dense())
            if self.bias is not None:
                linear.bias.copy_(self.bias)
        return linear.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if self.weight_dtype != torch.float32 or rows >= FEW_ROWS:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")
        padded = torch.nn.functional.pad(x.reshape(rows, self.in_features), (0, 0, 0, PADDED_ROWS - rows))
        out = torch.ops.mkldnn._linear_pointwise(padded, self.packed_weight, self.bias, "none", [], "")
        return out[:rows].reshape(*x.shape[:-1], self.out_features)

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        """nn.Linear's entries, dense: the oneDNN layout is opaque and depends on the CPU."""
        destination[prefix + "weight"] = self.packed_weight.to_dense()
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, local_metadata: dict[str, Any],
                              strict: bool, missing_keys: list[str], unexpected_keys: list[str],
                              error_msgs: list[str]) -> None:
        """Loads nn.Linear's dense entries (what `_save_to_state_dict` writes) and packs them again."""
        linear = self.unpacked()
        problems = len(missing_keys) + len(error_msgs)
        linear._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                     error_msgs)
        if len(missing_keys) + len(error_msgs) == problems:
            self._pack(linear)

    def __deepcopy__(self, memo: dict[int, Any]) -> PackedLinear:
        """A packed tensor has no storage that `copy.deepcopy` could copy: repack the dense weight."""
        return PackedLinear(self.unpacked())

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, oneDNN packed")


INT8, INT4, NONE = "int8", "int4", "none"
# Torch's CPU kernels need these shapes (torch 2.13): int4 packs 16 output channels together and
# refuses other N; int8 with K not a multiple of 16 returns wrong values or crashes the process
# (the K tried: docs/quantization.md). A linear that does not fit stays in float and the summary says so.
INT4_ROWS_MULTIPLE = 16
INT8_COLUMNS_MULTIPLE = 16
_QUANT_OPS = {INT8: ("_weight_int8pack_mm",),
              INT4: ("_convert_weight_to_int4pack_for_cpu", "_weight_int4pack_mm_for_cpu")}
_VECTOR_CPUS = ("AVX2", "AVX512")  # torch's vectorized x86 paths of both kernels; elsewhere a scalar loop

# `--prefill-kernel int8`: prompt tokens only (`roles.prompt_pass`) take int8 x int8 products
# (`QuantizedLinear._prompt_product`), which prefill several times faster than the weight-only
# kernels, whose cost grows with every few rows (docs/quantization.md). Exactness needs a token to
# take the same product wherever it is computed: a prompt token always as a prompt token (prefill,
# a prefill chunk, the oracle's prefill), a generated one always by the weights' kernel (a decoding
# step, a verify). Routing by a forward's size instead would not keep that.
PREFILL_INT8 = "prefill-int8"
INT_MM_MIN_ROWS = 17  # torch._int_mm's least number of rows (its checks are the CUDA kernel's)
# A prompt token's activations share one int8 scale per block of at most this many values. One scale
# for all 8,960 inputs of the bundled target's down projections (the SwiGLU products, whose outliers
# then set the step for every value) cost most of the fidelity; blocks of 1,280 there recovered it
# (docs/quantization.md), and the 1,536-wide inputs keep one scale.
PROMPT_SCALE_BLOCK = 1536
# The prompt path computes at most this many rows at a time: every step is per row, so slicing changes
# no bit; it bounds the float32 temporaries (a [rows, 8960] one is 35 KiB a row) and measured as fast
# or faster than whole prompts (docs/quantization.md).
PROMPT_ROWS = 128


@functools.cache
def scale_blocks(k: int) -> int:
    """How many blocks a prompt token's `k` activations are quantized in: the fewest that split `k`
    evenly, each at most PROMPT_SCALE_BLOCK values."""
    blocks = -(-k // PROMPT_SCALE_BLOCK)
    while k % blocks:
        blocks += 1
    return blocks


# Weights are quantized this many values at a time (whole rows): every step below is per row, so the
# result does not depend on the split, and the float32 temporaries of a 151936x1536 output layer
# stay at ~16 MB each instead of 0.9 GB (they set the peak RSS of loading a quantized model).
QUANTIZE_BLOCK_VALUES = 1 << 22


def _row_blocks(weight: torch.Tensor) -> list[slice]:
    rows = max(1, QUANTIZE_BLOCK_VALUES // max(1, weight.shape[1]))
    return [slice(lo, lo + rows) for lo in range(0, weight.shape[0], rows)]


def quantize_int8(weight: torch.Tensor, scale_dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per output channel: weight ~= q * scale with q in [-127, 127]. The scale is rounded
    to `scale_dtype` (bfloat16: what the int8 kernel reads) before q is computed, so q is chosen for
    the scale used."""
    n, k = weight.shape
    q, scale = torch.empty(n, k, dtype=torch.int8), torch.empty(n, dtype=scale_dtype)
    for rows in _row_blocks(weight):
        w = weight[rows].detach().float()  # [n, K]
        scale[rows] = (w.abs().amax(dim=1) / 127).to(scale_dtype)
        divisor = torch.where(scale[rows] == 0, 1.0, scale[rows].float())[:, None]  # an all-zero row stays 0
        q[rows] = torch.round(w / divisor).clamp(-127, 127).to(torch.int8)
    return q, scale


def quantize_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric per group of `group_size` inputs: weight ~= (q - 8) * scale + zero with q in
    [0, 15], torch's int4 convention (llama.cpp's Q4_K maps onto it: scale = d*sc, zero = 8*d*sc -
    dmin*m). Scale and zero are rounded to bfloat16 before q is chosen. Returns q [N, K] (int32),
    scale and zero [N, K // group_size]."""
    n, k = weight.shape
    groups = k // group_size
    q = torch.empty(n, k, dtype=torch.int32)
    scale, zero = torch.empty(n, groups, dtype=torch.bfloat16), torch.empty(n, groups, dtype=torch.bfloat16)
    for rows in _row_blocks(weight):
        w = weight[rows].detach().float().reshape(-1, groups, group_size)  # [n, G, group]
        low, high = w.amin(dim=-1), w.amax(dim=-1)  # [n, G]
        scale[rows] = ((high - low) / 15).to(torch.bfloat16)
        zero[rows] = (low + 8 * scale[rows].float()).to(torch.bfloat16)
        divisor = torch.where(scale[rows] == 0, 1.0, scale[rows].float())  # a constant group: q = 8 gives `zero`
        offset = zero[rows].float() - 8 * scale[rows].float()  # [n, G]: the value of q = 0
        values = torch.round((w - offset[..., None]) / divisor[..., None]).clamp(0, 15)  # [n, G, group]
        q[rows] = values.reshape(-1, k).to(torch.int32)
    return q, scale, zero


class QuantizedLinear(_FrozenLinear):
    """`nn.Linear` for inference with weight-only int8 (per output channel) or int4 (per group) weights,
    computed by torch's CPU kernels on bfloat16 activations (input cast in, output cast back).

    Every row's output is a function of that row alone (the kernels tile over output channels and
    keep each row's reduction order; tests/test_quant.py checks it bit for bit at 1 and 2 threads, 1
    to 64 rows), so the engine's exactness argument holds as for float linears. Weights are packed
    here, at load: the int4 layout depends on the CPU that packs it, so it is never stored on disk."""

    def __init__(self, linear: torch.nn.Linear, bits: str, group_size: int = 32, prompt_int8: bool = False,
                 int4: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> None:
        """`int4`: int4 values, scales and zeros given (a GGUF's own blocks) instead of fitted to
        `linear`'s weights, which are then never read."""
        super().__init__(linear)
        self.bits = bits
        self.group_size = group_size if bits == INT4 else self.in_features
        self.register_buffer("prompt_weight", None)  # `--prefill-kernel int8` only (`_hold_prompt`)
        self.register_buffer("prompt_scales", None)
        if bits == INT8:
            q, scale = quantize_int8(linear.weight.detach())
            self.register_buffer("qweight", q)  # [N, K] int8
            self.register_buffer("scales", scale)  # [N] bfloat16
            if prompt_int8:
                self._hold_prompt(q, scale)
        elif bits == INT4:
            self._hold_int4(*(int4 if int4 is not None else quantize_int4(linear.weight.detach(), group_size)),
                            prompt_int8=prompt_int8)
        else:
            raise BatchspecError(f"unknown weight quantization {bits!r}; choose int8 or int4")
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def _hold_int4(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, prompt_int8: bool = False) -> None:
        """Keep int4 values q [N, K] (0..15) packed for this CPU's kernel, whose layout depends on the
        CPU (so packing happens at load), and scales and zeros [N, G] as the kernel reads them. With
        `prompt_int8`, also the int8 prompt weights, fitted per output channel to the weights the int4
        kernel computes with (`(q - 8) * scale + zero`, scale and zero in bfloat16)."""
        scale, zero = scale.to(torch.bfloat16), zero.to(torch.bfloat16)
        if prompt_int8:
            groups = scale.shape[1]
            values = (q.float().reshape(q.shape[0], groups, -1) - 8) * scale.float()[..., None] + zero.float()[..., None]
            self._hold_prompt(*quantize_int8(values.reshape(q.shape), torch.float32))  # values: [N, K] float32
        self.register_buffer("qweight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1))  # [N, K/2]
        pairs = torch.stack([scale, zero], dim=-1)  # [N, G, 2]
        self.register_buffer("scales", pairs.transpose(0, 1).contiguous())  # [G, N, 2]

    def _hold_prompt(self, q: torch.Tensor, scale: torch.Tensor) -> None:
        """The prompt path's weights: q [N, K] int8 (int8 layers: their own, no copy) and the
        per-output-channel scale [N] in float32."""
        self.register_buffer("prompt_weight", q)  # [N, K] int8
        self.register_buffer("prompt_scales", scale.float())  # [N]

    @property
    def weights_kernel(self) -> str:
        """The kernel of generated tokens (and of prompt tokens without a prompt path)."""
        return INT8 if self.bits == INT8 else f"{INT4}-g{self.group_size}"

    @property
    def kernel(self) -> str:
        """How this layer computes, as summaries and the cost model's cache key name it."""
        if self.prompt_weight is None:
            return self.weights_kernel
        return f"{self.weights_kernel}+{PREFILL_INT8}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        prompt = prompt_positions() if self.prompt_weight is not None else 0
        if prompt and x.dim() >= 2 and prompt < x.shape[-2]:  # [..., tokens, K]: a prompt and what follows it
            return torch.cat([self._product(x[..., :prompt, :], True), self._product(x[..., prompt:, :], False)], dim=-2)
        return self._product(x, prompt > 0)

    def _product(self, x: torch.Tensor, prompt: bool) -> torch.Tensor:
        """x [..., K] -> [..., N] by the prompt path or the weights' kernel."""
        flat = x.reshape(-1, self.in_features)  # [rows, K]
        out = (self._prompt_product(flat) if prompt else self._weights_product(flat)).to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def _weights_product(self, flat: torch.Tensor) -> torch.Tensor:
        """[rows, K] -> [rows, N] by the weights' own kernel, on bfloat16 activations."""
        flat = flat.to(torch.bfloat16)
        if self.bits == INT8:
            return torch.ops.aten._weight_int8pack_mm(flat, self.qweight, self.scales)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.qweight, self.group_size, self.scales)

    def _prompt_product(self, flat: torch.Tensor) -> torch.Tensor:
        """[rows, K] -> [rows, N] as int8 x int8 products: each row's activations quantized with a
        scale per block of its own (`scale_blocks`), each block's products summed in int32 (exact, so
        no blocking of the kernel can change a bit), then scaled back and added block after block,
        element by element. Every step is per row: a row's result does not depend on the others."""
        rows, k = flat.shape
        if rows > PROMPT_ROWS:
            return torch.cat([self._prompt_product(flat[lo:lo + PROMPT_ROWS]) for lo in range(0, rows, PROMPT_ROWS)])
        blocks = scale_blocks(k)
        width = k // blocks
        x = flat.float().reshape(rows, blocks, width)  # [rows, blocks, width]
        step = x.abs().amax(dim=2, keepdim=True) / 127  # [rows, blocks, 1]
        step = torch.where(step > 0, step, 1.0)  # an all-zero block stays zero
        q = torch.round(x / step).clamp_(-127, 127).to(torch.int8)  # [rows, blocks, width]
        if rows < INT_MM_MIN_ROWS:  # the kernel's lower bound on rows: zero rows, which change no other row
            q = torch.nn.functional.pad(q, (0, 0, 0, 0, 0, INT_MM_MIN_ROWS - rows))
        total: torch.Tensor | None = None
        for b in range(blocks):
            lo = b * width
            part = torch._int_mm(q[:, b].contiguous(), self.prompt_weight[:, lo:lo + width].t())[:rows]  # [rows, N] int32
            part = part.float() * step[:, b]  # [rows, N] * [rows, 1]
            total = part if total is None else total + part
        return total * self.prompt_scales

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, {self.kernel} weights")


def quantization_kernel_reason(bits: str, device: torch.device, prompt_int8: bool = False) -> str | None:
    """Why torch's `bits` kernels (and, with `prompt_int8`, the prompt path's) cannot run on `device`
    (device kind, torch build, CPU), or None."""
    if device.type != "cpu":
        return f"quantized linears are CPU kernels (model is on {device.type})"
    missing = [name for name in _QUANT_OPS[bits] if not hasattr(torch.ops.aten, name)]
    if prompt_int8 and not hasattr(torch.ops.aten, "_int_mm"):
        missing.append("_int_mm (--prefill-kernel int8)")
    if missing:
        return f"this torch build ({torch.__version__}) lacks {', '.join('aten.' + m for m in missing)}"
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in _VECTOR_CPUS:
        return (f"torch's {bits} kernels are vectorized for AVX2 and AVX-512 only; this CPU runs {capability} "
                "(a scalar loop, slower than float32)")
    return None


def quantization_unsupported_reason(model: torch.nn.Module, bits: str, prompt_int8: bool = False) -> str | None:
    """Why `model` cannot run `bits` weights (and the prompt path) here, or None when it can."""
    param = next(model.parameters())
    if param.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"quantized linears take float32, bfloat16 or float16 models, not {param.dtype}"
    return quantization_kernel_reason(bits, param.device, prompt_int8)


def _quantizable(linear: torch.nn.Linear, bits: str, group_size: int) -> bool:
    if linear.in_features % INT8_COLUMNS_MULTIPLE:
        return False
    if bits == INT4:
        return linear.out_features % INT4_ROWS_MULTIPLE == 0 and linear.in_features % group_size == 0
    return True


def apply_quantization(model: torch.nn.Module, quantization: str, group_size: int = 32,
                       load: LinearLoader = None, prompt_int8: bool = False) -> None:
    """Replace the model's `nn.Linear`s by `QuantizedLinear`s of `quantization` ("none", "int8",
    "int4"), in place, each after `load` (see `LinearLoader`). Under int4 the output layer is int8: it
    is the layer whose errors reach the logits unmixed, and a Q4_K_M file keeps it at 6 bits for the
    same reason. A linear whose shape the kernels cannot take stays float (`weights_summary` lists
    it). `prompt_int8`: each but the output layer also gets the prompt path (`PREFILL_INT8`).
    Anything that cannot run here is one BatchspecError line."""
    if quantization not in QUANTIZATIONS:
        raise BatchspecError(f"unknown quantization {quantization!r}; choose one of {', '.join(QUANTIZATIONS)}")
    if group_size not in GROUP_SIZES:
        raise BatchspecError(f"quantization group size must be one of {', '.join(map(str, GROUP_SIZES))}, "
                             f"got {group_size!r}")
    if quantization == NONE:
        return
    reason = quantization_unsupported_reason(model, quantization, prompt_int8)
    if reason is not None:
        raise BatchspecError(f"--quantization {quantization}: {reason}")
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head_name = next((name for name, module in model.named_modules() if module is head), None)
    del head  # the float head must not outlive its replacement (see `replace_linears`)

    def quantized(name: str, linear: torch.nn.Linear) -> torch.nn.Module | None:
        if load is not None:
            load(linear)  # a layer left in float too: the probe below runs it
        bits = INT8 if name == head_name else quantization
        if not _quantizable(linear, bits, group_size):
            return None
        # The output layer computes a prefill's last position only: no prompt path to pay for there.
        return QuantizedLinear(linear, bits, group_size, prompt_int8 and name != head_name)

    replace_linears(model, quantized)
    try:
        _probe(model)
    except Exception as exc:  # modeling code that computes with a linear's weight
        raise BatchspecError(f"--quantization {quantization}: {type(model).__name__} does not run with quantized "
                             f"linears ({short_reason(exc)})") from exc


def has_prompt_path(model: torch.nn.Module) -> bool:
    """Whether prompt tokens take another product than generated ones in `model` (`PREFILL_INT8`)."""
    return any(isinstance(m, QuantizedLinear) and m.prompt_weight is not None for m in model.modules())


def weights_summary(model: torch.nn.Module) -> str:
    """Which kernels the model's linear layers run and how many of each, e.g. "int4-g32 x196, int8 x1";
    float layers left by a quantization show as "packed-float32 x2" (or "torch-float32")."""
    counts = _kernel_counts(model)
    return ", ".join(f"{kernel} x{n}" for kernel, n in counts.most_common()) or "no linear layers"


def main_kernel(model: torch.nn.Module) -> str:
    """The kernel most of the model's linear layers run ("int4-g32", "packed-float32", ...)."""
    counts = _kernel_counts(model)
    return counts.most_common(1)[0][0] if counts else "no"


def _kernel_counts(model: torch.nn.Module) -> Counter[str]:
    counts: Counter[str] = Counter()
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            counts[module.kernel] += 1
        elif isinstance(module, PackedLinear):
            counts[f"{PACKED}-{str(module.weight_dtype).removeprefix('torch.')}"] += 1
        elif isinstance(module, torch.nn.Linear) or is_linear(module):
            counts[f"{TORCH}-{str(module.weight.dtype).removeprefix('torch.')}"] += 1
    return counts


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers as stored (a packed oneDNN weight counts as its
    dense size; an int4 weight as half a byte per value): what a decoding step reads."""
    total = 0
    for tensor in [*model.parameters(), *model.buffers()]:
        total += tensor.numel() * tensor.element_size()
    return total


def native_bfloat16() -> bool:
    """Whether oneDNN computes bfloat16 natively on this CPU (AVX-512 BF16 or AMX). Without it, bfloat16
    linears run on torch's generic path: a 1-row product reads half the bytes of float32 and is faster,
    but the cost grows with every row (timings: docs/cli.md, `--draft-dtype`)."""
    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why this model's linears cannot be packed here, or None when they can."""
    param = next(model.parameters())
    if param.device.type != "cpu":
        return f"packed linears are a CPU kernel (model is on {param.device.type})"
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (mkldnn)"
    if param.dtype == torch.bfloat16:
        if not native_bfloat16():
            return "this CPU has no bfloat16 support in oneDNN"
    elif param.dtype != torch.float32:
        return f"packed linears support float32 and bfloat16, not {param.dtype}"
    return None


def pack_linears(model: torch.nn.Module, load: LinearLoader = None) -> int:
    """Replace every `nn.Linear` of `model` by a `PackedLinear` (in place), each after `load` (see
    `LinearLoader`); returns how many. The unpacked weights are released unless something else holds
    them (a tied embedding keeps its own)."""

    def packed(name: str, linear: torch.nn.Linear) -> PackedLinear:
        if load is not None:
            load(linear)
        return PackedLinear(linear)

    return replace_linears(model, packed)


def replace_linears(model: torch.nn.Module, make: Callable[[str, torch.nn.Linear], torch.nn.Module | None]) -> int:
    """Replace each linear layer of `model` (`kv.is_linear`: an `nn.Linear`, or GPT-2's `Conv1D` taken
    as one) by `make(its qualified name, it as an nn.Linear)`, in place, keeping those for which `make`
    returns None; returns how many were replaced. Each replaced linear
    is released at once: a loaded weight may still map its checkpoint file, whose pages it read stay
    resident as long as it lives, so holding every replaced linear to the end of the pass (a list
    of `model.modules()` does) counted all the float weights in the load's peak RSS."""
    parents = [(name, module) for name, module in model.named_modules()
               if any(is_linear(child) for child in module.children())]
    replaced = 0
    for parent_name, parent in parents:
        names = [name for name, child in parent.named_children() if is_linear(child)]
        for name in names:
            layer = make(f"{parent_name}.{name}" if parent_name else name, as_linear(getattr(parent, name)))
            if layer is not None:
                setattr(parent, name, layer)
                replaced += 1
                return_freed_memory()  # the float weight just released, before the next one is read
    return replaced


def unpack_linears(model: torch.nn.Module) -> None:
    """Undo `pack_linears` (in place)."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, PackedLinear):
                setattr(parent, name, child.unpacked())


@torch.inference_mode()
def _probe(model: torch.nn.Module) -> None:
    """One tiny forward: modeling code that does more with a linear's weight than read its shape
    and dtype fails here, at load, instead of mid-generation."""
    model(torch.zeros(1, 2, dtype=torch.long), use_cache=False)


def apply_linear_kernel(model: torch.nn.Module, kernel: str, load: LinearLoader = None) -> str:
    """Use `kernel` ("auto", "packed" or "torch") for the model's linears, packing each after `load`
    (see `LinearLoader`); returns the one in use. "packed" where it cannot run is an error; "auto"
    falls back to torch's."""
    if kernel not in LINEAR_KERNELS:
        raise BatchspecError(f"unknown linear kernel {kernel!r}; choose one of {', '.join(LINEAR_KERNELS)}")
    if kernel == TORCH:
        return TORCH
    reason = unsupported_reason(model)
    if reason is None:
        try:
            if not pack_linears(model, load):
                return TORCH  # nothing to pack
            _probe(model)
            return PACKED
        except Exception as exc:  # a linear oneDNN cannot pack, or modeling code using the packed weight
            unpack_linears(model)
            reason = f"{type(model).__name__} does not run with packed linears ({short_reason(exc)})"
    if reason is not None and kernel == PACKED:
        raise BatchspecError(f"--linear-kernel packed: {reason}")
    return TORCH


def linear_kernel(model: torch.nn.Module) -> str:
    """Which linear kernel the model runs: "packed" if any of its linears is packed."""
    return PACKED if any(isinstance(m, PackedLinear) for m in model.modules()) else TORCH
