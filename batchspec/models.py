"""Loading target/drafter models and tokenizers, and the small helpers the engines need from them.

Everything runs offline: a source is the bundled pair, a local Hugging Face folder or a local
``.gguf`` file. Any failure caused by the user's input (missing path, corrupt weights, bad dtype,
mismatched vocabularies) surfaces as a one-line :class:`BatchspecError` instead of a deep
transformers traceback.
"""

from __future__ import annotations

import copy
import json
import mmap
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from .bundled import BUNDLED, bundled_model_dir, gguf_load_kwargs, short_reason
from .config import NGRAM, BatchspecError, ModelConfig, half_precision_refusal
from .kernels import (
    INT4,
    NONE,
    PREFILL_INT8,
    apply_linear_kernel,
    apply_quantization,
    native_bfloat16,
    quantization_kernel_reason,
    weight_bytes,
    weights_summary,
)
from .gguf_int4 import apply_bundled_int4, gguf_int4_enabled, use_gguf_int4
from .memory import return_freed_memory
from .kv import attention_path, keeps_float32_modules, use_exact_attention
from .prompts import unicode_problem

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}

# A folder needs one of these: without them transformers silently builds an *empty* tokenizer for
# some model types (gpt2, qwen2) instead of failing.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model", "tekken.json")


def parse_dtype(dtype: str) -> torch.dtype:
    """Map a user-facing dtype name ("float32"/"fp32", "bfloat16"/"bf16", "float16"/"fp16") to torch."""
    try:
        return _DTYPES[dtype.lower()]
    except (KeyError, AttributeError):
        raise BatchspecError(f"unknown dtype {dtype!r}; choose one of {', '.join(_DTYPES)}") from None


def _resolve(source: str | None, role: str) -> tuple[Path, str | None]:
    """Turn a source into (folder, GGUF file name or None); the bundled pair is converted on first use."""
    if source is None:
        if role not in BUNDLED:
            raise BatchspecError(f"unknown model role {role!r}; choose one of {', '.join(BUNDLED)}")
        return bundled_model_dir(role), None
    if not source.strip():
        raise BatchspecError("model path not found: '' (empty path)")
    path = Path(source).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise BatchspecError(f"could not load model from {source}: no config.json (not a Hugging Face model folder)")
        if not any((path / name).is_file() for name in _TOKENIZER_FILES):
            raise BatchspecError(f"could not load model from {source}: no tokenizer files (expected tokenizer.json)")
        return path, None
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path.parent, path.name
    if path.is_file():
        raise BatchspecError(f"model path {source} is a file but not .gguf; pass a Hugging Face folder or a .gguf file")
    raise BatchspecError(f"model path not found: {source} (models load offline from a local folder or .gguf file)")


def _load_tokenizer(folder: Path, gguf_file: str | None) -> PreTrainedTokenizerBase:
    """The tokenizer exactly as serialized in ``tokenizer.json`` when the folder has one.

    AutoTokenizer forces a model-family class for some model types (qwen2 -> Qwen2Tokenizer) that
    rebuilds the pipeline from the vocabulary with its own pre-tokenizer; for a tokenizer.json of a
    different kind (e.g. a small word-level test tokenizer in a qwen2 folder) that silently encodes
    to nothing. Loading tokenizer.json as-is is equivalent for the real Qwen folders and correct
    for every other one; AutoTokenizer remains the path for GGUF files and tokenizer.json-less folders.
    """
    if gguf_file is not None:
        return AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file, local_files_only=True)
    if (folder / "tokenizer.json").is_file():
        return PreTrainedTokenizerFast.from_pretrained(folder, local_files_only=True)
    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


def load_model(
    source: str | None, role: str = "target", dtype: str = "float32", device: str = "cpu",
    linear_kernel: str = "auto", quantization: str = "none", group_size: int = 32, prefill_kernel: str = "weights",
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer in eval mode on ``device``, its linear layers on
    ``linear_kernel`` (`batchspec.kernels`: packed oneDNN weights on CPU unless "torch"), quantized
    first if ``quantization`` is "int8" or "int4" (`kernels.apply_quantization`; layers it cannot take
    stay on ``linear_kernel``); with ``prefill_kernel`` "int8" those quantized linears compute prompt
    tokens as int8 x int8 products (`kernels.PREFILL_INT8`).

    ``source`` None means the bundled model for ``role`` ("target" or "draft"). Attention is
    batchspec's batch-invariant path (`kv.use_exact_attention`) wherever transformers' SDPA or eager
    attention would run; engines and the oracle share the loaded model, so they always see the same
    attention bits.
    """
    if prefill_kernel == "int8" and quantization == "none":  # as `ModelConfig` refuses it
        raise BatchspecError("--prefill-kernel int8 is for quantized targets: add --quantization int8 or int4")
    torch_dtype = parse_dtype(dtype)
    try:
        torch_device = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise BatchspecError(f"unknown device {device!r}: {short_reason(exc)}") from exc
    check_device(torch_device)
    folder, gguf_file = _resolve(source, role)
    model_kwargs: dict[str, Any] = {} if gguf_file is None else {"gguf_file": gguf_file, **gguf_load_kwargs()}
    label = source if source is not None else f"bundled {role} ({folder})"
    try:
        model, conversion = _from_pretrained(folder, torch_dtype, model_kwargs, lazy=torch_device.type == "cpu")
        tokenizer = _load_tokenizer(folder, gguf_file)
    except Exception as exc:  # transformers raises OSError/ValueError/KeyError/safetensors errors/...
        raise BatchspecError(f"could not load model from {label}: {short_reason(exc)}") from exc
    try:
        model.to(torch_device)
    except Exception as exc:
        raise BatchspecError(f"could not move model from {label} to {device}: {short_reason(exc)}") from exc
    model.eval()
    load = None if conversion is None else conversion.load
    prompt_int8 = prefill_kernel == "int8" and quantization != "none"
    if use_gguf_int4(source, role, quantization, group_size) and gguf_int4_enabled():
        apply_bundled_int4(model, role, load, prompt_int8)  # the GGUF's own Q4_K blocks (batchspec.gguf_int4)
    else:
        apply_quantization(model, quantization, group_size, load, prompt_int8)
    apply_linear_kernel(model, linear_kernel, load)
    if conversion is not None:
        conversion.finish()  # linears no pass took (`--linear-kernel torch`, no quantization)
    own_weights(model)
    use_exact_attention(model)
    if torch_dtype == torch.bfloat16 and torch_device.type == "cpu" and not computes_bfloat16(torch_device):
        warnings.warn(
            f"{label} in bfloat16: this CPU ({torch.backends.cpu.get_cpu_capability()}) has no native bfloat16, so "
            "its products run on torch's generic path, whose cost grows with every row and token a forward feeds "
            "(batches, verifies, prefills); float32 is likely faster here", stacklevel=2)
    return model, tokenizer


# A loaded tensor of at least this many bytes gets a memory map of its own bytes rather than a copy
# (`_own_tensors`); smaller ones (norms, biases) are copied.
_MAP_APART_BYTES = 1 << 20
# Mapped tensors converted to another dtype are read this many values at a time (`_converted`).
_READ_BLOCK_VALUES = 1 << 22
_FLOAT_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def _from_pretrained(folder: Path, dtype: torch.dtype, model_kwargs: dict[str, Any],
                     lazy: bool) -> tuple[PreTrainedModel, Conversion | None]:
    """transformers' `from_pretrained` in `dtype`, with no tensor left on the checkpoint-wide memory map
    and no weight read yet: large tensors map their own bytes (`_own_tensors`), so the quantizing or
    packing that follows reads one linear at a time and its pages leave RSS with it.

    transformers maps a safetensors file and hands out views when `dtype` is the stored one, but
    converts every tensor at once through the map otherwise, which made the whole file resident
    (2.4 GiB for the bundled drafter in bfloat16, beside its 1.2 GiB converted). So where `lazy`
    allows, a file stored in one other float dtype is loaded as stored and converted tensor by
    tensor (`Conversion`), the linears' when the quantizing or packing pass reaches them."""
    stored = None if model_kwargs else _stored_dtype(folder)
    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=dtype if stored is None else stored, local_files_only=True, **model_kwargs
    )
    _own_tensors(model, lambda tensor: tensor.numel() * tensor.element_size() >= _MAP_APART_BYTES)
    if stored is None or stored == dtype:
        return model, None
    conversion = Conversion.plan(model, dtype)
    if conversion is None:  # transformers' own conversion, the whole file read through its map at once
        del model
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=True)
        _own_tensors(model, lambda tensor: False)
        return model, None
    if not lazy:
        conversion.finish()
        return model, None
    return model, conversion


def _stored_dtype(folder: Path) -> torch.dtype | None:
    """The one float dtype of every floating tensor in the folder's safetensors weights (read from
    their headers, nothing mapped), or None: other files, mixed float dtypes, or unreadable."""
    index = folder / "model.safetensors.index.json"
    try:
        if index.is_file():
            files = sorted({folder / name for name in json.loads(index.read_text())["weight_map"].values()})
        elif (folder / "model.safetensors").is_file():
            files = [folder / "model.safetensors"]
        else:
            return None
        from safetensors import safe_open

        kinds = set()
        for file in files:
            with safe_open(str(file), framework="pt", backend="pread") as f:
                kinds |= {f.get_slice(key).get_dtype() for key in f.keys()}
    except Exception:  # transformers' own loading reports what is wrong with the folder
        return None
    floats = {_FLOAT_DTYPES.get(kind) for kind in kinds if kind.startswith(("F", "BF"))}
    return floats.pop() if len(floats) == 1 and None not in floats else None


class Conversion:
    """Turns a model loaded in its file's dtype into what `from_pretrained(dtype=...)` gives: each tensor
    cast to the dtype it has when the model is built in that dtype (transformers casts a loaded tensor
    to its freshly built parameter's dtype), read from its file a block at a time. Everything but the
    linear layers is converted by `plan`; each linear's weight and bias when `load` is called on it
    (the `kernels.LinearLoader` of the quantizing and packing passes, which release the float weight
    right after), and whatever is left by `finish`: a converted copy of all the linears (0.9 GiB of
    the bundled drafter's 1.2 GiB in bfloat16) is never held at once."""

    def __init__(self, targets: dict[int, tuple[torch.Tensor, torch.dtype]]) -> None:
        self._targets = targets  # id -> (tensor, dtype), tied tensors once
        self._mappings = _mapped_files()

    @classmethod
    def plan(cls, model: PreTrainedModel, dtype: torch.dtype) -> Conversion | None:
        """Convert `model`'s non-linear tensors to `dtype` as transformers would and return what converts
        its linears; None, with nothing changed, where transformers does more than cast: modules it
        keeps in float32 for `dtype`, or a buffer computed at build time whose dtype depends on the
        build dtype (its values would too)."""
        if keeps_float32_modules(model, dtype):
            return None
        try:
            with torch.device("meta"):  # parameters' dtypes only: nothing allocated
                built = AutoModelForCausalLM.from_config(copy.deepcopy(model.config), dtype=dtype)
        except Exception:  # a model that cannot be built so is left to transformers' own conversion
            return None
        planned = {name: t.dtype for name, t in [*built.named_parameters(remove_duplicate=False),
                                                 *built.named_buffers(remove_duplicate=False)]}
        persistent = set(built.state_dict())
        tensors = dict(model.named_parameters(remove_duplicate=False))
        buffers = dict(model.named_buffers(remove_duplicate=False))
        if set(planned) != set(tensors) | set(buffers):
            return None
        if any(t.dtype != planned[name] for name, t in buffers.items() if name not in persistent):
            return None
        targets = {id(t): (t, planned[name]) for name, t in [*tensors.items(), *buffers.items()]}
        conversion = cls(targets)
        in_linears = {id(t) for m in model.modules() if type(m) is torch.nn.Linear for t in m.parameters()}
        elsewhere = {id(t) for m in model.modules() if type(m) is not torch.nn.Linear
                     for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)]}
        for key in set(targets) - (in_linears - elsewhere):
            conversion._convert(key)
        model.config.dtype = dtype
        return conversion

    def load(self, linear: torch.nn.Linear) -> None:
        """Convert `linear`'s weight and bias (a `kernels.LinearLoader`)."""
        for tensor in linear.parameters():
            self._convert(id(tensor))

    def finish(self) -> None:
        """Convert every tensor still waiting."""
        for key in list(self._targets):
            self._convert(key)

    def _convert(self, key: int) -> None:
        if key in self._targets:
            tensor, dtype = self._targets.pop(key)
            if tensor.dtype != dtype:
                tensor.data = _converted(tensor.data, dtype, self._mappings)


def _converted(tensor: torch.Tensor, dtype: torch.dtype, mappings: list[_Mapping]) -> torch.Tensor:
    """`tensor.to(dtype)`; a tensor mapped from a file is read with plain reads, a block at a time:
    through its map every page read would stay resident until the whole tensor was converted (the
    bundled drafter's float32 embedding and output layer are 0.5 GiB each)."""
    mapping = _mapping_of(tensor, mappings)
    file = None if mapping is None or not tensor.is_contiguous() else _open_mapped(mapping)
    if file is None:
        return tensor.to(dtype)
    out = torch.empty(tensor.shape, dtype=dtype)
    flat, block = out.view(-1), torch.empty(min(tensor.numel(), _READ_BLOCK_VALUES), dtype=tensor.dtype)
    position = mapping.offset + tensor.data_ptr() - mapping.lo
    with file:
        for lo in range(0, tensor.numel(), _READ_BLOCK_VALUES):
            part = block[:min(_READ_BLOCK_VALUES, tensor.numel() - lo)]
            _read_into(file, part.view(torch.uint8).numpy(), position + lo * tensor.element_size())
            flat[lo:lo + part.numel()] = part.to(dtype)
    return out


def _read_into(file: BinaryIO, buffer: Any, position: int) -> None:
    """Fill `buffer` (a writable numpy byte array) from `file` at `position`, or raise."""
    view = memoryview(buffer).cast("B")
    file.seek(position)
    while view.nbytes:
        read = file.readinto(view)
        if not read:
            raise OSError(f"{file.name} ended at byte {file.tell()} while reading a mapped tensor")
        view = view[read:]


def own_weights(model: torch.nn.Module) -> None:
    """After quantizing and packing: every tensor of `model` still mapped from its checkpoint file is
    copied into memory of its own, except embedding tables, which keep a fresh map of their bytes.

    A mapped page counts in RSS once read and for as long as its map lives, whatever read it. An
    embedding is a lookup: a step reads one row per token, so mapped only the rows of tokens seen
    become resident (the bundled target's float32 table is 0.87 GiB, 45% of its int4 weights), and
    the kernel can drop them again under memory pressure, as llama.cpp's mapped weights. The map is
    made afresh so that rows read while loading (a tied output layer quantized from the table reads
    it all) leave RSS. A table that a float linear also computes with is read whole every step:
    copied like everything else."""
    linear_weights = {id(m.weight) for m in model.modules() if type(m) is torch.nn.Linear}
    lookups = {id(m.weight) for m in model.modules()
               if isinstance(m, torch.nn.Embedding) and id(m.weight) not in linear_weights}
    _own_tensors(model, lambda tensor: id(tensor) in lookups)
    return_freed_memory()


def _own_tensors(model: torch.nn.Module, keep_mapped: Callable[[torch.Tensor], bool]) -> None:
    """Give every parameter and buffer that views a mapped weight file memory of its own: a memory map
    of just its bytes where `keep_mapped` says so (nothing read yet; its pages go when it does), else
    a copy. A tensor viewing a checkpoint-wide map kept the whole map alive, and every page that
    anything had read from it resident, as long as any one tensor of the file lived."""
    mappings = _mapped_files()
    if not mappings:
        return
    tensors = [*model.parameters(), *model.buffers()]  # shared (tied) tensors once each
    for tensor in tensors:
        mapping = _mapping_of(tensor, mappings)
        if mapping is None:
            continue
        fresh = _map_apart(tensor, mapping) if keep_mapped(tensor) else None
        tensor.data = tensor.data.clone() if fresh is None else fresh


@dataclass(frozen=True)
class _Mapping:
    """One memory-mapped range of a weight file, as /proc/self/maps lists it."""

    lo: int
    hi: int
    offset: int  # of `lo` in the file
    device: int
    inode: int
    path: str


def _mapped_files() -> list[_Mapping]:
    """This process's memory-mapped weight files (Linux; none elsewhere)."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    mappings = []
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].endswith((".safetensors", ".gguf", ".bin")):
            lo, hi = fields[0].split("-")
            major, minor = fields[3].split(":")
            mappings.append(_Mapping(int(lo, 16), int(hi, 16), int(fields[2], 16),
                                     os.makedev(int(major, 16), int(minor, 16)), int(fields[4]), fields[5]))
    return mappings


def _mapping_of(tensor: torch.Tensor, mappings: list[_Mapping]) -> _Mapping | None:
    if tensor.device.type != "cpu" or tensor.layout != torch.strided or tensor.is_mkldnn:
        return None
    start = tensor.data_ptr()
    return next((m for m in mappings if m.lo <= start < m.hi), None)


def _map_apart(tensor: torch.Tensor, mapping: _Mapping) -> torch.Tensor | None:
    """`tensor`'s bytes mapped afresh from its file, copy-on-write as transformers' map was; None where
    that cannot be done (not contiguous, not wholly inside the map, or the file at that path is no
    longer the one mapped), so the caller copies instead."""
    nbytes = tensor.numel() * tensor.element_size()
    if not tensor.is_contiguous() or nbytes == 0 or tensor.data_ptr() + nbytes > mapping.hi:
        return None
    position = mapping.offset + tensor.data_ptr() - mapping.lo
    start = position - position % mmap.ALLOCATIONGRANULARITY
    file = _open_mapped(mapping)
    if file is None:
        return None
    try:
        with file:
            mapped = mmap.mmap(file.fileno(), position - start + nbytes, offset=start, access=mmap.ACCESS_COPY)
    except (OSError, ValueError):
        return None
    # the tensor holds the map: it is unmapped when the tensor's memory is released
    flat = torch.frombuffer(mapped, dtype=tensor.dtype, count=tensor.numel(), offset=position - start)
    return flat.view(tensor.shape)


def _open_mapped(mapping: _Mapping) -> BinaryIO | None:
    """The file that `mapping` maps, opened for reading; None if the file at its path is another one
    now (replaced or deleted since it was mapped) or cannot be opened."""
    try:
        file = open(mapping.path, "rb", buffering=0)
    except OSError:
        return None
    stat = os.fstat(file.fileno())
    if (stat.st_dev, stat.st_ino) != (mapping.device, mapping.inode):
        file.close()
        return None
    return file


@dataclass
class ModelPair:
    """A target model, an optional drafter, and the tokenizer they share (the target's)."""

    target: PreTrainedModel
    draft: PreTrainedModel | None
    tokenizer: PreTrainedTokenizerBase


def check_device(device: torch.device) -> None:
    """Refuse a device index that does not exist, before any loading: torch takes `cpu:99` as the
    CPU without a word, and `cuda:7` on a 1-GPU machine fails only when the model moves there."""
    if device.type == "cpu" and device.index not in (None, 0):
        raise BatchspecError(f"there is no device {device}: the CPU is `cpu` (or `cpu:0`)")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise BatchspecError(f"there is no device {device}: torch sees no CUDA GPU here")
        if device.index is not None and device.index >= count:
            raise BatchspecError(f"there is no device {device}: torch sees {count} CUDA GPU(s), cuda:0..cuda:{count - 1}")


def computes_bfloat16(device: torch.device) -> bool:
    """Whether `device` computes bfloat16 natively: a CPU with AVX-512 BF16 or AMX
    (`kernels.native_bfloat16`, which says what emulation costs), a CUDA GPU that has it."""
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return device.type == "cpu" and native_bfloat16()


def draft_dtype(config: ModelConfig) -> str:
    """The drafter's dtype name: as given, the target's when not given, and for "auto" bfloat16 where
    the device computes it natively, the target's elsewhere (emulated, a drafter's catch-ups and
    batched steps cost more than in float32)."""
    if config.draft_dtype is None:
        return config.dtype
    if config.draft_dtype.lower() != "auto":
        return config.draft_dtype
    try:
        device = torch.device(config.device)
    except (RuntimeError, TypeError):
        return config.dtype  # load_model refuses the device with one clear line
    return "bfloat16" if computes_bfloat16(device) else config.dtype


def draft_quantization(config: ModelConfig) -> str:
    """The drafter's quantization: as given; unset, "auto" under draft dtype "auto" and the target's
    otherwise. "auto" is int4 where torch's int4 kernel runs and the device has no native bfloat16,
    else the target's. Measured on an AVX-512 EPYC with native bfloat16 (docs/quantization.md, the
    0.5B drafter's whole forward): int4 46 ms against bfloat16's 70 ms for one row and token, but
    69 vs 63 ms for four rows and 961 vs 336 ms for a 64-token catch-up, so there the bfloat16
    drafter stays; without native bfloat16 the drafter is float32, which int4 beats at 1-8 rows.
    Never changes the output, only acceptance and speed."""
    chosen = config.draft_quantization
    if chosen is None:
        auto_dtype = config.draft_dtype is not None and config.draft_dtype.lower() == "auto"
        chosen = "auto" if auto_dtype else config.quantization
    if chosen != "auto":
        return chosen
    try:
        device = torch.device(config.device)
    except (RuntimeError, TypeError):
        return config.quantization  # load_model refuses the device with one clear line
    if quantization_kernel_reason(INT4, device) is not None or computes_bfloat16(device):
        return config.quantization
    return INT4


def draft_prefill_kernel(quantization: str, device: str) -> str:
    """The drafter's prompt path: "int8" for a quantized drafter where torch has the int8 product, so
    that its prefills, deferred ones included (`drafters.model`), run about twice as fast as by its
    weights' kernel from ~64 tokens on, for an int8 copy of its linears (docs/quantization.md); else
    "weights". Unlike the target's (`--prefill-kernel`), it never changes the output, only how fast
    drafts come."""
    if quantization == NONE:
        return "weights"
    try:
        reason = quantization_kernel_reason(quantization, torch.device(device), prompt_int8=True)
    except (RuntimeError, TypeError):
        return "weights"  # load_model refuses the device with one clear line
    return "int8" if reason is None else "weights"


def load_pair(config: ModelConfig, need_draft: bool = True) -> ModelPair:
    """Load the target and (if ``need_draft``) the drafter of ``config``, and check that they can
    be paired. Both dtypes are validated before any (slow) loading starts. Draft ``ngram`` is prompt
    lookup: no drafter model to load."""
    if parse_dtype(config.dtype) in (torch.bfloat16, torch.float16):
        raise half_precision_refusal(config.dtype)
    drafter_dtype = draft_dtype(config)
    need_draft = need_draft and config.draft != NGRAM
    if need_draft:
        parse_dtype(drafter_dtype)
    target_model, target_tok = load_model(config.target, role="target", dtype=config.dtype, device=config.device,
                                          linear_kernel=config.linear_kernel, quantization=config.quantization,
                                          group_size=config.quantization_group_size,
                                          prefill_kernel=config.prefill_kernel)
    if not need_draft:
        return ModelPair(target=target_model, draft=None, tokenizer=target_tok)
    quantization = draft_quantization(config)
    draft_model, draft_tok = load_model(config.draft, role="draft", dtype=drafter_dtype, device=config.device,
                                        linear_kernel=config.linear_kernel, quantization=quantization,
                                        group_size=config.quantization_group_size,
                                        prefill_kernel=draft_prefill_kernel(quantization, config.device))
    try:
        check_compatible(target_model, target_tok, draft_model, draft_tok)
    except BatchspecError as exc:
        names = f"target {config.target or 'bundled'} and draft {config.draft or 'bundled'}"
        raise BatchspecError(f"{names} cannot be paired: {exc}") from exc
    return ModelPair(target=target_model, draft=draft_model, tokenizer=target_tok)


def weights_report(config: ModelConfig, pair: ModelPair | None = None) -> dict[str, str]:
    """Which weights and kernels each model runs, for every run's summary: the loaded models' linears
    by kernel, their bytes and their attention path (`kv.attention_path`) when they are here, else (models on Ray workers) what the config asks.
    Outputs are exact against plain decoding of the target as listed here."""
    if pair is None:
        quantization = draft_quantization(config)
        target_path = f"+{PREFILL_INT8}" if config.prefill_kernel == "int8" else ""
        draft_path = f"+{PREFILL_INT8}" if draft_prefill_kernel(quantization, config.device) == "int8" else ""
        return {"target": f"{config.dtype}, quantization {config.quantization}{target_path}",
                "draft": f"{draft_dtype(config)}, quantization {quantization}{draft_path}"}
    report = {}
    for role, model in (("target", pair.target), ("draft", pair.draft)):
        if model is not None:
            dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
            report[role] = (f"{dtype}: {weights_summary(model)}; {weight_bytes(model) / 2**30:.2f} GiB; "
                            f"{attention_path(model)} attention")
    return report


def output_vocab_size(model: PreTrainedModel) -> int:
    """Rows of the LM head, i.e. the width of the logits (may exceed the tokenizer's vocabulary)."""
    head = model.get_output_embeddings()
    rows = getattr(head, "out_features", None)  # nn.Linear and batchspec.kernels.PackedLinear
    if rows is not None:
        return int(rows)
    return int(model.config.get_text_config().vocab_size)


def check_compatible(
    target_model: PreTrainedModel,
    target_tok: PreTrainedTokenizerBase,
    draft_model: PreTrainedModel,
    draft_tok: PreTrainedTokenizerBase,
) -> None:
    """Refuse a drafter whose token ids mean something else than the target's.

    Speculative decoding compares draft and target probabilities id by id, so both the token->id
    mapping and the logits width must match exactly.
    """
    target_vocab = target_tok.get_vocab()
    draft_vocab = draft_tok.get_vocab()
    if target_vocab != draft_vocab:
        differing = len(set(target_vocab.items()) ^ set(draft_vocab.items()))
        raise BatchspecError(
            f"tokenizer vocabularies differ ({len(target_vocab)} vs {len(draft_vocab)} tokens, "
            f"{differing} token->id entries not shared)"
        )
    target_width = output_vocab_size(target_model)
    draft_width = output_vocab_size(draft_model)
    if target_width != draft_width:
        raise BatchspecError(f"output vocabulary sizes differ (target lm head {target_width}, draft lm head {draft_width})")


def _as_ids(value: int | list[int] | tuple[int, ...] | None) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    """Every id that ends a generation: the generation config's eos ids plus the tokenizer's eos.

    Instruct models end a turn with a chat token (Qwen: ``<|im_end|>``) that is not always the
    tokenizer's eos, so both sources are needed. Order is preserved, duplicates dropped.
    """
    generation_config = getattr(model, "generation_config", None)
    ids = _as_ids(getattr(generation_config, "eos_token_id", None)) + _as_ids(tokenizer.eos_token_id)
    return tuple(dict.fromkeys(ids))


# Stands in for the user's text when the chat template is rendered alone, to find where the text
# goes in the rendered string; only ever searched for, never tokenized.
_PROMPT_PLACEHOLDER = "\x00batchspec-prompt\x00"


def _render_chat(tokenizer: PreTrainedTokenizerBase, text: str) -> str:
    messages = [{"role": "user", "content": text}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def special_spans(tokenizer: PreTrainedTokenizerBase, text: str) -> list[tuple[int, int]]:
    """Character spans of `text` that the tokenizer turns into special (control) tokens."""
    special = {i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return [tuple(span) for i, span in zip(enc["input_ids"], enc["offset_mapping"]) if i in special]


def tokenize(tokenizer: PreTrainedTokenizerBase, text: str, split_special_tokens: bool) -> list[int]:
    """Ids of `text` with no special tokens added; `split_special_tokens` reads spelled control tokens
    (e.g. `<|im_end|>`) as plain text."""
    if not text:
        return []
    return list(tokenizer(text, add_special_tokens=False, split_special_tokens=split_special_tokens)["input_ids"])


def encode_prompt(
    tokenizer: PreTrainedTokenizerBase, text: str, chat_template: bool = True, allow_special_tokens: bool = False
) -> list[int]:
    """Token ids for one user prompt, wrapped in the chat template when the tokenizer has one.

    The rendered template already contains any special tokens it needs, so it is tokenized without
    adding special tokens a second time. The user's text is tokenized as plain text, as serving
    engines do: otherwise a prompt spelling `<|im_end|>\n<|im_start|>assistant` becomes real
    control tokens and forges chat turns. `allow_special_tokens` lets such spellings through as
    control tokens (for prompts that are raw model input on purpose).

    For text that spells no control token the ids are exactly those of the rendered template,
    tokenized whole (pieces tokenized apart can merge differently at their seams, e.g. "\n" + "\n").
    Only text that does spell one is tokenized apart, between the template's nearest own control
    tokens, with special-token parsing off.
    """
    if not text.strip():
        raise BatchspecError("empty prompt")
    problem = unicode_problem(text)
    if problem is not None:
        raise BatchspecError(f"prompt: {problem}")
    if not (chat_template and tokenizer.chat_template):
        return list(tokenizer.encode(text, split_special_tokens=not allow_special_tokens))
    rendered = _render_chat(tokenizer, text)
    ids = tokenize(tokenizer, rendered, split_special_tokens=False)
    if allow_special_tokens:
        return ids
    prefix, found, suffix = _render_chat(tokenizer, _PROMPT_PLACEHOLDER).partition(_PROMPT_PLACEHOLDER)
    if not (found and rendered.startswith(prefix) and rendered.endswith(suffix)
            and len(prefix) + len(suffix) <= len(rendered)):
        # the template transforms the text beyond trimming, so its place in `rendered` is unknown
        if special_spans(tokenizer, text):
            raise BatchspecError("the prompt spells control tokens and this model's chat template does not insert "
                                 "prompts verbatim, so they cannot be kept as text: pass --allow-special-tokens "
                                 "or --no-chat-template")
        return ids
    start, end = len(prefix), len(rendered) - len(suffix)
    if not any(s < end and e > start for s, e in special_spans(tokenizer, rendered)):
        return ids
    head = max((e for _, e in special_spans(tokenizer, prefix)), default=0)
    tail = end + min((s for s, _ in special_spans(tokenizer, suffix)), default=len(suffix))
    return (
        tokenize(tokenizer, rendered[:head], split_special_tokens=False)
        + tokenize(tokenizer, rendered[head:tail], split_special_tokens=True)
        + tokenize(tokenizer, rendered[tail:], split_special_tokens=False)
    )
