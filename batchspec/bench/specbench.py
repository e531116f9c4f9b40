"""Benchmark prompts: SpecBench's task groups and a stratified, deterministic selection.

SpecBench has 480 first-turn prompts: 80 each of five tasks and 10 each of eight MT-Bench
categories. The MT-Bench categories form one task group, so the six groups weigh the same. A
subset must keep that balance (a "first N prompts" cut would be all MT-Bench writing prompts),
and within MT-Bench it should cover every category, hence round-robin selection at both levels.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from importlib import resources
from itertools import zip_longest
from pathlib import Path

from ..config import BatchspecError, SamplingParams
from ..prompts import load_prompts

MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
TASK_GROUPS = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")
# Shipped inside the package (batchspec/data/spec_bench, with its source and licence) so a fresh
# clone or a plain `pip install` can benchmark. setuptools installs packages as plain files, so the
# resource is a real path that load_prompts can open.
SPECBENCH_FILE = Path(str(resources.files("batchspec").joinpath("data", "spec_bench", "question.jsonl")))


def task_group(category: str | None) -> str | None:
    """SpecBench task group of a prompt category (MT-Bench categories fold into `mt_bench`);
    any other category is its own group, so other categorized files get per-category figures."""
    if category is None:
        return None
    return "mt_bench" if category in MT_BENCH_CATEGORIES else category


@dataclass(frozen=True)
class BenchPrompt:
    """One prompt as every method sees it: already encoded, so all methods decode the same ids, and
    with its own sampling settings (seeded requests get seed + their index, as in `generate`)."""

    id: str
    text: str
    category: str | None
    group: str | None
    token_ids: tuple[int, ...]
    params: SamplingParams = SamplingParams()


def encode_prompts(
    path: str | Path, encode: Callable[[str], list[int]], max_tokens: int | None = None, fmt: str = "auto"
) -> tuple[list[BenchPrompt], dict[str, int]]:
    """Every readable prompt of `path` (read as `fmt`, see load_prompts), encoded; and how many
    were skipped, by reason.

    `max_tokens` drops prompts longer than that many tokens *before* any selection, so a length
    cap still yields the requested number of prompts per group when enough short ones exist.
    """
    kept: list[BenchPrompt] = []
    skipped: dict[str, int] = {}
    for record in load_prompts(path, fmt):
        reason = record.error
        ids: list[int] = []
        if reason is None:
            try:
                ids = encode(record.text)
            except BatchspecError as err:
                reason = str(err)
        if reason is None and max_tokens is not None and len(ids) > max_tokens:
            reason = f"longer than {max_tokens} tokens"
        if reason is not None:
            skipped[reason] = skipped.get(reason, 0) + 1
            continue
        kept.append(BenchPrompt(record.id, record.text, record.category, task_group(record.category), tuple(ids)))
    return kept, skipped


def group_order(prompts: Iterable[BenchPrompt]) -> list[str | None]:
    """Groups present, SpecBench's six first (in their usual order), then others as they appear."""
    present = list(dict.fromkeys(p.group for p in prompts))
    return [g for g in TASK_GROUPS if g in present] + [g for g in present if g not in TASK_GROUPS]


def _round_robin(prompts: list[BenchPrompt]) -> list[BenchPrompt]:
    """A group's prompts reordered so that any prefix covers its categories evenly."""
    by_category: dict[str | None, list[BenchPrompt]] = {}
    for p in prompts:
        by_category.setdefault(p.category, []).append(p)
    return [p for layer in zip_longest(*by_category.values()) for p in layer if p is not None]


def select(
    prompts: list[BenchPrompt], num_prompts: int | None = None, per_group: int | None = None
) -> list[BenchPrompt]:
    """A deterministic stratified subset, ordered group by group.

    `per_group` takes up to that many prompts from every group; `num_prompts` spreads that many
    across the groups as evenly as their sizes allow (earlier groups get the remainder). With
    neither, every prompt is kept. Uncategorized prompts form a single group.
    """
    if num_prompts is not None and per_group is not None:
        raise BatchspecError("give --num-prompts or --per-category, not both")
    for name, value in (("--num-prompts", num_prompts), ("--per-category", per_group)):
        if value is not None and value < 1:
            raise BatchspecError(f"{name} must be >= 1, got {value}")
    groups = {g: _round_robin([p for p in prompts if p.group == g]) for g in group_order(prompts)}
    if per_group is not None:
        quota = {g: min(per_group, len(ps)) for g, ps in groups.items()}
    elif num_prompts is not None:
        quota = dict.fromkeys(groups, 0)
        left = min(num_prompts, len(prompts))
        while left:
            for g, ps in groups.items():
                if left and quota[g] < len(ps):
                    quota[g] += 1
                    left -= 1
    else:
        quota = {g: len(ps) for g, ps in groups.items()}
    return [p for g, ps in groups.items() for p in ps[: quota[g]]]
