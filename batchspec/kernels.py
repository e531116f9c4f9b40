"""Linear layers on CPU with weights packed once for oneDNN, instead of per call.

Why: with torch's default CPU linear (MKL) one token per row is a matrix-vector product read at
memory speed, but from two tokens on each call costs 2-3x as much (one 8960x1536 product: 3.8 ms for
1 row, 8-13 ms for 2-8 rows on this project's reference CPU; as far as we can tell the weight is
packed for a matrix-matrix product on every call). A Qwen2.5 1.5B forward there costs ~400 ms for
one token and ~800-1,250 ms for 2-6 tokens: verifying drafts cost twice a plain step, which is what
made speculation lose on CPUs. oneDNN with the weights reordered once at load costs about the same
for 1 to 16 rows (2-3 ms for that product): ~270 ms for one token and ~240-300 ms for 2-6 on the
same machine. Plain decoding gets faster too, and verifying K + 1 tokens costs about one plain step.

Every torch-private call lives here (`torch.ops.mkldnn._reorder_linear_weight` and
`_linear_pointwise`, the ops Inductor's CPU backend uses for frozen linears); `linear_kernel`
tells the cost model's cache which kernels a timing was made with. The packed layer computes the
same product as `nn.Linear` up to float rounding (the accumulation order differs), so the engine,
the plain-decoding baseline and the audit's oracle all use the model as loaded, packed or not.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .bundled import short_reason
from .config import LINEAR_KERNELS, BatchspecError

PACKED, TORCH = "packed", "torch"
# oneDNN's packed float32 product of one or two rows takes a slower path than that of three or
# more: on the reference CPU (AVX-512) 2.1 ms for 1-2 rows of an 8960x1536 weight, 1.6 ms for 3-4,
# 29 vs 22 ms for Qwen2.5's 151936x1536 output layer; a whole 1.5B step of one token ~250 ms
# against ~185 ms for four rows. So fewer rows are padded with zeros to PADDED_ROWS: each row's
# product does not depend on the others', and a plain decoding step at batch 1 takes ~30% less time.
# bfloat16 is left alone (its 1-row path is the fastest for most layers).
FEW_ROWS = 3
PADDED_ROWS = 4


class PackedLinear(torch.nn.Module):
    """`nn.Linear` for inference with the weight in oneDNN's blocked layout (no autograd, no `.to`)."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach()
        self.weight_dtype = weight.dtype
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        self.bias = None if linear.bias is None else linear.bias.detach().clone()

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

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> PackedLinear:
        """`model.to(...)`, `.half()`, `.cuda()` reach here. The blocked layout depends on the dtype,
        so converting the packed values would compute garbage: refuse any change instead."""
        probe = torch.empty(0, dtype=self.weight_dtype)  # the packed tensor is opaque (oneDNN layout), on CPU
        moved = fn(probe)
        if moved.dtype != probe.dtype or moved.device != probe.device:
            raise BatchspecError(f"a model with packed linears cannot change dtype or device ({probe.dtype} on "
                                 f"{probe.device.type} -> {moved.dtype} on {moved.device.type}): load it with the "
                                 "dtype and device you need, or with linear_kernel='torch'")
        return self

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, oneDNN packed")


def native_bfloat16() -> bool:
    """Whether oneDNN computes bfloat16 natively on this CPU (AVX-512 BF16 or AMX). Without it, bfloat16
    linears run on torch's generic path: a 1-row product reads half the bytes of float32 and is faster,
    but the cost grows with every row (an 8960x1536 product on an AVX2-only EPYC: 2.9 ms for 1 row,
    8.8 ms for 4, 32 ms for 16, against 5.7, 6.0 and 10.6 ms packed in float32)."""
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


def pack_linears(model: torch.nn.Module) -> int:
    """Replace every `nn.Linear` of `model` by a `PackedLinear` (in place); returns how many. The
    unpacked weights are released unless something else holds them (a tied embedding keeps its own)."""
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:
                setattr(parent, name, PackedLinear(child))
                replaced += 1
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


def apply_linear_kernel(model: torch.nn.Module, kernel: str) -> str:
    """Use `kernel` ("auto", "packed" or "torch") for the model's linears; returns the one in use.
    "packed" where it cannot run is an error; "auto" falls back to torch's."""
    if kernel not in LINEAR_KERNELS:
        raise BatchspecError(f"unknown linear kernel {kernel!r}; choose one of {', '.join(LINEAR_KERNELS)}")
    if kernel == TORCH:
        return TORCH
    reason = unsupported_reason(model)
    if reason is None:
        try:
            if not pack_linears(model):
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
