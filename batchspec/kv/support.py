"""What a model is, as the engine needs to know it, and whether batchspec supports it."""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import get_layer_types_and_kwargs
from transformers.pytorch_utils import Conv1D

from ..errors import BatchspecError


def num_layers(model: torch.nn.Module) -> int:
    return int(model.config.get_text_config().num_hidden_layers)


def embedding_rows(model: torch.nn.Module) -> int:
    """How many token ids the model can take as input (its embedding table's rows)."""
    return int(model.get_input_embeddings().num_embeddings)


def context_limit(model: torch.nn.Module) -> int | None:
    limit = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    return int(limit) if limit else None


def is_linear(module: torch.nn.Module) -> bool:
    """Whether `module` is a linear layer the kernels take: an `nn.Linear` (exactly that class) or
    transformers' `Conv1D` (GPT-2's blocks: the same product, the weight stored [in, out])."""
    return type(module) is torch.nn.Linear or type(module) is Conv1D


def as_linear(module: torch.nn.Module) -> torch.nn.Linear:
    """`module` (`is_linear`) as an `nn.Linear`: a `Conv1D`'s weight transposed into a new one. Left
    to itself, a `Conv1D` runs torch's addmm, whose result for a row changes with how many rows a
    forward feeds (1-2 rows against 3 or more on an AVX-512 EPYC), so a GPT-2's verify and its plain
    decoding step would disagree in the last bits; as a linear it takes the row-invariant kernels."""
    if type(module) is torch.nn.Linear:
        return module
    linear = torch.nn.Linear(module.nx, module.nf, bias=module.bias is not None, device="meta")
    linear.weight = torch.nn.Parameter(module.weight.detach().t().contiguous(), requires_grad=False)  # [nf, nx]
    if module.bias is not None:
        linear.bias = torch.nn.Parameter(module.bias.detach(), requires_grad=False)
    return linear


def check_supported(model: torch.nn.Module) -> None:
    """Refuse models whose attention our explicit masks would get wrong (and, for models with
    recurrent state, what `check_stateful` refuses)."""
    if is_stateful(model):
        check_stateful(model)
        return
    config = model.config.get_text_config()
    layer_types = getattr(config, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types) or getattr(config, "use_sliding_window", False):
        raise BatchspecError(
            f"{config.model_type}: sliding-window or non-standard attention layers are not supported yet"
        )



# Architectures whose recurrent layers were checked on transformers 5.24 / torch 2.13 CPU
# (docs/stateful.md): a prefill plus multi-token and single-token cached forwards on the model's own
# cache reproduce one full forward, and the layer types below are all they contain.
STATEFUL_ARCHITECTURES = (
    "mamba2",  # pure state space (Mamba2 mixers)
    "qwen3_next",  # Gated DeltaNet + attention (the SpecLA family)
    "qwen3_5_text",  # Gated DeltaNet + attention
    "olmo_hybrid",  # Gated DeltaNet + attention
    "falcon_h1",  # attention and a Mamba2 mixer side by side in every layer
    "granitemoehybrid",  # Mamba2 + attention (Granite 4)
    "bamba",  # Mamba2 + attention
    "lfm2",  # short convolutions (a conv state, no recurrent state) + attention
)

# Checked and found wrong on transformers 5.24 CPU: refused with the reason, never decoded.
_STATEFUL_REFUSED = {
    "mamba": "multi-token cached forwards restart the SSM scan instead of continuing the cached state "
             "(transformers 5.24), so a verification forward cannot be exact",
    "falcon_mamba": "multi-token cached forwards restart the SSM scan instead of continuing the cached state "
                    "(transformers 5.24), so a verification forward cannot be exact",
    "jamba": "its Mamba layers' multi-token cached forwards restart the SSM scan instead of continuing the "
             "cached state (transformers 5.24), so a verification forward cannot be exact",
    "nemotron_h": "its Mamba2 layers clamp dt at time_step_min in multi-token forwards but not in single-token "
                  "steps (transformers 5.24), so verification and plain decoding disagree",
    "zamba2": "its single-token steps disagree with its multi-token forwards (dt clamped at time_step_min in one "
              "path only, and more; transformers 5.24), so verification and plain decoding disagree",
}

# Cache layer types (transformers' names) that keep state instead of, or besides, K/V; and those a
# stateful model may consist of here (a sliding-window hybrid would need a sliding K/V window).
_STATE_LAYER_TYPES = ("linear_attention", "conv", "hybrid", "hybrid_sliding")
_STATEFUL_LAYER_TYPES = ("full_attention", "dummy", "linear_attention", "conv", "hybrid")


def _layer_types(model: torch.nn.Module) -> tuple[list[str], list[dict[str, Any]]]:
    """Cache layer type of each decoder layer, exactly as the model's own DynamicCache chooses them."""
    return get_layer_types_and_kwargs(model.config.get_text_config(decoder=True))


def is_stateful(model: torch.nn.Module) -> bool:
    """Whether some layer keeps a recurrent or convolution state instead of (or besides) K/V."""
    return any(t in _STATE_LAYER_TYPES for t in _layer_types(model)[0])


def check_stateful(model: torch.nn.Module) -> None:
    """Refuse, with one line, a stateful model whose state this library cannot keep exactly."""
    kind = model.config.get_text_config().model_type
    if kind in _STATEFUL_REFUSED:
        raise BatchspecError(f"{kind}: {_STATEFUL_REFUSED[kind]}")
    if kind not in STATEFUL_ARCHITECTURES:
        raise BatchspecError(
            f"{kind}: models with recurrent state are supported for {', '.join(STATEFUL_ARCHITECTURES)} only "
            f"(the architectures checked on transformers 5.24, docs/stateful.md)"
        )
    odd = sorted(set(_layer_types(model)[0]) - set(_STATEFUL_LAYER_TYPES))
    if odd:
        raise BatchspecError(f"{kind}: layer types {', '.join(odd)} are not supported with recurrent state")
    for module in model.modules():
        limit = getattr(module, "time_step_limit", None)
        if limit is not None and tuple(float(x) for x in limit) != (0.0, float("inf")):
            raise BatchspecError(
                f"{kind}: time_step_limit {tuple(limit)} is applied by multi-token forwards but not by single-token "
                "steps in transformers 5.24, so verification and plain decoding disagree"
            )


def keeps_float32_modules(model: torch.nn.Module, dtype: torch.dtype) -> bool:
    """Whether transformers keeps some of `model`'s modules in float32 when it is loaded in `dtype`
    (read from the model class's private lists), so a plain tensor-by-tensor cast would differ."""
    strict = getattr(model, "_keep_in_fp32_modules_strict", None)
    kept = getattr(model, "_keep_in_fp32_modules", None)
    return bool((strict and dtype in (torch.float16, torch.bfloat16)) or (kept and dtype == torch.float16))
