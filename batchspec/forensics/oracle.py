"""The oracle every check compares with: plain decoding of each prompt alone, computed once.

Both `batchspec audit` and `batchspec bench` use this one class. Outputs are kept in memory for
the run and, given a path, in a JSON file across runs, keyed by what they depend on: the model's
weights (`model_identity`), the token budget, the stop ids, the sampling settings and the prompt.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Collection, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from ..config import BatchspecError, SamplingParams
from ..kernels import IDENTITY_SAMPLE
from ..reference import reference_decode

ORACLE_CACHE_FORMAT = 1


def model_identity(model: torch.nn.Module) -> str:
    """A short fingerprint of the weights, dtype, device type and attention kernel: what the
    oracle's tokens depend on.

    Hashing the first values of every parameter and buffer is cheap even for billions of weights and
    changes with any other checkpoint, fine-tune, dtype or quantization, unlike the folder name.
    Packed and quantized linears keep their weights in buffers (`batchspec.kernels`); a packed oneDNN
    tensor is opaque, so it is skipped and its layer's `weight_sample` buffer stands for it.
    """
    digest = hashlib.sha256()
    config = model.config
    device = next(model.parameters()).device.type
    dtype = next(model.parameters()).dtype
    digest.update(f"{config.model_type}|{dtype}|{device}|{getattr(config, '_attn_implementation', '')}".encode())
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.is_mkldnn:
            continue
        digest.update(name.encode())
        digest.update(f"{tuple(tensor.shape)}|{tensor.dtype}".encode())
        digest.update(tensor.detach().flatten()[:IDENTITY_SAMPLE].float().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


class Oracle:
    """Plain batch-1 decoding of prompts under one setting (`params`, `stop_ids`), each computed once.

    With `path`, outputs are loaded from and saved to that JSON file (an audit run twice, or a bench
    followed by an audit of the same prompts, decodes nothing the second time).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        params: SamplingParams,
        stop_ids: Collection[int],
        path: Path | None = None,
    ) -> None:
        self.model = model
        self.params = params
        self.stop_ids = frozenset(stop_ids)
        self.path = path
        self.identity = model_identity(model)
        self.entries: dict[str, dict[str, Any]] = self._load(path) if path is not None else {}
        self.dirty = False

    @staticmethod
    def _load(path: Path) -> dict[str, dict[str, Any]]:
        if not path.is_file():
            return {}
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            if data.get("format") != ORACLE_CACHE_FORMAT or not isinstance(data.get("entries"), dict):
                raise ValueError("unknown format")
        except (ValueError, AttributeError) as err:
            raise BatchspecError(
                f"{path} is not a batchspec oracle cache ({err}); delete it or pass another file"
            ) from None
        return data["entries"]

    def key(self, prompt_ids: Sequence[int], params: SamplingParams | None = None) -> str:
        """The cache key of one prompt (under `params`, default the oracle's). Greedy keys carry no
        sampling settings, so files written before sampled oracles existed stay valid."""
        p = params or self.params
        stops = sorted(self.stop_ids | frozenset(p.stop_token_ids))
        material: list[Any] = [self.identity, p.max_new_tokens, stops, list(prompt_ids)]
        if not p.greedy:
            material.append({"temperature": p.temperature, "top_p": p.top_p, "top_k": p.top_k, "seed": p.seed})
        return hashlib.sha256(json.dumps(material).encode()).hexdigest()

    def __call__(self, prompt_ids: Sequence[int], params: SamplingParams | None = None) -> list[int]:
        """What plain decoding of this prompt alone produces under `params` (default: the oracle's),
        decoded now unless already known."""
        p = params or self.params
        key = self.key(prompt_ids, p)
        if key not in self.entries:
            tokens = reference_decode(self.model, list(prompt_ids), p, self.stop_ids)
            self.entries[key] = {"token_ids": tokens}
            self.dirty = True
        return list(self.entries[key]["token_ids"])

    def precompute(
        self, prompts: Iterable[Sequence[int]], params: Sequence[SamplingParams] | None = None, desc: str = "oracle"
    ) -> None:
        """Decode every prompt not known yet (prompt i under params[i], default the oracle's), with a
        progress bar; what was computed is saved even when interrupted."""
        pairs = list(zip(prompts, params)) if params is not None else [(p, self.params) for p in prompts]
        todo = [(p, sp) for p, sp in pairs if self.key(p, sp) not in self.entries]
        try:
            for prompt, sp in tqdm(todo, desc=desc, unit="prompt", file=sys.stderr, leave=False):
                self(prompt, sp)
        finally:
            self.save()

    def save(self) -> None:
        """Write atomically, so an interrupted run never leaves a truncated cache behind."""
        if self.path is None or not self.dirty:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps({"format": ORACLE_CACHE_FORMAT, "entries": self.entries}), encoding="utf-8")
        os.replace(tmp, self.path)
        self.dirty = False
